"""The real agent against mosquitto through reloads: the broker hears no offline and no Will, the
birth number stays, heartbeats keep coming one after another (seq never goes back, none
skipped) and stay healthy; what waits for a restart (the broker's URL, node_id) is a notice;
a refused file is a notice too; a collector restarted keeps reporting."""

from __future__ import annotations

import signal
from typing import Any

import pytest

from tests.support.agent_proc import AgentProcess
from tests.support.mosquitto import Broker
from tests.support.mqtt import Subscriber
from tests.test_mqtt_process import mqtt_config

SYSTEM = "[collectors.system]\ninterval = {interval}\n"
PROCESSES_OFF = "[collectors.processes]\nenabled = false\n"


def beats(sub: Subscriber) -> list[dict[str, Any]]:
    return [m.json() for m in sub.on("test-node/heartbeat")]


@pytest.mark.slow
class TestMqttAcrossReloads:
    def test_no_offline_no_gap(self, broker: Broker, agent_process: AgentProcess) -> None:
        sub = Subscriber(broker.port).start()
        try:
            base = mqtt_config(broker)
            agent_process.config_text = base + SYSTEM.format(interval=0.5)
            agent_process.start()
            sub.wait_for(lambda s: len(beats(s)) >= 3, what="heartbeats")
            (born,) = [m.json() for m in sub.on("test-node/status")]
            assert born["state"] == "online"
            moved = base.replace(broker.url, "mqtt://192.0.2.1:1883")
            edits = [
                ("test-node", base + SYSTEM.format(interval=0.7)),  # a collector restarted
                ("test-node", base + SYSTEM.format(interval=0.7) + PROCESSES_OFF),
                ("test-node", moved + SYSTEM.format(interval=0.7)),  # pending restart
                ("elsewhere", base + SYSTEM.format(interval=0.7)),  # pending restart
                ("test-node", "[collectors.system]\ninterval = 'soon'\n"),  # refused
                ("test-node", base + SYSTEM.format(interval=0.5)),  # back to the start
            ]
            for n, (node_id, text) in enumerate(edits):
                agent_process.node_id, agent_process.config_text = node_id, text
                agent_process.write_config()
                agent_process.signal(signal.SIGHUP)
                goal = len(beats(sub)) + 4
                sub.wait_for(lambda s: len(beats(s)) >= goal, what=f"beats after edit {n}")  # noqa: B023
            agent_process.node_id = "test-node"
            statuses = [m.json() for m in sub.on("test-node/status")]
            assert [s["state"] for s in statuses] == ["online"], statuses
            assert {s["bdseq"] for s in statuses} == {born["bdseq"]}
            assert not sub.on("elsewhere/status") and not sub.on("elsewhere/heartbeat")
            seqs = [b["seq"] for b in beats(sub)]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
            unhealthy = [b["health"] for b in beats(sub) if b["health"] != "ok"]
            assert not unhealthy, unhealthy
            notices = {n for b in beats(sub) for n in b["notices"]}
            assert any("[mqtt] url" in n for n in notices), notices
            assert any("node_id" in n for n in notices), notices
            assert any("reload refused" in n for n in notices), notices
            assert beats(sub)[-1]["notices"] == []
            assert "system" in beats(sub)[-1]["collectors"]
            assert beats(sub)[-1]["collectors"]["system"]["ok"] is True
            # The stop is the first offline, with the same birth number.
            assert agent_process.stop() == 0
            sub.wait_for(
                lambda s: [m.json()["state"] for m in s.on("test-node/status")][-1] == "offline",
                what="offline on the stop",
            )
            assert [m.json()["bdseq"] for m in sub.on("test-node/status")] == [born["bdseq"]] * 2
        finally:
            sub.stop()
            agent_process.stop()
