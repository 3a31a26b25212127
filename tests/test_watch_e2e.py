"""End to end: a real mosquitto, a real Prometheus with the rules, the agent and the watcher.

The agent is SIGSTOPped (stale), loses its broker (sink not delivering; one broker alert at the
watcher; the outbox drains afterwards) and is SIGKILLed (dead at the watcher; agent-down
pending, then firing, in Prometheus). Intervals are short (heartbeat 1 s, keepalive 5 s, rule
`for:` 2 s), about a minute in all.
"""

from __future__ import annotations

import asyncio
import re
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from agent.program import registry
from tests.support.agent_proc import AgentProcess
from tests.support.mosquitto import Broker
from tests.support.ports import free_port
from tests.support.prometheus_server import PrometheusServer
from tests.support.rules import RULES, dashboard_exprs
from tests.support.waiting import until
from tests.support.watch import http_get, metric_value
from tests.test_watch_service import RecordingWatcher, watch_settings

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif("mqtt" not in registry.SINKS, reason="the MQTT sink is not on this branch"),
]

NODE = "test-node"
KEEPALIVE = 5


def fast_rules() -> str:
    """The shipped rules with `for:` of 2 s and the sink threshold at 4 s instead of 5 min."""
    text = re.sub(r"for: \d+m", "for: 2s", RULES.read_text())
    return text.replace(
        'gpuwarden_sink_last_delivery_timestamp_seconds{sink!="prometheus"} > 300',
        'gpuwarden_sink_last_delivery_timestamp_seconds{sink!="prometheus"} > 4',
    )


@pytest.fixture
def prometheus_factory(tmp_path: Path) -> Iterator[list[PrometheusServer]]:
    servers: list[PrometheusServer] = []
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture
async def watcher(broker: Broker) -> AsyncIterator[RecordingWatcher]:
    instance = RecordingWatcher(
        watch_settings(broker, default_interval=1.0, keepalive=KEEPALIVE, evaluate_interval=0.2)
    )
    stop = asyncio.Event()
    task = asyncio.create_task(instance.run(stop))
    await until(lambda: instance.fleet.connected, what="the watcher to connect")
    yield instance
    stop.set()
    await asyncio.wait_for(task, 10)


async def agent_metric(agent: AgentProcess, name: str, **labels: str) -> float | None:
    status, body = await asyncio.to_thread(http_get, agent.metrics_url)
    return metric_value(body, name, **labels) if status == 200 else None


async def prometheus_has(prom: PrometheusServer, expr: str) -> bool:
    return bool(await asyncio.to_thread(prom.query, expr))


