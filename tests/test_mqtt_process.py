"""The agent as a real process against mosquitto: Will on SIGKILL, offline on SIGTERM, birth
numbers that rise across restarts, and no event lost to a SIGKILL during a broker outage."""

from __future__ import annotations

import signal
import sqlite3
from pathlib import Path

import pytest

from tests.support.agent_proc import AgentProcess
from tests.support.mosquitto import Broker
from tests.support.mqtt import Subscriber, persistent_broker_lines
from tests.support.waiting import wait_until


def mqtt_config(broker: Broker) -> str:
    return (
        f'[mqtt]\nenabled = true\nurl = "{broker.url}"\nkeepalive = 5\n'
        "reconnect_min = 0.2\nreconnect_max = 1.0\n"
        "[heartbeat]\ninterval = 0.5\nstale_after_intervals = 2\n"
    )


def statuses(sub: Subscriber) -> list[dict[str, object]]:
    return [m.json() for m in sub.on("test-node/status")]


def stored_event_ids(agent: AgentProcess) -> set[str]:
    with sqlite3.connect(agent.workdir / "state" / "state.db") as db:
        return {row[0] for row in db.execute("SELECT id FROM events")}


@pytest.mark.slow
class TestWillAndBirth:
    """What the broker tells the world when the agent dies or stops."""

    def test_will_on_sigkill_offline_on_sigterm(
        self, broker: Broker, agent_process: AgentProcess
    ) -> None:
        """SIGKILL: the broker publishes the Will (offline, same bdseq). Restart: a higher
        bdseq. SIGTERM: the agent publishes offline itself and exits 0."""
        sub = Subscriber(broker.port).start()
        try:
            agent_process.config_text = mqtt_config(broker)
            agent_process.start()
            sub.wait_for(lambda s: any(m["state"] == "online" for m in statuses(s)), what="online")
            first = statuses(sub)[-1]
            agent_process.signal(signal.SIGKILL)
            sub.wait_for(lambda s: statuses(s)[-1]["state"] == "offline", what="the Will")
            will = statuses(sub)[-1]
            assert will["bdseq"] == first["bdseq"]
            assert "reason" not in will  # the broker's Will: the watcher reads it as dead
            assert agent_process.stop() == -signal.SIGKILL

            agent_process.start()
            sub.wait_for(lambda s: statuses(s)[-1]["state"] == "online", what="second birth")
            second = statuses(sub)[-1]
            assert int(str(second["bdseq"])) > int(str(first["bdseq"]))
            agent_process.signal(signal.SIGTERM)
            assert agent_process.process is not None
            assert agent_process.process.wait(10) == 0
            sub.wait_for(lambda s: statuses(s)[-1]["state"] == "offline", what="offline")
            assert statuses(sub)[-1]["bdseq"] == second["bdseq"]
            assert statuses(sub)[-1]["reason"] == "shutdown"  # a planned stop, not a death
            assert '"published offline"' in agent_process.log()
        finally:
            sub.stop()


@pytest.mark.slow
class TestKilledDuringOutage:
    """The outbox is the agent's memory: a SIGKILL while the broker is away loses nothing."""

    def test_every_stored_event_arrives(self, tmp_path: Path, agent_process: AgentProcess) -> None:
        """Broker stopped; the agent raises events (connection lost, sink stale), is killed,
        restarts (broker unreachable), then the broker returns: exactly the stored ids arrive."""
        workdir = tmp_path / "broker-p"
        broker = Broker(workdir, extra_config=persistent_broker_lines(workdir)).start()
        sub = Subscriber(broker.port, client_id="outage-sub", persistent=True).start()
        try:
            agent_process.config_text = mqtt_config(broker)
            agent_process.start()
            sub.wait_for(lambda s: bool(s.on("/heartbeat")), what="first heartbeat")
            sub.stop()
            broker.stop()
            # the agent notices (connection lost) and, two heartbeat intervals later, the
            # stale sink: real events, produced while nothing can deliver them
            wait_until(lambda: "sink_stale" in agent_process.log(), what="a stale-sink event")
            before_kill = stored_event_ids(agent_process)
            assert len(before_kill) >= 2
            agent_process.signal(signal.SIGKILL)
            agent_process.stop()
            agent_process.start()
            wait_until(
                lambda: len(stored_event_ids(agent_process)) > len(before_kill),
                what="events from the restarted agent",
            )
            broker.start()
            sub.start()
            produced = stored_event_ids(agent_process)
            sub.wait_for(
                lambda s: produced <= set(s.event_ids()), timeout=30, what="every stored event"
            )
            received = set(sub.event_ids())
            assert received <= stored_event_ids(agent_process)  # nothing invented
            kinds = {m.json()["kind"] for m in sub.on("/events")}
            assert "broker_unreachable" in kinds or "broker_connection_lost" in kinds
            assert "sink_stale" in kinds
        finally:
            sub.stop()
            broker.stop()
