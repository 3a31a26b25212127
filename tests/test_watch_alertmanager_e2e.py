"""End to end through a real Alertmanager to a webhook written here.

1. A real agent on a real mosquitto, SIGKILLed: the watcher's node_dead reaches the webhook
   (through the shipped alertmanager.yml: the pager route), and is resolved after the agent
   restarts. A real Prometheus with the shipped rules alerts to the same Alertmanager: its
   alerts reach the webhook, and those about the dead node are inhibited by node_dead.
2. Two watchers posting to both members of a peered Alertmanager cluster: one notification;
   with one member killed, the other still notifies.

Intervals are short (heartbeat 1 s, keepalive 5 s, rule `for:` 2 s, group_wait 200 ms).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.program.watch.settings import WatchSettings
from tests.support.agent_proc import AgentProcess
from tests.support.alertmanager import (
    AlertmanagerServer,
    WebhookReceiver,
    cluster,
    hook_config,
    shipped_config,
)
from tests.support.mosquitto import Broker
from tests.support.ports import free_port
from tests.support.prometheus_server import PrometheusServer
from tests.support.waiting import until
from tests.support.watch import FakeNode
from tests.test_watch_e2e import fast_rules
from tests.test_watch_service import RecordingWatcher, watch_settings

pytestmark = pytest.mark.slow

NODE = "test-node"
KEEPALIVE = 5


@pytest.fixture
def servers() -> Iterator[list[AlertmanagerServer | PrometheusServer]]:
    started: list[AlertmanagerServer | PrometheusServer] = []
    yield started
    for server in reversed(started):
        server.stop()


class Watchers:
    """Watchers running on the test's loop, stopped at the end."""

    def __init__(self) -> None:
        self.running: list[tuple[RecordingWatcher, asyncio.Event, asyncio.Task[None]]] = []

    def start(self, settings: WatchSettings) -> RecordingWatcher:
        watcher = RecordingWatcher(settings)
        stop = asyncio.Event()
        self.running.append((watcher, stop, asyncio.create_task(watcher.run(stop))))
        return watcher

    @property
    def all(self) -> list[RecordingWatcher]:
        return [watcher for watcher, _, _ in self.running]

    async def stop(self) -> None:
        for _, stop, task in self.running:
            stop.set()
            await asyncio.wait_for(task, 10)


@pytest.fixture
async def watchers() -> AsyncIterator[Watchers]:
    pool = Watchers()
    yield pool
    await pool.stop()


def watcher_settings(broker: Broker, client_id: str, *urls: str) -> WatchSettings:
    return watch_settings(
        broker,
        default_interval=1.0,
        keepalive=KEEPALIVE,
        evaluate_interval=0.2,
        client_id=client_id,
        alertmanager_urls=urls,
        reconnect_min=0.2,
        reconnect_max=1.0,
    )


async def notified(
    webhook: WebhookReceiver, status: str, timeout: float, what: str, **labels: str
) -> float:
    """Wait for a notification; return when the webhook got the first one."""
    await until(lambda: bool(webhook.matching(status, **labels)), timeout=timeout, what=what)
    return webhook.matching(status, **labels)[0].received


def watcher_posted(alert: dict[str, Any]) -> bool:
    """Posted by the watcher itself: Prometheus adds job and instance to every alert."""
    return "job" not in alert["labels"]


async def suppressed(server: AlertmanagerServer, **labels: str) -> bool:
    alerts = await asyncio.to_thread(server.alerts)
    return any(
        all(a["labels"].get(k) == v for k, v in labels.items())
        and a["status"]["state"] == "suppressed"
        and a["status"]["inhibitedBy"]
        for a in alerts
    )


async def holds(server: AlertmanagerServer, **labels: str) -> bool:
    alerts = await asyncio.to_thread(server.alerts)
    return any(all(a["labels"].get(k) == v for k, v in labels.items()) for a in alerts)


async def wait_for(check: Callable[[], Any], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.2)


def prometheus_config(agent_port: int, watcher_port: int, am_port: int) -> str:
    ghost = free_port()  # nothing listens there: an agent down from the start
    return (
        "global: {scrape_interval: 1s, evaluation_interval: 1s, scrape_timeout: 1s}\n"
        "rule_files: [rules.yml]\n"
        "alerting:\n  alertmanagers:\n    - api_version: v2\n"
        f"      static_configs: [{{targets: ['127.0.0.1:{am_port}']}}]\n"
        "scrape_configs:\n"
        "  - job_name: gpuwarden\n    static_configs:\n"
        f"      - {{targets: ['127.0.0.1:{agent_port}'], labels: {{node: {NODE}}}}}\n"
        f"      - {{targets: ['127.0.0.1:{ghost}'], labels: {{node: ghost}}}}\n"
        "  - job_name: gpuwarden-watch\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{watcher_port}']}}]\n"
    )