async def wait_async(check: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    """Poll an async predicate; fail with `what` after `timeout` seconds (a bound)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await check():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.2)


class TestEndToEnd:
    """Silence is an alert, from both sides: the watcher (push) and Prometheus (pull)."""

    async def test_stale_broker_loss_and_death(
        self,
        tmp_path: Path,
        broker: Broker,
        agent_process: AgentProcess,
        watcher: RecordingWatcher,
        prometheus_factory: list[PrometheusServer],
    ) -> None:
        agent = agent_process
        agent.config_text = (
            f'[mqtt]\nenabled = true\nurl = "{broker.url}"\nkeepalive = {KEEPALIVE}\n'
            "reconnect_min = 0.5\nreconnect_max = 2.0\n[heartbeat]\ninterval = 1.0\n"
        )
        await asyncio.to_thread(agent.start)
        assert watcher.metrics is not None
        workdir = tmp_path / "prometheus"
        workdir.mkdir()
        (workdir / "rules.yml").write_text(fast_rules())
        prom = PrometheusServer(
            workdir,
            (
                "global: {scrape_interval: 1s, evaluation_interval: 1s, scrape_timeout: 1s}\n"
                "rule_files: [rules.yml]\nscrape_configs:\n"
                f"  - job_name: gpuwarden\n    static_configs: [{{targets: ['127.0.0.1:{agent.port}']}}]\n"
                "  - job_name: gpuwarden-watch\n"
                f"    static_configs: [{{targets: ['127.0.0.1:{watcher.metrics.port}']}}]\n"
            ),
            port=free_port(),
        )
        prometheus_factory.append(prom)
        await asyncio.to_thread(prom.start)
        await until(
            lambda: (
                watcher.fleet.nodes.get(NODE) is not None
                and watcher.fleet.nodes[NODE].heartbeat_at is not None
            ),
            what="first heartbeat",
        )
        await wait_async(lambda: prometheus_has(prom, 'up{job="gpuwarden"} == 1'), 30, "scrapes")
        await wait_async(
            lambda: prometheus_has(prom, 'up{job="gpuwarden-watch"} == 1'), 30, "watcher scrapes"
        )
        await asyncio.to_thread(check_dashboard_against, prom)

        # A hung agent: its connection lives on (keepalive 5 s), its heartbeat stops.
        agent.signal(signal.SIGSTOP)
        await until(
            lambda: watcher.saw(True, "node_stale", NODE),
            timeout=3 * 1.0 + 5,
            what="stale within 3 heartbeat intervals (plus evaluation)",
        )
        await wait_async(
            lambda: prometheus_has(prom, 'ALERTS{alertname="GpuwardenNodeStale"}'),
            30,
            "the NodeStale rule",
        )
        agent.signal(signal.SIGCONT)
        await until(lambda: watcher.saw(False, "node_stale", NODE), what="stale cleared")
        assert not watcher.saw(True, "node_dead", NODE)

        # The broker goes away: the agent's MQTT sink stops delivering, the watcher raises
        # one broker alert and nothing per node.
        before = len(watcher.changes)
        await asyncio.to_thread(broker.stop)
        await until(lambda: watcher.saw(True, "broker_unreachable"), what="broker alert")
        await wait_async(
            lambda: prometheus_has(
                prom,
                'ALERTS{alertname="GpuwardenSinkNotDelivering",alertstate="firing",sink="mqtt"}',
            ),
            40,
            "the sink rule to fire",
        )
        assert await agent_metric(agent, "gpuwarden_sink_up", sink="mqtt") == 0
        await asyncio.to_thread(broker.start)
        await until(
            lambda: watcher.saw(False, "broker_unreachable"),
            timeout=60,
            what="broker alert cleared",
        )
        during = watcher.changes[before:]
        assert [c.alert.kind for c in during if c.raised] == ["broker_unreachable"]

        async def drained() -> bool:
            if await agent_metric(agent, "gpuwarden_sink_up", sink="mqtt") != 1:
                return False
            for kind in ("events", "heartbeat", "metrics", "status"):
                if await agent_metric(agent, "gpuwarden_mqtt_outbox_entries", kind=kind):
                    return False
            return True

        await wait_async(drained, 40, "the outbox to drain")
        await wait_async(
            lambda: _not(prometheus_has(prom, 'ALERTS{alertname="GpuwardenSinkNotDelivering"}')),
            40,
            "the sink rule to clear",
        )

        # SIGKILL: the broker sends the Will at once; Prometheus sees the target down. Start
        # from no agent-down alert at all (the SIGSTOP above, or a slow scrape on a loaded
        # machine, may have left one).
        async def agent_down_clear() -> bool:
            return not await asyncio.to_thread(prom.alert_states, "GpuwardenAgentDown")

        await wait_async(agent_down_clear, 40, "no agent-down alert before the kill")
        seen: list[str] = []
        timeline: list[tuple[float, list[str]]] = []
        loop = asyncio.get_running_loop()
        agent.signal(signal.SIGKILL)
        killed = loop.time()

        async def firing() -> bool:
            states = await asyncio.to_thread(prom.alert_states, "GpuwardenAgentDown")
            timeline.append((round(loop.time() - killed, 2), sorted(states)))
            seen.extend(sorted(states))
            return "firing" in states

        # Watch Prometheus from the kill on: the pending phase lasts only `for:` (2 s).
        prometheus_side = asyncio.create_task(wait_async(firing, 40, "agent-down firing"))
        await until(
            lambda: watcher.saw(True, "node_dead", NODE),
            timeout=2.5 * KEEPALIVE,
            what="dead within 2.5 x keepalive",
        )
        print(f"watcher: dead {loop.time() - killed:.2f} s after SIGKILL")
        await prometheus_side
        print(f"prometheus: {timeline}")
        assert "pending" in seen, timeline
        assert seen.index("pending") < seen.index("firing")
        await wait_async(
            lambda: prometheus_has(prom, 'ALERTS{alertname="GpuwardenNodeDead"}'),
            30,
            "the NodeDead rule",
        )


def check_dashboard_against(prom: PrometheusServer) -> None:
    """Every dashboard query evaluates in the real Prometheus, and every metric it names that
    this host (no GPU) can produce has series there."""
    present = set(prom.api("label/__name__/values"))
    host_side = (
        "gpuwarden_watch_",
        "gpuwarden_collector_",
        "gpuwarden_sink_",
        "gpuwarden_mqtt_",
        "gpuwarden_health_",
        "gpuwarden_filesystem_",
    )
    conditional = {"gpuwarden_watch_alert_active"}  # a series only while an alert is raised
    missing = []
    for title, expr in dashboard_exprs():
        prom.query(expr)  # raises unless the API answers "success"
        for name in re.findall(r"\bgpuwarden_[a-z_]+", expr):
            if name.startswith(host_side) and name not in conditional and name not in present:
                missing.append(f"{title}: {name}")
    assert not missing, f"dashboard metrics with no series in Prometheus: {missing}"


async def _not(check: Awaitable[bool]) -> bool:
    return not await check
