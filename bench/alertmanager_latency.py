"""Seconds from SIGKILL of a real agent to the webhook notification, stage by stage: the
watcher raising node_dead (the broker sends the agent's Will at once), Alertmanager holding it
(its `updatedAt`), and the webhook receiving the notification.

A real mosquitto, a real agent process, the watcher in this process with its defaults
(evaluate_interval 1 s), a real Alertmanager running configs/alertmanager/alertmanager.yml with
the receivers pointed at a webhook here and group_wait set by --group-wait (the shipped pager
route waits 10 s: that wait adds to the last stage one for one). After each kill the agent is
started again and the resolution awaited. Each run is another node id: a new Alertmanager
group, as a node that dies usually is (a group that still exists waits group_interval instead).

    python bench/alertmanager_latency.py [--runs 5] [--group-wait 0s]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.program.watch.fleet import SETTLE_SECONDS, AlertChange
from agent.program.watch.service import Watcher
from agent.program.watch.settings import WatchSettings
from tests.support.agent_proc import AgentProcess
from tests.support.alertmanager import AlertmanagerServer, WebhookReceiver, shipped_config
from tests.support.mosquitto import Broker
from tests.support.ports import free_port
from tests.support.waiting import until

STAGES = ("watcher alert", "Alertmanager receive", "webhook")


class TimedWatcher(Watcher):
    """Notes the wall-clock time of each node_dead raise, by node."""

    raised_at: dict[str, float]

    def evaluate_once(self) -> list[AlertChange]:
        changes = super().evaluate_once()
        for change in changes:
            if change.raised and change.alert.kind == "node_dead":
                self.__dict__.setdefault("raised_at", {})[change.alert.node] = time.time()
        return changes


def updated_at(server: AlertmanagerServer, node: str) -> float | None:
    for alert in server.alerts():
        labels = alert["labels"]
        if labels.get("alertname") == "GpuwardenNodeDead" and labels.get("node") == node:
            return datetime.fromisoformat(alert["updatedAt"].replace("Z", "+00:00")).timestamp()
    return None


async def one_run(
    agent: AgentProcess, watcher: TimedWatcher, am: AlertmanagerServer, hook: WebhookReceiver
) -> list[float]:
    node = agent.node_id
    await asyncio.to_thread(agent.start)
    await until(
        lambda: (
            (seen := watcher.fleet.nodes.get(node)) is not None
            and seen.online is True
            and seen.heartbeat_at is not None
        ),
        timeout=60,
        what="the agent online at the watcher",
    )
    before = len(hook.matching("firing", alertname="GpuwardenNodeDead", node=node))
    resolved = len(hook.matching("resolved", alertname="GpuwardenNodeDead", node=node))
    killed = time.time()
    agent.signal(signal.SIGKILL)
    await until(
        lambda: len(hook.matching("firing", alertname="GpuwardenNodeDead", node=node)) > before,
        timeout=60,
        what="the notification",
    )
    webhook_at = hook.matching("firing", alertname="GpuwardenNodeDead", node=node)[-1].received
    received = await asyncio.to_thread(updated_at, am, node)
    assert received is not None
    assert agent.process is not None
    agent.process.wait(5)
    agent.process = None
    # Started again: the watcher clears node_dead, Alertmanager notifies the resolution.
    await asyncio.to_thread(agent.start)
    await until(
        lambda: len(hook.matching("resolved", alertname="GpuwardenNodeDead", node=node)) > resolved,
        timeout=60,
        what="the resolution",
    )
    await asyncio.to_thread(agent.stop)
    stamps = [watcher.raised_at[node], received, webhook_at]
    return [stamp - killed for stamp in stamps]


async def main(runs: int, group_wait: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        broker = Broker(work / "broker").start()
        hook = WebhookReceiver().start()
        am = AlertmanagerServer(
            work / "am", shipped_config(hook.url, group_wait=group_wait, group_interval="1s")
        ).start()
        settings = WatchSettings(
            url=broker.url,
            listen="",
            keepalive=5,
            client_id="bench-watch",
            alertmanager_urls=(am.url,),
        )
        watcher = TimedWatcher(settings)
        stop = asyncio.Event()
        task = asyncio.create_task(watcher.run(stop))
        config = (
            f'[mqtt]\nenabled = true\nurl = "{broker.url}"\nkeepalive = 5\n'
            "reconnect_min = 0.5\nreconnect_max = 2.0\n[heartbeat]\ninterval = 1.0\n"
        )
        results: list[list[float]] = []
        agents: list[AgentProcess] = []
        try:
            # Connected and settled (the watcher judges no node in its first seconds).
            await until(
                lambda: (
                    watcher.fleet.connected_at is not None
                    and time.time() - watcher.fleet.connected_at > SETTLE_SECONDS
                ),
                what="the watcher settled",
            )
            for n in range(runs):
                agent = AgentProcess(work / f"agent{n}", config, free_port(), node_id=f"node-{n}")
                agents.append(agent)
                results.append(await one_run(agent, watcher, am, hook))
        finally:
            for agent in agents:
                agent.stop()
            stop.set()
            await asyncio.wait_for(task, 10)
            am.stop()
            hook.stop()
            broker.stop()
    print(
        f"SIGKILL of a real agent -> webhook, {runs} runs, group_wait {group_wait}, "
        "watcher evaluate_interval 1 s; seconds after the kill"
    )
    print(f"{'stage':<22} {'min':>7} {'median':>7} {'max':>7}")
    print(f"{'kill':<22} {0.0:>7.2f} {0.0:>7.2f} {0.0:>7.2f}")
    for i, stage in enumerate(STAGES):
        column = [run[i] for run in results]
        print(
            f"{stage:<22} {min(column):>7.2f} {statistics.median(column):>7.2f} {max(column):>7.2f}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--group-wait", default="0s", help="the pager route's group_wait")
    args = parser.parse_args()
    asyncio.run(main(args.runs, args.group_wait))
