"""The watcher's own /metrics: per-node heartbeat age and state, alerts, malformed input.

Rendered fresh from the state machine at each scrape (exporters/exposition.py), so a node
removed from the fleet leaves no stale series behind. Served by a tiny asyncio HTTP
server like the agent's (exporters/prometheus.py), answering /metrics and /healthz.

Bounded and off the event loop: at 100,000 nodes a full rendering was 56 MB and 5 s of the
loop, during which no MQTT message was handled and nothing evaluated. The loop now only copies
the containers (a snapshot: C-level list and dict copies); a worker thread renders it, one
rendering at a time, and concurrent scrapes share it. Per-node series stop at `node_limit`
nodes, those in trouble first; the fleet totals cover every node always.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from agent import __version__
from agent.contracts.model import MetricFamily, MetricType, Sample
from agent.program.watch.fleet import Alert, Fleet, Node, State
from exporters.exposition import Block, blocks_text
from exporters.http import CONTENT_TYPE, Answer, ScrapeServer, endpoint_blocks, request_line
from exporters.listener import Listener

MALFORMED_REASONS = (
    "bad_topic",
    "bad_node_id",
    "too_large",
    "not_utf8",
    "not_json",
    "duplicate_key",
    "not_object",
    "bad_field",
)
IGNORED_REASONS = ("old_birth", "outside_inventory", "node_limit")
FORGOTTEN_REASONS = ("cleared", "heartbeat_only", "offline_silent", "evicted")
DEFAULT_NODE_LIMIT = 10_000


@dataclass(frozen=True)
class Snapshot:
    """What one scrape shows, copied on the event loop so a thread can render it while the
    loop goes on changing the fleet (the Node objects are shared: a field read is atomic,
    and a node half-updated by a message is at worst one message old)."""

    fleet: Fleet
    now: float
    connected: bool
    nodes: list[Node]
    alerts: list[Alert]
    messages: dict[str, int]
    malformed: dict[str, int]
    ignored: dict[str, int]
    forgotten: dict[str, int]
    stale_wills: int
    extra: tuple[Block, ...] = ()
    """Families of other parts of the watcher (the Alertmanager sender), built on the loop."""


def snapshot(fleet: Fleet, now: float, extra: Sequence[Block] = ()) -> Snapshot:
    counters = fleet.counters
    return Snapshot(
        fleet,
        now,
        fleet.connected,
        list(fleet.nodes.values()),
        list(fleet.active.values()),
        dict(counters.messages),
        dict(counters.malformed),
        dict(counters.ignored),
        dict(counters.forgotten),
        counters.ignored_old_births,
        tuple(extra),
    )


def _gauge(name: str, doc: str, *labels: str) -> MetricFamily:
    return MetricFamily(name, MetricType.GAUGE, doc, labels)


def _counter(name: str, doc: str, *labels: str) -> MetricFamily:
    return MetricFamily(name, MetricType.COUNTER, doc, labels)


AGE = _gauge(
    "gpuwarden_watch_node_heartbeat_age_seconds", "Seconds since the node's last heartbeat", "node"
)
INTERVAL = _gauge(
    "gpuwarden_watch_node_heartbeat_interval_seconds",
    "The node's announced heartbeat interval",
    "node",
)
STATE = _gauge(
    "gpuwarden_watch_node_state",
    "1 for the node's current state, 0 for the others",
    "node",
    "state",
)
BDSEQ = _gauge(
    "gpuwarden_watch_node_birth_sequence", "The node's current birth number (bdseq)", "node"
)
NODES = _gauge("gpuwarden_watch_nodes", "Nodes by state", "state")
OMITTED = _gauge(
    "gpuwarden_watch_node_series_omitted",
    "Nodes left out of the per-node series by metrics_node_limit",
)
HEARTBEAT_ONLY = _gauge(
    "gpuwarden_watch_heartbeat_only_nodes",
    "Nodes known only from heartbeats (no status): never alerted on, forgotten when silent",
)
ALERT_ACTIVE = _gauge(
    "gpuwarden_watch_alert_active",
    "1 for each alert the watcher holds raised",
    "kind",
    "node",
    "severity",
)
ALERTS = _gauge("gpuwarden_watch_alerts", "Alerts held raised, by kind", "kind", "severity")
BUILD_INFO = _gauge("gpuwarden_watch_build_info", "Watcher version, always 1", "version")
CONNECTED = _gauge(
    "gpuwarden_watch_broker_connected", "1 while the watcher is connected to the broker"
)
MESSAGES = _counter("gpuwarden_watch_messages_total", "Messages received", "topic")
MALFORMED = _counter(
    "gpuwarden_watch_malformed_messages_total",
    "Messages skipped as malformed, oversized or hostile",
    "reason",
)
IGNORED = _counter(
    "gpuwarden_watch_ignored_messages_total",
    "Well-formed messages not taken: a birth older than the current one, a node outside "
    "the inventory, a full node table",
    "reason",
)
FORGOTTEN = _counter(
    "gpuwarden_watch_forgotten_nodes_total", "Nodes dropped from the table", "reason"
)
STALE_WILLS = _counter(
    "gpuwarden_watch_stale_wills_total", "Offline messages ignored for an old birth number"
)


def _counts(family: MetricFamily, counts: dict[str, int], keys: Iterable[str]) -> Block:
    return family, [family.sample(float(counts.get(key, 0)), key) for key in keys]


def _node_families(snap: Snapshot, limit: int) -> list[Block]:
    """Per-node series for up to `limit` nodes (not online, or unhealthy, first), and the
    totals per state for all of them."""
    fleet, now = snap.fleet, snap.now
    counts = dict.fromkeys(State, 0)
    troubled: list[tuple[Node, State]] = []
    fine: list[tuple[Node, State]] = []
    heartbeat_only = 0
    for node in snap.nodes:
        if node.heartbeat_only:
            heartbeat_only += 1  # nothing says it exists: no series of its own
            continue
        current = fleet.state_of(node, now)
        counts[current] += 1
        ok = current is State.ONLINE and node.health_ok is not False
        if not ok:
            troubled.append((node, current))
        elif len(fine) < limit:
            fine.append((node, current))
    shown = (troubled + fine)[:limit]
    age: list[Sample] = []
    interval: list[Sample] = []
    bdseq: list[Sample] = []
    state: list[Sample] = []
    for node, current in shown:
        name = node.node
        if node.heartbeat_at is not None:
            age.append(AGE.sample(max(0.0, now - node.heartbeat_at), name))
        interval.append(INTERVAL.sample(fleet.interval_of(node), name))
        if node.bdseq is not None:
            bdseq.append(BDSEQ.sample(float(node.bdseq), name))
        for each in State:
            state.append(STATE.sample(1.0 if each is current else 0.0, name, each.value))
    nodes = [NODES.sample(float(count), each.value) for each, count in counts.items()]
    omitted = OMITTED.sample(float(sum(counts.values()) - len(shown)))
    return [
        (AGE, age),
        (INTERVAL, interval),
        (STATE, state),
        (BDSEQ, bdseq),
        (NODES, nodes),
        (OMITTED, [omitted]),
        (HEARTBEAT_ONLY, [HEARTBEAT_ONLY.sample(float(heartbeat_only))]),
    ]


def _alert_families(snap: Snapshot, limit: int) -> list[Block]:
    # Fleet-wide alerts (node "") first: they are never the ones cut off by the limit.
    ordered = sorted(snap.alerts, key=lambda a: a.node != "")
    active = [
        ALERT_ACTIVE.sample(1.0, alert.kind, alert.node, alert.severity.label)
        for alert in ordered[: max(limit, sum(1 for a in ordered if not a.node))]
    ]
    totals: dict[tuple[str, str], int] = {}
    for alert in snap.alerts:
        key = (alert.kind, alert.severity.label)
        totals[key] = totals.get(key, 0) + 1
    counted = [
        ALERTS.sample(float(count), kind, severity)
        for (kind, severity), count in sorted(totals.items())
    ]
    return [(ALERT_ACTIVE, active), (ALERTS, counted)]


def families(snap: Snapshot, limit: int = DEFAULT_NODE_LIMIT) -> list[Block]:
    return [
        (BUILD_INFO, [BUILD_INFO.sample(1.0, __version__)]),
        (CONNECTED, [CONNECTED.sample(1.0 if snap.connected else 0.0)]),
        *_node_families(snap, limit),
        *_alert_families(snap, limit),
        _counts(MESSAGES, snap.messages, snap.messages),
        _counts(MALFORMED, snap.malformed, MALFORMED_REASONS),
        _counts(IGNORED, snap.ignored, IGNORED_REASONS),
        _counts(FORGOTTEN, snap.forgotten, FORGOTTEN_REASONS),
        (STALE_WILLS, [STALE_WILLS.sample(float(snap.stale_wills))]),
        *snap.extra,
    ]


def render(snap: Snapshot, limit: int) -> bytes:
    """The exposition of one snapshot (run in the rendering thread)."""
    return blocks_text(families(snap, limit)).encode("utf-8")


class MetricsServer:
    """GET /metrics and /healthz (200 while connected to the broker) (exporters/http.py)."""

    def __init__(
        self,
        fleet: Fleet,
        host: str,
        port: int,
        clock: Callable[[], float] = time.time,
        node_limit: int = DEFAULT_NODE_LIMIT,
        *,
        extra: Callable[[], Sequence[Block]] | None = None,
    ) -> None:
        self.fleet = fleet
        self.extra = extra
        self.clock = clock
        self.host, self.port = host, port
        self.node_limit = node_limit
        self._server: Listener | None = None
        self.http = ScrapeServer(self._answer)
        # Its own thread, not the loop's default executor (shared with aiomqtt's connect):
        # one rendering at a time, whatever the number of scrapers.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="watch-metrics")
        self._rendering: asyncio.Future[bytes] | None = None

    async def start(self) -> None:
        self._server = await self.http.listen(self.host, self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def respond(self, head: bytes, body: Callable[[], bytes] | None = None) -> Answer:
        line = request_line(head)
        if len(line) == 3:
            return line
        _, path = line
        if path == "/metrics":
            text = body() if body is not None else self.render_now()
            return 200, {"Content-Type": CONTENT_TYPE}, text
        if path == "/healthz":
            if self.fleet.connected:
                return 200, {}, b"ok\n"
            return 503, {}, b"no broker connection\n"
        return 404, {}, b"not found\n"

    def render_now(self) -> bytes:
        """A fresh exposition, rendered by the caller (tests; a scrape renders in the pool)."""
        return render(snapshot(self.fleet, self.clock(), self._extra()), self.node_limit)

    def _extra(self) -> list[Block]:
        """What the watcher adds beside the fleet: the Alertmanager sender's series and this
        endpoint's counts of what it turned away (taken on the loop, rendered in the pool)."""
        extra = list(self.extra()) if self.extra is not None else []
        return [*extra, *endpoint_blocks(self.http)]

    async def metrics_body(self) -> bytes:
        """The exposition, rendered in the worker thread; scrapes that arrive while one is
        being rendered get that one (it is fresh: it started after them or just before)."""
        if self._rendering is None:
            loop = asyncio.get_running_loop()
            snap = snapshot(self.fleet, self.clock(), self._extra())
            future = loop.run_in_executor(self._pool, render, snap, self.node_limit)
            self._rendering = future
            future.add_done_callback(self._rendered)
        return await asyncio.shield(self._rendering)

    def _rendered(self, future: asyncio.Future[bytes]) -> None:
        if self._rendering is future:
            self._rendering = None

    async def _answer(self, head: bytes, client: str) -> Answer:
        line = request_line(head)
        if len(line) == 2 and line[1] == "/metrics":
            body = await self.metrics_body()
            return self.respond(head, lambda: body)
        return self.respond(head)
