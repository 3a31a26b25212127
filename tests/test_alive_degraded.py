"""A full state disk is a sick agent, not a hung one (issue 13, item 4).

The real agent with its state dir on a small real tmpfs that fills up, a real mosquitto and the
real watcher (`gpuwarden watch` as a process): the agent goes on beating and says why it is
unhealthy, so the watcher's alert is `node_unhealthy` naming the state store, never
`node_stale` ("the agent is hung").
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.program import registry
from tests.support.agent_proc import REPO, AgentProcess
from tests.support.disk import SmallDisk
from tests.support.mosquitto import Broker
from tests.support.mqtt import Subscriber
from tests.support.waiting import wait_until
from tests.support.watch import AlertListener

NODE = "test-node"
INTERVAL = 0.5
STALE_AFTER = 3


def agent_config(broker: Broker, state_dir: Path) -> str:
    """MQTT and a fast heartbeat; of the collectors only the disk one, on the state disk
    itself (tmpfs is left out by default): its level change is the write that finds the
    disk full, as any write of a real agent would."""
    lines = [
        f'[mqtt]\nenabled = true\nurl = "{broker.url}"\nkeepalive = 5\nreconnect_min = 0.2\nreconnect_max = 1.0',
        f"[heartbeat]\ninterval = {INTERVAL}\nstale_after_intervals = {STALE_AFTER}",
    ]
    lines += [
        f"[collectors.{name}]\nenabled = false" for name in registry.COLLECTORS if name != "disk"
    ]
    lines.append(
        f"[collectors.disk]\ninterval = {INTERVAL}\nfs_types_exclude = []\n"
        f'mountpoints_include = ["{state_dir}"]'
    )
    return "\n".join(lines) + "\n"


@pytest.fixture
def watcher(broker: Broker, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`gpuwarden watch` as a real process, judging nodes by their announced interval."""
    config = tmp_path / "watch.toml"
    config.write_text(
        f'[watch]\nurl = "{broker.url}"\nlisten = ""\nevaluate_interval = 0.2\n'
        f"stale_after_intervals = {STALE_AFTER}\nkeepalive = 5\n"
    )
    log = (tmp_path / "watch.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "agent", "watch", "--config", str(config)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    yield process
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)
    log.close()


def fill_state_disk(disk: SmallDisk, database: Path) -> None:
    """Every free byte taken, and the agent's WAL emptied first (twice: the agent may write
    between the checkpoint and the fill), so that its next write needs room it cannot get."""
    for _ in range(2):
        with sqlite3.connect(database, timeout=5) as db:
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        disk.fill()


class TestFullStateDisk:
    def test_beats_on_and_is_unhealthy_not_stale(
        self,
        tmp_path: Path,
        broker: Broker,
        agent_process: AgentProcess,
        watcher: subprocess.Popen[bytes],
    ) -> None:
        alerts = AlertListener(broker.port, "gpuwarden/v1/_watch/alerts").start()
        sub = Subscriber(broker.port).start()
        state_dir = agent_process.workdir / "state"
        try:
            with SmallDisk(state_dir) as disk:
                agent_process.config_text = agent_config(broker, state_dir)
                agent_process.start()
                sub.wait_for(lambda s: bool(s.on(f"{NODE}/heartbeat")), what="a first heartbeat")
                fill_state_disk(disk, state_dir / "state.db")

                def unhealthy_about_the_store(_: Subscriber) -> bool:
                    return any(
                        "state store" in message
                        for alert in alerts.received
                        if alert["kind"] == "node_unhealthy" and alert["event"] == "raise"
                        for message in [str(alert.get("message", ""))]
                    )

                sub.wait_for(unhealthy_about_the_store, timeout=30, what="node_unhealthy")
                # Well past the stale bound (3 intervals): still beating, never called hung.
                beats = len(sub.on(f"{NODE}/heartbeat"))
                wait_until(
                    lambda: len(sub.on(f"{NODE}/heartbeat")) >= beats + 2 * STALE_AFTER,
                    timeout=15,
                    what="heartbeats on the full disk",
                )
                assert disk.available() == 0  # the disk is still full
                latest = sub.on(f"{NODE}/heartbeat")[-1].json()
                assert any("state store" in p for p in latest["health"]), latest["health"]
                assert not [a for a in alerts.received if a["kind"] == "node_stale"], (
                    alerts.received
                )
                assert agent_process.stop() == 0
        finally:
            sub.stop()
            alerts.stop()
