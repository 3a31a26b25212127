"""The MQTT sink: status with birth and Will, heartbeat, events and metrics, through a durable
outbox (docs/ARCHITECTURE.md, MQTT topics contract).

One connection loop, on the stack it shares with the watcher (exporters/mqtt_client.py):
connect (MQTT v5, explicit keepalive, TLS that always checks the host name), publish the
retained `online` birth and a heartbeat, then drain the outbox in order with a window of QoS 1
publishes in flight, deleting entries only after their successful PUBACK.

Heartbeats never go through the outbox (nor the state store): each one is published on the
live connection when it is due, and none is made while there is no connection. A heartbeat is
a "now" message on a retained topic that keeps only the newest, so a queued one says nothing
that the next fresh one does not say better; and a heartbeat that needed the store would stop
on a full state disk, where the watcher would read the silence as a hung agent (node_stale)
instead of the agent's own words about what is wrong (node_unhealthy). An acknowledged
outbox entry the store cannot delete (a full disk) is remembered and not sent again: a store
that cannot write never ends the connection, and so never the heartbeats. Any failure ends the connection;
the loop waits (the shared backoff) and connects again with the next birth number. Each kind of failure is logged and raised as an event once per transition, not
per retry. A clean stop publishes `offline` itself: a broker sends the Will only when a client
vanishes, never after a clean DISCONNECT.

Nothing larger than the broker's Maximum Packet Size (its CONNACK) is sent: the broker would
end the connection for it, and an outbox entry over the limit would end every connection from
the head of the queue. An event is cut down to fit, a heartbeat sent compact, a metrics
snapshot left out (exporters/heartbeat.py; docs/mqtt.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Sequence

import aiomqtt
import structlog

from agent.contracts.errors import ConfigError, StateStoreError
from agent.contracts.model import Event, MetricFamily, MetricType, RepairAction, Sample, Severity
from agent.contracts.sink import OutboxEntry, SinkContext
from exporters.heartbeat import (
    compact_heartbeat,
    cut_event,
    heartbeat_payload,
    metrics_payload,
    status_payload,
)
from exporters.mqtt_client import (
    FAILURE_TEXT,
    Backoff,
    Credentials,
    FailureTracker,
    Publisher,
    PublishRefused,
    classify,
    connection,
    load_credentials,
    new_client,
    reconnect_forever,
)
from exporters.mqtt_settings import MqttSettings
from exporters.outbox import Outbox, OutboxLimits

log = structlog.get_logger(component="mqtt")

G, C = MetricType.GAUGE, MetricType.COUNTER
CONNECTED = MetricFamily("gpuwarden_mqtt_connected", G, "1 while connected to the broker")
LAST_ACK_AGE = MetricFamily(
    "gpuwarden_mqtt_last_ack_age_seconds",
    G,
    "Seconds since the broker last acknowledged a publish (absent before the first)",
    unit="seconds",
)
BIRTH_SEQUENCE = MetricFamily(
    "gpuwarden_mqtt_birth_sequence", G, "Birth number (bdseq) of the current or last connection"
)
OUTBOX_ENTRIES = MetricFamily(
    "gpuwarden_mqtt_outbox_entries", G, "Undelivered entries in the outbox", ("kind",)
)
OUTBOX_DROPPED = MetricFamily(
    "gpuwarden_mqtt_outbox_dropped_total",
    C,
    "Outbox entries dropped undelivered (bounds: entries, bytes, age)",
    ("kind",),
)
PUBLISHED = MetricFamily(
    "gpuwarden_mqtt_published_total", C, "Publishes the broker acknowledged", ("kind",)
)
CONNECT_FAILURES = MetricFamily(
    "gpuwarden_mqtt_connection_failures_total",
    C,
    "Failed connections and lost sessions",
    ("reason",),
)
TOO_LARGE = MetricFamily(
    "gpuwarden_mqtt_payloads_too_large_total",
    C,
    "Payloads larger than the broker's maximum packet size: sent cut down to fit (cut) or "
    "not sent (left_out)",
    ("kind", "outcome"),
)
KINDS = ("event", "heartbeat", "metrics")
OUTCOMES = ("cut", "left_out")
TOPIC_OF_KIND = {"event": "events", "heartbeat": "heartbeat", "metrics": "metrics"}
ENFORCE_EVERY = 1.0
"""Seconds between outbox bound checks while draining (the age bound is one indexed query)."""
DISCONNECTED_ENFORCE_EVERY = 5.0
"""Seconds between outbox bound checks while no broker is reachable."""
DROPS_QUIET_AFTER = 60.0
"""Seconds without a drop after which dropping counts as over (one info event)."""
HEARTBEAT_TOKEN = -1
"""Publisher token of a heartbeat: outbox entries have positive sequence numbers."""


class MqttSink:
    def __init__(self, settings: MqttSettings, runtime: SinkContext) -> None:
        self.name = "mqtt"
        self.settings = settings
        self.runtime = runtime
        self.expected_interval: float | None = runtime.heartbeat_settings.interval
        self.base_topic = f"{settings.topic_prefix}/{runtime.node_id}"
        self.outbox = Outbox(
            runtime.store,
            OutboxLimits(
                settings.outbox_max_entries, settings.outbox_max_bytes, settings.outbox_max_age
            ),
        )
        runtime.enable_outbox()
        runtime.subscribe(lambda _event: self._wake.set())
        self.bdseq = 0
        self.heartbeat_seq = 0
        self.connected = False
        self.published: Counter[str] = Counter()
        self.failures = FailureTracker()
        self.connect_failures = self.failures.counts
        self._credentials = Credentials(None, None)
        self._publisher: Publisher | None = None
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._last_enforce = 0.0
        self._last_drop: float | None = None
        self.backoff = Backoff.of(settings)
        self._produce_backoff = Backoff.of(settings)
        self._stopping = False
        """stop() began: the retained heartbeat is being, or has been, cleared, so no
        heartbeat is sent any more."""
        self._store_failing: set[str] = set()
        """Tasks ("connection", "produce") whose last state store access failed."""
        self._beats_in_flight = 0
        """Heartbeats published on this connection and not yet acknowledged."""
        self._delivered_unacked: set[int] = set()
        """Outbox entries the broker acknowledged that the store could not delete yet."""
        self.too_large: Counter[tuple[str, str]] = Counter()
        """(kind, outcome) -> payloads larger than the broker's maximum packet size."""
        self._too_large_told: set[tuple[str, str, int]] = set()
        self._snapshot_left_out: tuple[int, int] | None = None
        """(size, limit) of the last metrics snapshot, while it was too large to send."""

    def topic(self, leaf: str) -> str:
        return f"{self.base_topic}/{leaf}"

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Read the password and load the TLS files now: a mistake there stops the agent
        (exit code 1) with a message, instead of a retry loop that can never succeed."""
        try:
            self._credentials = load_credentials(self.settings, "mqtt")
        except ConfigError as exc:
            raise OSError(f"mqtt: {exc}") from None

    async def run(self) -> None:
        self._tasks = [
            asyncio.create_task(self._produce(), name="mqtt:produce"),
            asyncio.create_task(self._connection_loop(), name="mqtt:connection"),
        ]
        try:
            await asyncio.gather(*self._tasks)
        finally:
            for task in self._tasks:
                task.cancel()

    async def stop(self) -> None:
        """Say `offline` (retained, QoS 1) while still connected, clear the retained
        heartbeat, then disconnect."""
        self._stopping = True  # no heartbeat after the clear below
        publisher = self._publisher
        if publisher is not None and self.connected:
            payload = status_payload("offline", self.bdseq, time.time(), reason="shutdown")
            try:
                await publisher.publish_acked(self.topic("status"), payload, 1, True, timeout=2.0)
                log.info("published offline", bdseq=self.bdseq)
                # A retained heartbeat outlives the node: a watcher restarted after the node
                # was retired would see it again. The status says `offline` now; the next
                # start publishes a heartbeat at once. So a decommission is one command (clear
                # the status), and nothing of a stopped node pretends to beat.
                await publisher.publish_acked(self.topic("heartbeat"), b"", 1, True, timeout=2.0)
            except aiomqtt.MqttError as exc:
                log.warning("could not publish offline before stopping", error=str(exc))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- producing heartbeats and metric snapshots ------------------------------------------

    async def _produce(self) -> None:
        loop = asyncio.get_running_loop()
        heartbeat_every = self.runtime.heartbeat_settings.interval
        next_heartbeat = loop.time()
        next_metrics = loop.time() + min(self.settings.metrics_interval, heartbeat_every)
        while True:
            now = loop.time()
            try:
                if now >= next_heartbeat:
                    next_heartbeat += heartbeat_every * max(
                        1, (now - next_heartbeat) // heartbeat_every
                    )
                    self._send_heartbeat()
                if now >= next_metrics:
                    next_metrics = max(next_metrics + self.settings.metrics_interval, now)
                    payload = metrics_payload(self.runtime, time.time())
                    await self._queue("metrics", "snapshot", payload)
                if not self.connected:  # while connected, the drain loop applies the bounds
                    await self._maybe_enforce()
            except StateStoreError as exc:
                # A locked or full store is usually transient: escaping here would end the
                # sink (run() gathers both tasks) with no restart. Pause and go on.
                self._on_store_failure("produce", exc)
                await asyncio.sleep(self._produce_backoff.next_delay())
                continue
            self._on_store_ok("produce")
            self._produce_backoff.reset()
            wake_at = min(next_heartbeat, next_metrics, loop.time() + DISCONNECTED_ENFORCE_EVERY)
            await asyncio.sleep(max(0.0, wake_at - loop.time()))

    def _send_heartbeat(self) -> None:
        """Publish a heartbeat now (QoS 1, retained) if connected; without a connection there
        is nobody to tell, and the next connection starts with a fresh one. Nothing here
        touches the state store: the depth and drops are kept in memory."""
        publisher = self._publisher
        if publisher is None or not self.connected or self._stopping:
            return  # stopping: the retained heartbeat is being cleared, none may follow it
        self.heartbeat_seq += 1
        payload = heartbeat_payload(
            self.runtime,
            seq=self.heartbeat_seq,
            bdseq=self.bdseq,
            now=time.time(),
            outbox_depth=self.outbox.depth(),
            outbox_dropped=dict(self.outbox.dropped),
        )
        topic = self.topic("heartbeat")
        fitting = self._fitting(publisher, "heartbeat", topic, 1, payload)
        if fitting is None:
            return
        # A publish that fails ends the connection in the drain loop (it sees the loss).
        with contextlib.suppress(aiomqtt.MqttError):
            publisher.publish_tracked(HEARTBEAT_TOKEN, topic, fitting, 1, True)
            self._beats_in_flight += 1

    async def _queue(self, kind: str, key: str, payload: bytes) -> None:
        """A snapshot (heartbeat, metrics) into the outbox. One the store refuses is not
        kept: the next one says more. The refusal itself is the runtime's to report (health,
        state_store_write_failing); here it is logged once per spell."""
        try:
            await self.runtime.in_store_thread(self.outbox.put, kind, key, payload)
        except StateStoreError as exc:
            if "queue" not in self._store_failing:
                log.warning("cannot queue for MQTT; skipping until it works", error=str(exc))
                self._store_failing.add("queue")
            return
        self._on_store_ok("queue")
        self._wake.set()

    # -- connection -------------------------------------------------------------------------

    async def _next_bdseq(self) -> int:
        """Persisted and increased per connection: a Will delayed from an older connection
        never carries the current number, so a watcher cannot mistake it for this one's."""
        state = self.runtime.state
        stored = await self.runtime.in_store_thread(state.get, "mqtt", "bdseq")
        current = stored if isinstance(stored, int) else 0
        self.bdseq = max(current, self.bdseq) + 1
        state.put("mqtt", "bdseq", self.bdseq)  # never raises: a full disk is the runtime's
        return self.bdseq

    def _client_for(self, bdseq: int) -> aiomqtt.Client:
        will = aiomqtt.Will(
            self.topic("status"), status_payload("offline", bdseq, time.time()), qos=1, retain=True
        )
        return new_client(
            self.settings,
            self._credentials,
            default_identifier=f"gpuwarden-{self.runtime.node_id}",
            will=will,
            max_inflight=self.settings.publish_window,
        )

    async def _connection_loop(self) -> None:
        await reconnect_forever(self._session, self.backoff, self._on_session_failure)

    async def _session(self) -> None:
        """One connection: birth, then drain the outbox until something fails (it raises)."""
        bdseq = await self._next_bdseq()
        client = self._client_for(bdseq)
        publisher = Publisher(client)
        try:
            async with connection(client) as lost:
                self._publisher = publisher
                await publisher.publish_acked(
                    self.topic("status"),
                    status_payload("online", bdseq, time.time()),
                    1,
                    True,
                    timeout=self.settings.connect_timeout,
                )
                self._on_connected(bdseq)
                self._send_heartbeat()  # at once: the last one may be long gone
                await self._drain(publisher, lost)
        finally:
            self._publisher = None
            self.connected = False
            self._beats_in_flight = 0

    def _on_session_failure(self, exc: Exception) -> None:
        if isinstance(exc, aiomqtt.MqttError):
            self._on_failure(exc)
        elif isinstance(exc, StateStoreError):
            # The outbox could not be read or acknowledged (locked db, full disk): retry after
            # the same backoff instead of ending the sink for good. Entries stay in the outbox
            # until acknowledged, so nothing is lost.
            self._on_store_failure("connection", exc)
        else:  # a bug: the traceback once, not once per retry
            self.runtime.record_failure(self.name, f"error: {exc!r}")
            if self.failures.failed("error"):
                log.error("mqtt: the connection failed unexpectedly; reconnecting", exc_info=exc)

    def _on_connected(self, bdseq: int) -> None:
        self.connected = True
        self.backoff.reset()
        self._on_store_ok("connection")
        self.runtime.record_delivery(self.name)
        log.info("connected to the broker", url=self.settings.url, bdseq=bdseq)
        if self.failures.recovered():
            self.runtime.emit(
                Event(
                    source="mqtt",
                    kind="broker_connected",
                    severity=Severity.INFO,
                    repair_action=RepairAction.NONE,
                    subject=self.settings.url,
                    message=f"mqtt: connected to {self.settings.url} again (birth number {bdseq}); "
                    "the outbox is being delivered",
                )
            )

    def _on_failure(self, exc: aiomqtt.MqttError) -> None:
        kind, action = classify(exc, "mqtt")
        self.runtime.record_failure(self.name, f"{kind}: {exc}")
        if not self.failures.failed(kind):
            log.debug("mqtt still failing", reason=kind, error=str(exc))
            return
        message = f"mqtt: {FAILURE_TEXT[kind]} at {self.settings.url}: {exc}"
        log.error(message, reason=kind, action=action)
        self.runtime.emit(
            Event(
                source="mqtt",
                kind=f"broker_{kind}",
                severity=Severity.WARNING,
                repair_action=RepairAction.NONE,
                subject=self.settings.url,
                message=message,
                action=action,
                attributes={"reason": kind},
            )
        )

    def _on_store_failure(self, task: str, exc: StateStoreError) -> None:
        """Ledger on every failure; the log once per transition, not per retry."""
        self.runtime.record_failure(self.name, f"state_store: {exc}")
        if task in self._store_failing:
            log.debug("mqtt state store still failing", task=task, error=str(exc))
            return
        self._store_failing.add(task)
        log.error("mqtt: the state store failed; retrying after a pause", task=task, error=str(exc))

    def _on_store_ok(self, task: str) -> None:
        if task in self._store_failing:
            self._store_failing.discard(task)
            log.info("mqtt: the state store works again", task=task)

    # -- draining the outbox ----------------------------------------------------------------

    async def _drain(self, publisher: Publisher, lost: asyncio.Task[None]) -> None:
        """Keep up to publish_window entries in flight (fewer when the broker's Receive
        Maximum is lower: one of those is kept for the heartbeat), in outbox order; delete each batch of
        acknowledged entries in one statement. Returns only by raising (connection over).
        Every outbox read and delete runs in the runtime's store thread."""
        window = self.settings.publish_window
        if publisher.receive_maximum is not None and publisher.receive_maximum <= window:
            window = max(1, publisher.receive_maximum - 1)
        inflight: dict[int, OutboxEntry] = {}
        last_seq = 0
        last_progress = time.monotonic()
        publisher.on_progress = self._wake.set
        lost.add_done_callback(lambda _task: self._wake.set())
        store = self.runtime.in_store_thread
        while True:
            # Cleared before the store calls below, which yield: a wake-up (a PUBACK, a new
            # event) during them makes the wait at the end return at once.
            self._wake.clear()
            self.runtime.beat(f"sink:{self.name}")
            await self._maybe_enforce()
            if len(inflight) < window:
                for entry in await store(self.outbox.peek, window - len(inflight), last_seq):
                    last_seq = entry.seq
                    if entry.kind == "heartbeat" or entry.seq in self._delivered_unacked:
                        # Queued by an older version (superseded by the live heartbeats), or
                        # delivered already: deleted, not sent.
                        self._delivered_unacked.add(entry.seq)
                        continue
                    if not self._publish(publisher, entry):
                        self._delivered_unacked.add(entry.seq)  # too large even cut: not sent
                        continue
                    inflight[entry.seq] = entry
            if publisher.completed:
                done, publisher.completed = publisher.completed, []
                await self._settle(done, inflight)
                last_progress = time.monotonic()
                continue
            await self._delete_delivered()
            if lost.done():
                raise aiomqtt.MqttError("the connection to the broker was lost") from (
                    None if lost.cancelled() else lost.exception()
                )
            waiting = len(inflight) + self._beats_in_flight
            waited = time.monotonic() - last_progress
            if waiting and waited > self.settings.connect_timeout:
                raise aiomqtt.MqttError(f"no PUBACK for {waiting} publishes within {waited:.0f} s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), ENFORCE_EVERY)
            if not inflight and not self._beats_in_flight:
                last_progress = time.monotonic()

    async def _settle(
        self, done: list[tuple[int, PublishRefused | None]], inflight: dict[int, OutboxEntry]
    ) -> None:
        acked: list[OutboxEntry] = []
        beats = 0
        refused: PublishRefused | None = None
        for seq, error in done:
            if seq == HEARTBEAT_TOKEN:
                self._beats_in_flight = max(0, self._beats_in_flight - 1)
            entry = inflight.pop(seq, None)
            if error is not None:
                refused = refused or error
            elif seq == HEARTBEAT_TOKEN:
                beats += 1
            elif entry is not None:
                acked.append(entry)
        self.published.update(entry.kind for entry in acked)
        self.published["heartbeat"] += beats
        if acked or beats:
            self.runtime.record_delivery(self.name)
        self._delivered_unacked.update(entry.seq for entry in acked)
        await self._delete_delivered()
        if refused is not None:
            raise refused

    async def _delete_delivered(self) -> None:
        """Delete the delivered entries from the outbox. A store that refuses (a full disk)
        keeps them there, remembered here so that they are not sent again, and deleted on a
        later try: the connection, and with it the heartbeats, goes on."""
        if not self._delivered_unacked:
            return
        seqs = sorted(self._delivered_unacked)
        try:
            await self.runtime.in_store_thread(self.outbox.ack, seqs)
        except StateStoreError as exc:
            self._on_store_failure("delete", exc)
            return
        self._on_store_ok("delete")
        self._delivered_unacked.difference_update(seqs)

    def _publish(self, publisher: Publisher, entry: OutboxEntry) -> bool:
        """Send one outbox entry, cut to the broker's limit where it must be; False when it
        cannot be sent at all (it is deleted: the broker would end every connection for it)."""
        leaf = TOPIC_OF_KIND.get(entry.kind, entry.kind)
        qos = self.settings.metrics_qos if entry.kind == "metrics" else 1
        topic = self.topic(leaf)
        payload = self._fitting(publisher, entry.kind, topic, qos, entry.payload)
        if payload is None:
            return False
        publisher.publish_tracked(entry.seq, topic, payload, qos, entry.kind == "heartbeat")
        return True

    # -- the broker's maximum packet size ---------------------------------------------------

    def _fitting(
        self, publisher: Publisher, kind: str, topic: str, qos: int, payload: bytes
    ) -> bytes | None:
        """`payload` as the broker will take it: itself, cut to fit (an event, a heartbeat),
        or None (a metrics snapshot; anything that cannot be cut small enough). A broker ends
        the connection of a client that sends a packet over its limit, so an entry over it
        at the head of the outbox would end every connection and hold up all behind it."""
        room = publisher.room(topic, qos)
        if room is None or len(payload) <= room:
            if kind == "metrics":
                self._snapshot_left_out = None
            return payload
        fitting: bytes | None = None
        if kind == "event":
            fitting = cut_event(payload, room)
        elif kind == "heartbeat":
            fitting = compact_heartbeat(payload, room)
        outcome = "left_out" if fitting is None else "cut"
        limit = publisher.max_packet_size or 0
        self.too_large[kind, outcome] += 1
        if kind == "metrics":
            self._snapshot_left_out = (len(payload), limit)
        self._tell_too_large(kind, outcome, len(payload), limit)
        return fitting

    def _tell_too_large(self, kind: str, outcome: str, size: int, limit: int) -> None:
        """Once per kind, outcome and limit: the log line and a warning event."""
        if (kind, outcome, limit) in self._too_large_told:
            return
        self._too_large_told.add((kind, outcome, limit))
        what = {"event": "an event", "heartbeat": "a heartbeat", "metrics": "a metrics snapshot"}
        done = (
            "was cut down to fit (the whole event stays in this node's history)"
            if kind == "event" and outcome == "cut"
            else "is sent compact, without the per-collector detail"
            if outcome == "cut"
            else "is not sent"
        )
        message = (
            f"mqtt: {what.get(kind, kind)} of {size} bytes is larger than the broker's maximum "
            f"packet size ({limit} bytes) and {done}"
        )
        action = (
            f"raise the broker's maximum packet size above {size} bytes (mosquitto: "
            "max_packet_size), or send less: [mqtt] metrics_interval, fewer collectors"
        )
        log.warning(message, kind=kind, outcome=outcome, size=size, max_packet_size=limit)
        self.runtime.emit(
            Event(
                source="mqtt",
                kind="mqtt_payload_too_large",
                severity=Severity.WARNING,
                repair_action=RepairAction.NONE,
                subject=self.settings.url,
                message=message,
                action=action,
                attributes={
                    "kind": kind,
                    "outcome": outcome,
                    "bytes": size,
                    "max_packet_size": limit,
                },
            )
        )

    async def _maybe_enforce(self) -> None:
        """The bounds, at most every ENFORCE_EVERY seconds, in the store thread (cheap while
        within them: the totals are kept in memory; a drop is SQL over the victims)."""
        now = time.time()
        if now - self._last_enforce < ENFORCE_EVERY:
            return
        self._last_enforce = now
        try:
            dropped = await self.runtime.in_store_thread(self.outbox.enforce, now)
        except StateStoreError as exc:
            log.error("cannot apply the outbox bounds", error=str(exc))
            return
        self._enforced(dropped, now)

    def _enforced(self, dropped: dict[str, int], now: float) -> None:
        if dropped:
            if self._last_drop is None:
                self._report_drops(dropped)
            self._last_drop = now
        elif self._last_drop is not None and now - self._last_drop > DROPS_QUIET_AFTER:
            self._last_drop = None
            self.runtime.emit(
                Event(
                    source="mqtt",
                    kind="outbox_drops_stopped",
                    severity=Severity.INFO,
                    repair_action=RepairAction.NONE,
                    subject="outbox",
                    message="mqtt: the outbox is within its bounds again",
                    attributes={f"dropped_{k}": v for k, v in sorted(self.outbox.dropped.items())},
                )
            )

    def enforce_now(self) -> dict[str, int]:
        """Apply the outbox bounds at once, in the caller's thread (tests); what was dropped."""
        now = time.time()
        self._last_enforce = now
        dropped = self.outbox.enforce(now)
        self._enforced(dropped, now)
        return dropped

    def _report_drops(self, dropped: dict[str, int]) -> None:
        counts = ", ".join(f"{n} {kind}" for kind, n in sorted(dropped.items()))
        limits = self.outbox.limits
        self.runtime.emit(
            Event(
                source="mqtt",
                kind="outbox_dropped",
                severity=Severity.CRITICAL if dropped.get("event") else Severity.WARNING,
                repair_action=RepairAction.NONE,
                subject="outbox",
                message=f"mqtt: the outbox is full or too old and dropped undelivered entries "
                f"({counts}); limits {limits.max_entries} entries, {limits.max_bytes} bytes, "
                f"{limits.max_age:g} s",
                action="restore delivery to the broker, or raise [mqtt] outbox_max_entries / "
                "outbox_max_bytes / outbox_max_age",
                attributes={f"dropped_{k}": v for k, v in sorted(dropped.items())},
            )
        )

    def problems(self) -> list[str]:
        out = []
        if self._last_drop is not None:
            total = sum(self.outbox.dropped.values())
            out.append(f"mqtt outbox dropped {total} undelivered entries")
        if self._snapshot_left_out is not None:
            size, limit = self._snapshot_left_out
            out.append(
                f"mqtt metrics snapshots ({size} bytes) exceed the broker's maximum packet "
                f"size ({limit} bytes) and are not sent"
            )
        return out

    # -- metrics ----------------------------------------------------------------------------

    def families(self) -> Sequence[MetricFamily]:
        return (
            CONNECTED,
            LAST_ACK_AGE,
            BIRTH_SEQUENCE,
            OUTBOX_ENTRIES,
            OUTBOX_DROPPED,
            PUBLISHED,
            CONNECT_FAILURES,
            TOO_LARGE,
        )

    def samples(self) -> Sequence[Sample]:
        out = [CONNECTED.sample(1 if self.connected else 0), BIRTH_SEQUENCE.sample(self.bdseq)]
        entry = self.runtime.ledger.get(self.name)
        age = None if entry is None else entry.delivery_age()
        if age is not None:
            out.append(LAST_ACK_AGE.sample(max(0.0, age)))
        depth = self.outbox.depth()  # kept in memory: a scrape asks SQLite nothing
        out.extend(OUTBOX_ENTRIES.sample(depth.get(kind, 0), kind) for kind in KINDS)
        out.extend(OUTBOX_DROPPED.sample(self.outbox.dropped.get(kind, 0), kind) for kind in KINDS)
        out.extend(PUBLISHED.sample(self.published.get(kind, 0), kind) for kind in KINDS)
        out.extend(
            TOO_LARGE.sample(self.too_large[kind, outcome], kind, outcome)
            for kind in KINDS
            for outcome in OUTCOMES
        )
        out.extend(
            CONNECT_FAILURES.sample(n, reason)
            for reason, n in sorted(self.connect_failures.items())
        )
        return out