class TestThroughAlertmanager:
    async def test_sigkill_reaches_the_webhook_and_resolves(
        self,
        tmp_path: Path,
        broker: Broker,
        agent_process: AgentProcess,
        *,
        webhook: WebhookReceiver,
        servers: list[AlertmanagerServer | PrometheusServer],
        watchers: Watchers,
    ) -> None:
        alertmanager = AlertmanagerServer(tmp_path / "am", shipped_config(webhook.url))
        servers.append(await asyncio.to_thread(alertmanager.start))
        watcher = watchers.start(watcher_settings(broker, "w1", alertmanager.url))
        await until(lambda: watcher.fleet.connected, what="the watcher to connect")
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
        prometheus = PrometheusServer(
            workdir, prometheus_config(agent.port, watcher.metrics.port, alertmanager.port)
        )
        servers.append(await asyncio.to_thread(prometheus.start))

        # The Prometheus rules alert to the same Alertmanager: a target that never answered.
        await notified(
            webhook,
            "firing",
            60,
            "the rules' agent-down",
            alertname="GpuwardenAgentDown",
            node="ghost",
        )
        [first] = webhook.matching("firing", alertname="GpuwardenAgentDown", node="ghost")
        assert first.path == "/gpuwarden-pager"  # critical: the pager route

        await until(
            lambda: (
                NODE in watcher.fleet.nodes and watcher.fleet.nodes[NODE].heartbeat_at is not None
            ),
            what="the agent's first heartbeat",
        )
        killed = time.time()
        agent.signal(signal.SIGKILL)
        arrived = await notified(
            webhook,
            "firing",
            2.5 * KEEPALIVE + 10,
            "node_dead",
            alertname="GpuwardenNodeDead",
            node=NODE,
        )
        print(f"SIGKILL -> webhook: {arrived - killed:.2f} s")
        [dead] = webhook.matching("firing", alertname="GpuwardenNodeDead", node=NODE)
        assert dead.path == "/gpuwarden-pager"
        assert all(watcher_posted(a) for a in dead.alerts("firing"))
        assert dead.alerts("firing")[0]["annotations"]["action"].startswith("check that")

        # Prometheus' own alerts about the node reach Alertmanager too: the agent down, muted
        # by node_dead (inhibit_rules), and the copy of node_dead it makes from the watcher's
        # /metrics, routed to `discard` (the watcher posted it already).
        await wait_for(
            lambda: suppressed(alertmanager, alertname="GpuwardenAgentDown", node=NODE),
            40,
            "the rules' agent-down, inhibited",
        )
        await wait_for(
            lambda: holds(alertmanager, alertname="GpuwardenNodeDead", job="gpuwarden-watch"),
            40,
            "the rules' node-dead",
        )
        assert not webhook.matching("firing", alertname="GpuwardenAgentDown", node=NODE)

        await asyncio.to_thread(agent.start)
        await notified(
            webhook, "resolved", 60, "node_dead resolved", alertname="GpuwardenNodeDead", node=NODE
        )
        # One page for the death, however many senders: none from Prometheus' copy, before
        # or after the resolution (it lags the watcher's by a scrape and an evaluation).
        await asyncio.sleep(3)
        assert len(webhook.matching("firing", alertname="GpuwardenNodeDead", node=NODE)) == 1
        assert not webhook.matching("firing", job="gpuwarden-watch")


class TestHighAvailability:
    async def test_two_watchers_two_members_one_notification(
        self,
        tmp_path: Path,
        broker: Broker,
        webhook: WebhookReceiver,
        servers: list[AlertmanagerServer | PrometheusServer],
        watchers: Watchers,
    ) -> None:
        members = await asyncio.to_thread(cluster, tmp_path / "am", hook_config(webhook.url))
        servers.extend(members)
        urls = [m.url for m in members]
        pair = [watchers.start(watcher_settings(broker, name, *urls)) for name in ("w1", "w2")]
        await until(lambda: all(w.fleet.connected for w in pair), what="both connected")
        # n3 goes on talking: two deaths are node alerts, not one fleet-wide silence.
        nodes = [FakeNode(broker.port, f"n{i}", interval=0.5).start() for i in (1, 2, 3)]
        try:
            await until(lambda: all(len(w.fleet.nodes) == 3 for w in pair), what="every node seen")
            nodes[0].signal(signal.SIGKILL)
            await until(
                lambda: all(w.saw(True, "node_dead", "n1") for w in pair), what="both raise"
            )
            await notified(webhook, "firing", 30, "n1 dead", node="n1")
            # Both watchers posted to both members; the second member waits peer-timeout (5 s)
            # for the first's notification log before it would notify: wait past that.
            await asyncio.sleep(8)
            assert len(webhook.matching("firing", node="n1")) == 1, webhook.received()
            for member in members:
                assert {a["labels"].get("node") for a in member.alerts()} >= {"n1"}

            # One member down: the other still gets the alerts and notifies.
            await asyncio.to_thread(members[0].stop)
            nodes[1].signal(signal.SIGKILL)
            await notified(webhook, "firing", 40, "n2 dead with one member down", node="n2")
            assert len(webhook.matching("firing", node="n2")) == 1
            # Each watcher's post to the stopped member runs in that member's own thread: the
            # other member's notification can come first, so wait for the failure to count.
            downs = []
            for watcher in pair:
                assert watcher.alertmanager is not None
                downs.append(watcher.alertmanager.members[0])
            await until(
                lambda: all(down.failures["connect"] >= 1 for down in downs),
                what="the refused posts",
            )
        finally:
            for node in nodes:
                node.stop()
