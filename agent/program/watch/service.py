"""The watcher's MQTT side: subscribe to every node, feed the state machine, publish alerts.

Reconnects forever: a loop around `async with client:` catching `aiomqtt.MqttError`, with
exponential backoff and jitter (tenacity) while the broker refuses, and an immediate first
retry after a connection that had worked. Alert changes are logged at once and published on
the alerts topic (QoS 1) when connected; those raised while the broker is away wait in a
bounded queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import aiomqtt
import structlog
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_never,
    wait_exponential,
    wait_random,
)

from agent import __version__
from agent.contracts.config import NODE_ID, read_secret
from agent.contracts.errors import ConfigError
from agent.contracts.model import Severity
from agent.program.watch.fleet import AlertChange, Fleet
from agent.program.watch.metrics import MetricsServer
from agent.program.watch.settings import WatchSettings
from agent.runtime.systemd import Notifier, Supervisor, run_watchdog, watchdog_interval
from exporters.http import parse_listen

log = structlog.get_logger(component="watch")

MAX_PENDING_ALERTS = 10_000
RECONNECT_MAX_SECONDS = 30.0
STOP_SECONDS = 4.0
"""SIGTERM to exit, inside systemd's TimeoutStopSec=10s."""


def load_inventory(path: Path) -> list[str]:
    """One node id a line; `#` starts a comment; blank lines are skipped."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("watch.inventory_file", f"cannot read {path}: {exc}") from None
    nodes: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        node = line.split("#", 1)[0].strip()
        if not node:
            continue
        if not NODE_ID.fullmatch(node):
            raise ConfigError(
                "watch.inventory_file",
                f"{path}:{number}: {node!r} is not a node id ([A-Za-z0-9._:-])",
            )
        nodes.append(node)
    return nodes


def fleet_from(settings: WatchSettings, inventory: list[str], now: float) -> Fleet:
    return Fleet(
        prefix=settings.topic_prefix,
        stale_after_intervals=settings.stale_after_intervals,
        default_interval=settings.default_interval,
        quiet_window=settings.quiet_window,
        quiet_min_nodes=settings.quiet_min_nodes,
        broker_grace=settings.broker_grace,
        max_payload_bytes=settings.max_payload_bytes,
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
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.fleet = fleet_from(settings, inventory or [], clock())
        self.pending: deque[AlertChange] = deque(maxlen=MAX_PENDING_ALERTS)
        self._flushing = asyncio.Lock()
        self.client: aiomqtt.Client | None = None
        self.supervisor = Supervisor()
        self.metrics: MetricsServer | None = None
        self._password = (
            read_secret(settings.password_file, "watch.password_file")
            if settings.password_file
            else None
        )

    @property
    def status_topic(self) -> str:
        return f"{self.settings.topic_prefix}/_watch/status"

    def _status(self, state: str) -> bytes:
        return json.dumps({"state": state, "ts": self.clock(), "version": __version__}).encode()

    def _client(self) -> aiomqtt.Client:
        s = self.settings
        tls = (
            ssl.create_default_context(cafile=str(s.ca_file) if s.ca_file else None)
            if s.tls
            else None
        )
        return aiomqtt.Client(
            s.host,
            s.port,
            username=s.username or None,
            password=self._password,
            identifier=s.client_id or f"gpuwarden-watch-{socket.gethostname()}",
            keepalive=s.keepalive,
            tls_context=tls,
            timeout=10.0,
            queue_type=direct_queue(self.handle),
            will=aiomqtt.Will(self.status_topic, self._status("offline"), qos=1, retain=True),
        )

    # -- tasks ------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event, notifier: Notifier | None = None) -> None:
        if self.settings.listen:
            host, port = parse_listen(self.settings.listen, "watch.listen")
            self.metrics = MetricsServer(self.fleet, host, port, self.clock)
            await self.metrics.start()
            log.info("serving metrics", listen=f"{host}:{self.metrics.port}")
        notifier = notifier or Notifier()
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
            if self.client is not None:
                with contextlib.suppress(aiomqtt.MqttError, TimeoutError):
                    await asyncio.wait_for(
                        self.client.publish(
                            self.status_topic, self._status("stopped"), qos=1, retain=True
                        ),
                        2.0,
                    )
            for task in tasks:
                task.cancel()
            # A graceful MQTT disconnect waits for the broker; do not let it hold the exit.
            _, late = await asyncio.wait(tasks, timeout=STOP_SECONDS)
            if late:
                log.warning("tasks did not stop in time; exiting anyway", tasks=len(late))
            if self.metrics is not None:
                await self.metrics.stop()

    def summary(self) -> str:
        views = self.fleet.views(self.clock())
        broker = "connected" if self.fleet.connected else "no broker"
        return f"{broker}; {len(views)} nodes; {len(self.fleet.active)} alerts active"

    async def mqtt_forever(self) -> None:
        while True:
            # Any exception, not only MqttError: a bug in a session must cost a reconnection
            # (with backoff, so a lasting one does not spin), not the watcher's MQTT side.
            retrying = AsyncRetrying(
                retry=retry_if_exception_type(Exception),
                wait=wait_exponential(multiplier=0.5, max=RECONNECT_MAX_SECONDS)
                + wait_random(0, 0.5),
                stop=stop_never,
                before_sleep=self._connect_failed,
                reraise=True,
            )
            async for attempt in retrying:
                with attempt:
                    await self.session()

    def _connect_failed(self, state: RetryCallState) -> None:
        self.fleet.broker_disconnected(self.clock())
        error = state.outcome.exception() if state.outcome else None
        if error is not None and not isinstance(error, aiomqtt.MqttError):
            log.error(
                "MQTT session failed; reconnecting",
                error=repr(error),
                exc_info=error,
                attempt=state.attempt_number,
            )
            return
        log.warning(
            "cannot reach the broker; retrying",
            url=self.settings.url,
            error=str(error),
            attempt=state.attempt_number,
        )

    async def session(self) -> None:
        """One connection. Raises MqttError if it could not connect; returns when it is lost."""
        s = self.settings
        client = self._client()
        async with client:
            self.client = client
            self.fleet.broker_connected(self.clock())
            log.info("connected to the broker", url=s.url)
            try:
                await client.publish(self.status_topic, self._status("online"), qos=1, retain=True)
                await client.subscribe(
                    [
                        (f"{s.topic_prefix}/+/status", 1),
                        (f"{s.topic_prefix}/+/heartbeat", s.heartbeat_qos),
                    ]
                )
                await self.flush()
                async for _ in client.messages:  # handled in direct_queue; ends on disconnect
                    pass
            except aiomqtt.MqttError as exc:
                log.warning("broker connection lost", error=str(exc))
            finally:
                self.client = None
                self.fleet.broker_disconnected(self.clock())

    def handle(self, message: aiomqtt.Message) -> None:
        try:
            self.fleet.ingest(
                message.topic.value, as_bytes(message.payload), bool(message.retain), self.clock()
            )
        except Exception:  # a bug here must not silence the watcher: log it, keep going
            log.exception("message handling failed", topic=message.topic.value[:200])

    async def evaluate_forever(self) -> None:
        self.supervisor.register("evaluate", max(30.0, 10 * self.settings.evaluate_interval))
        while True:
            try:
                self.evaluate_once()
                self.supervisor.beat("evaluate")
                if self.client is not None and self.pending:
                    await self.flush()
            except Exception:  # a bug here must not end evaluation: no beat, the watchdog sees it
                log.exception("evaluation failed")
            await asyncio.sleep(self.settings.evaluate_interval)

    def evaluate_once(self) -> list[AlertChange]:
        changes = self.fleet.evaluate(self.clock())
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
        return changes

    async def flush(self) -> None:
        # session() flushes on connect and evaluate_forever() after each evaluation. A flush
        # publishes the head and pops it after the PUBACK: two at once would publish it twice
        # and pop one too many, so one at a time.
        async with self._flushing:
            while (client := self.client) is not None and self.pending:
                change = self.pending[0]
                try:
                    await client.publish(
                        self.settings.effective_alerts_topic,
                        json.dumps(change.to_dict()).encode(),
                        qos=1,
                    )
                except aiomqtt.MqttError:
                    return  # the session notices the loss and reconnects; the queue keeps it
                # A full queue drops its head on append, maybe this one while it was in flight.
                if self.pending and self.pending[0] is change:
                    self.pending.popleft()
