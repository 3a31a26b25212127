"""The watcher's MQTT side: subscribe to every node, feed the state machine, publish alerts.

It runs on the connection stack it shares with the agent's sink (exporters/mqtt_client.py):
the same login, TLS, MQTT v5 with PUBACK codes read, failure names, and one
reconnect loop with one backoff (reset once connected). Alert changes are logged at once and
published on the alerts topic (QoS 1) when connected; those raised while the broker is away,
or refused by it, wait in a bounded queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections import deque
from collections.abc import Callable

import aiomqtt
import structlog

from agent import __version__
from agent.contracts.clock import StepWatch
from agent.contracts.model import Severity
from agent.program.watch.alertmanager import AlertmanagerSender
from agent.program.watch.fleet import AlertChange, Fleet
from agent.program.watch.metrics import MetricsServer
from agent.program.watch.settings import WatchSettings
from agent.runtime.systemd import Notifier, Supervisor, run_watchdog, watchdog_interval
from exporters.http import parse_listen
from exporters.mqtt_client import (
    FAILURE_TEXT,
    Backoff,
    FailureTracker,
    PacketTooLarge,
    Publisher,
    PublishRefused,
    classify,
    connection,
    load_credentials,
    new_client,
    reconnect_forever,
)

log = structlog.get_logger(component="watch")

MAX_PENDING_ALERTS = 10_000
STOP_SECONDS = 4.0
"""SIGTERM to exit, inside systemd's TimeoutStopSec=10s."""


def fleet_from(settings: WatchSettings, inventory: list[str], now: float) -> Fleet:
    return Fleet(
        prefix=settings.topic_prefix,
        stale_after_intervals=settings.stale_after_intervals,
        default_interval=settings.default_interval,
        quiet_window=settings.quiet_window,
        quiet_min_nodes=settings.quiet_min_nodes,
        broker_grace=settings.broker_grace,
        max_payload_bytes=settings.max_payload_bytes,
        max_nodes=settings.max_nodes,
        reconnect_grace=settings.reconnect_grace,
        forget_offline_after=settings.forget_offline_after,
        inventory=inventory,
        now=now,
    )


def as_bytes(payload: object) -> bytes:
    if isinstance(payload, (bytes, bytearray)):
        return bytes(payload)
    return b"" if payload is None else str(payload).encode()


def direct_queue(handle: Callable[[aiomqtt.Message], None]) -> type[asyncio.Queue[aiomqtt.Message]]:
    """A queue class for aiomqtt's `queue_type` that handles each message as it is decoded.

    aiomqtt's message iterator costs two tasks and an `asyncio.wait` per message, more than
    parsing a heartbeat: through it the watcher managed about 6,000 heartbeats/s, short of
    10,000 nodes at 1 Hz (bench/watch_throughput.py). Nothing is stored, so the iterator
    only ever ends with the disconnection.
    """

    class DirectQueue(asyncio.Queue[aiomqtt.Message]):
        def put_nowait(self, item: aiomqtt.Message) -> None:
            handle(item)

    return DirectQueue


