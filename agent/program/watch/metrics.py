"""The watcher's own /metrics: per-node heartbeat age and state, alerts, malformed input.

Rendered fresh from the state machine at each scrape (a custom prometheus_client collector),
so a node removed from the fleet leaves no stale series behind. Served by a tiny asyncio HTTP
server like the agent's (exporters/prometheus.py), answering /metrics and /healthz.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from agent import __version__
from agent.program.watch.fleet import Fleet, State
from exporters.http import CONTENT_TYPE, Answer, ScrapeServer, request_line

MALFORMED_REASONS = ("bad_topic", "bad_node_id", "too_large", "not_json", "not_object", "bad_field")


class FleetCollector:
    def __init__(self, fleet: Fleet, clock: Callable[[], float] = time.time) -> None:
        self.fleet = fleet
        self.clock = clock

    def describe(self) -> Sequence[Metric]:
        return ()

    def collect(self) -> Iterable[Metric]:
        fleet, now = self.fleet, self.clock()
        info = GaugeMetricFamily(
            "gpuwarden_watch_build_info", "Watcher version, always 1", labels=["version"]
        )
        info.add_metric([__version__], 1.0)
        connected = GaugeMetricFamily(
            "gpuwarden_watch_broker_connected", "1 while the watcher is connected to the broker"
        )
        connected.add_metric([], 1.0 if fleet.connected else 0.0)
        age = GaugeMetricFamily(
            "gpuwarden_watch_node_heartbeat_age_seconds",
            "Seconds since the node's last heartbeat",
            labels=["node"],
        )
        interval = GaugeMetricFamily(
            "gpuwarden_watch_node_heartbeat_interval_seconds",
            "The node's announced heartbeat interval",
            labels=["node"],
        )
        state = GaugeMetricFamily(
            "gpuwarden_watch_node_state",
            "1 for the node's current state, 0 for the others",
            labels=["node", "state"],
        )
        bdseq = GaugeMetricFamily(
            "gpuwarden_watch_node_birth_sequence",
            "The node's current birth number (bdseq)",
            labels=["node"],
        )
        counts = dict.fromkeys(State, 0)
        for view in fleet.views(now):
            counts[view.state] += 1
            if view.heartbeat_age is not None:
                age.add_metric([view.node], view.heartbeat_age)
            interval.add_metric([view.node], view.interval)
            if view.bdseq is not None:
                bdseq.add_metric([view.node], float(view.bdseq))
            for each in State:
                state.add_metric([view.node, each.value], 1.0 if each is view.state else 0.0)
        nodes = GaugeMetricFamily("gpuwarden_watch_nodes", "Nodes by state", labels=["state"])
        for each, count in counts.items():
            nodes.add_metric([each.value], float(count))
        alerts = GaugeMetricFamily(
            "gpuwarden_watch_alert_active",
            "1 for each alert the watcher holds raised",
            labels=["kind", "node", "severity"],
        )
        for alert in fleet.active.values():
            alerts.add_metric([alert.kind, alert.node, alert.severity.label], 1.0)
        messages = CounterMetricFamily(
            "gpuwarden_watch_messages", "Messages received", labels=["topic"]
        )
        for topic, count in fleet.counters.messages.items():
            messages.add_metric([topic], float(count))
        malformed = CounterMetricFamily(
            "gpuwarden_watch_malformed_messages",
            "Messages skipped as malformed, oversized or hostile",
            labels=["reason"],
        )
        for reason in MALFORMED_REASONS:
            malformed.add_metric([reason], float(fleet.counters.malformed.get(reason, 0)))
        old = CounterMetricFamily(
            "gpuwarden_watch_stale_wills", "Offline messages ignored for an old birth number"
        )
        old.add_metric([], float(fleet.counters.ignored_old_births))
        return [
            info,
            connected,
            age,
            interval,
            state,
            bdseq,
            nodes,
            alerts,
            messages,
            malformed,
            old,
        ]


class MetricsServer:
    """GET /metrics and /healthz (200 while connected to the broker) (exporters/http.py)."""

    def __init__(
        self, fleet: Fleet, host: str, port: int, clock: Callable[[], float] = time.time
    ) -> None:
        self.fleet = fleet
        self.host, self.port = host, port
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(FleetCollector(fleet, clock))
        self._server: asyncio.Server | None = None
        self.http = ScrapeServer(self._answer)

    async def start(self) -> None:
        self._server = await self.http.listen(self.host, self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def respond(self, head: bytes) -> Answer:
        line = request_line(head)
        if len(line) == 3:
            return line
        _, path = line
        if path == "/metrics":
            return 200, {"Content-Type": CONTENT_TYPE}, generate_latest(self.registry)
        if path == "/healthz":
            if self.fleet.connected:
                return 200, {}, b"ok\n"
            return 503, {}, b"no broker connection\n"
        return 404, {}, b"not found\n"

    async def _answer(self, head: bytes, client: str) -> Answer:
        return self.respond(head)