class Watcher:
    def __init__(
        self,
        settings: WatchSettings,
        inventory: list[str] | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock or time.time
        self._steps = StepWatch() if clock is None else None
        """Steps of the real wall clock (an injected clock is the caller's to move)."""
        self.fleet = fleet_from(settings, inventory or [], self.clock())
        self.pending: deque[AlertChange] = deque(maxlen=MAX_PENDING_ALERTS)
        self._flushing = asyncio.Lock()
        self.publisher: Publisher | None = None
        """Set while connected: how alerts and the watcher's status go out."""
        self.supervisor = Supervisor()
        self.metrics: MetricsServer | None = None
        self.credentials = load_credentials(settings, "watch")  # ConfigError: exit code 2
        self.backoff = Backoff.of(settings)
        self.failures = FailureTracker()
        self.connect_failures = self.failures.counts
        self._refusing = False
        """The broker refused the last publish (an ACL without write on <prefix>/_watch/#)."""
        self.alertmanager = (
            AlertmanagerSender(settings, self.clock) if settings.alertmanager_urls else None
        )
        """Posts every alert change to each Alertmanager member ([watch] alertmanager_urls)."""

    def now(self) -> float:
        """The wall-clock time for the fleet. After a step of the clock (NTP correcting a
        large offset, `date -s`, a resumed virtual machine) the fleet's times move with it
        first: a step is no silence of the nodes, and hides none."""
        delta = 0.0 if self._steps is None else self._steps.step()
        if delta:
            self.fleet.shift(delta)
            log.warning("the wall clock stepped; the watcher's times moved with it", seconds=delta)
        return self.clock()

    @property
    def status_topic(self) -> str:
        return self.settings.status_topic

    def _status(self, state: str) -> bytes:
        return json.dumps({"state": state, "ts": self.clock(), "version": __version__}).encode()

    def _client(self) -> aiomqtt.Client:
        return new_client(
            self.settings,
            self.credentials,
            default_identifier=f"gpuwarden-watch-{socket.gethostname()}",
            will=aiomqtt.Will(self.status_topic, self._status("offline"), qos=1, retain=True),
            queue_type=direct_queue(self.handle),
        )

    # -- tasks ------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event, notifier: Notifier | None = None) -> None:
        if self.settings.listen:
            host, port = parse_listen(self.settings.listen, "watch.listen")
            self.metrics = MetricsServer(
                self.fleet,
                host,
                port,
                self.now,
                node_limit=self.settings.metrics_node_limit,
                extra=self.alertmanager.families if self.alertmanager else None,
            )
            await self.metrics.start()
            log.info("serving metrics", listen=f"{host}:{self.metrics.port}")
        notifier = notifier or Notifier()
        if self.alertmanager is not None:
            self.alertmanager.start()
        tasks = [
            asyncio.create_task(self.mqtt_forever()),
            asyncio.create_task(self.evaluate_forever()),
        ]
        interval = watchdog_interval()
        if interval:
            tasks.append(
                asyncio.create_task(run_watchdog(notifier, self.supervisor, interval, self.summary))
            )
        notifier.ready(self.summary())
        try:
            await stop.wait()
        finally:
            notifier.stopping()
            if self.publisher is not None:
                with contextlib.suppress(aiomqtt.MqttError):
                    await self._publish(
                        self.publisher, self.status_topic, self._status("stopped"), True, 2.0
                    )
            for task in tasks:
                task.cancel()
            # A graceful MQTT disconnect waits for the broker; do not let it hold the exit.
            _, late = await asyncio.wait(tasks, timeout=STOP_SECONDS)
            if late:
                log.warning("tasks did not stop in time; exiting anyway", tasks=len(late))
            if self.metrics is not None:
                await self.metrics.stop()
            if self.alertmanager is not None:
                await self.alertmanager.stop()

    def summary(self) -> str:
        views = self.fleet.views(self.now())
        broker = "connected" if self.fleet.connected else "no broker"
        return f"{broker}; {len(views)} nodes; {len(self.fleet.active)} alerts active"

    async def mqtt_forever(self) -> None:
        await reconnect_forever(self.session, self.backoff, self._session_failed)

    def _session_failed(self, error: Exception) -> None:
        self.fleet.broker_disconnected(self.now())
        if not isinstance(error, aiomqtt.MqttError):  # a bug: the traceback once, not per retry
            if self.failures.failed("error"):
                log.error("MQTT session failed; reconnecting", error=repr(error), exc_info=error)
            return
        kind, action = classify(error, "watch")
        if not self.failures.failed(kind):
            log.debug("broker still failing", reason=kind, error=str(error))
            return
        log.warning(
            f"{FAILURE_TEXT[kind]}; retrying",
            url=self.settings.url,
            reason=kind,
            action=action,
            error=str(error),
        )

    async def session(self) -> None:
        """One connection. Raises MqttError when it could not connect or was lost."""
        s = self.settings
        client = self._client()
        publisher = Publisher(client)
        try:
            async with connection(client) as lost:
                self.fleet.broker_connected(self.now())
                await self._publish(publisher, self.status_topic, self._status("online"), True)
                await client.subscribe(
                    [
                        (f"{s.topic_prefix}/+/status", 1),
                        (f"{s.topic_prefix}/+/heartbeat", s.heartbeat_qos),
                    ],
                    timeout=s.connect_timeout,
                )
                self.backoff.reset()
                again = " again" if self.failures.recovered() else ""
                log.info(f"connected to the broker{again}", url=s.url)
                self.publisher = publisher
                await self.flush()
                await lost  # messages are handled in direct_queue; this raises on the loss
        finally:
            self.publisher = None
            self.fleet.broker_disconnected(self.now())

    async def _publish(
        self,
        publisher: Publisher,
        topic: str,
        payload: bytes,
        retain: bool,
        timeout: float | None = None,
    ) -> bool:
        """QoS 1 with its PUBACK; False when the broker refused it (logged once, not per
        retry: the watcher goes on watching). MqttError when the connection fails."""
        try:
            await publisher.publish_acked(
                topic, payload, 1, retain, timeout or self.settings.connect_timeout
            )
        except PublishRefused as exc:
            if not self._refusing:
                kind, action = classify(exc, "watch")
                log.error(FAILURE_TEXT[kind], reason=kind, action=action, error=str(exc))
            self._refusing = True
            return False
        self._refusing = False
        return True

    def handle(self, message: aiomqtt.Message) -> None:
        try:
            self.fleet.ingest(
                message.topic.value, as_bytes(message.payload), bool(message.retain), self.now()
            )
        except Exception:  # a bug here must not silence the watcher: log it, keep going
            log.exception("message handling failed", topic=message.topic.value[:200])

    async def evaluate_forever(self) -> None:
        self.supervisor.register("evaluate", max(30.0, 10 * self.settings.evaluate_interval))
        while True:
            try:
                self.evaluate_once()
                self.supervisor.beat("evaluate")
                if self.publisher is not None and self.pending:
                    await self.flush()
            except Exception:  # a bug here must not end evaluation: no beat, the watchdog sees it
                log.exception("evaluation failed")
            await asyncio.sleep(self.settings.evaluate_interval)

    def evaluate_once(self) -> list[AlertChange]:
        changes = self.fleet.evaluate(self.now())
        for change in changes:
            alert = change.alert
            fields = {
                "kind": alert.kind,
                "node": alert.node or None,
                "severity": alert.severity.label,
            }
            if not change.raised:
                log.info("alert cleared", **fields)
            elif alert.severity >= Severity.CRITICAL:
                log.error(alert.message, action=alert.action, **fields)
            else:
                log.warning(alert.message, action=alert.action, **fields)
            self.pending.append(change)
            if self.alertmanager is not None:
                self.alertmanager.change(change)
        return changes

    async def flush(self) -> None:
        # session() flushes on connect and evaluate_forever() after each evaluation. A flush
        # publishes the head and pops it after the PUBACK: two at once would publish it twice
        # and pop one too many, so one at a time.
        async with self._flushing:
            while (publisher := self.publisher) is not None and self.pending:
                change = self.pending[0]
                payload = json.dumps(change.to_dict()).encode()
                try:
                    delivered = await self._publish(
                        publisher, self.settings.effective_alerts_topic, payload, False
                    )
                except PacketTooLarge as exc:
                    # Never sendable to this broker, and it would hold up every alert behind
                    # it: left out of MQTT (Alertmanager has it), said in the log.
                    log.error(
                        "alert larger than the broker's maximum packet size; not published",
                        kind=change.alert.kind,
                        node=change.alert.node,
                        error=str(exc),
                    )
                    delivered = True
                except aiomqtt.MqttError:
                    return  # the session notices the loss and reconnects; the queue keeps it
                if not delivered:
                    return  # refused: kept for the next flush, after the ACL is fixed
                # A full queue drops its head on append, maybe this one while it was in flight.
                if self.pending and self.pending[0] is change:
                    self.pending.popleft()
