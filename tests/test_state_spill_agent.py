"""A clean stop on a full state disk loses nothing: the real agent, a real broker, a real tmpfs.

The state disk fills while the agent runs (the store on the disk, its writes failing: the
events wait in the store guard's queue) or was unusable at start (the store in memory). Xids
are read meanwhile, with the broker down, so that nothing of them is delivered yet. A clean
stop (SIGTERM: systemd's stop, a restart, an upgrade) used to throw all of that away: after
the restart the Xids were never delivered and the carried counters (`gpuwarden_events_total`,
the Xid counters) fell. What must hold instead, with the disk freed by then or still full:
every Xid reaches the broker, under one id, once (a second restart delivers nothing again),
and no carried counter is lower than it was before the stop.

The runtime dir is named by `$RUNTIME_DIRECTORY`, as systemd's `RuntimeDirectory=` names it.
"""

from __future__ import annotations

import signal
from collections import Counter
from pathlib import Path

import pytest

from tests.support.agent_proc import AgentProcess, http_get
from tests.support.chaos import carried
from tests.support.disk import MIB, SmallDisk
from tests.support.mosquitto import Broker
from tests.support.mqtt import Subscriber
from tests.support.waiting import wait_until
from tests.test_kernel_log_sigkill import agent_config
from tests.test_state_disk_full_at_start import address, arrived_xids, gauge, xid_lines

XIDS = 5


def counters(agent: AgentProcess) -> dict[tuple[str, ...], float]:
    status, text = http_get(agent.metrics_url)
    assert status == 200
    return carried(text)


def lowered(
    before: dict[tuple[str, ...], float], after: dict[tuple[str, ...], float]
) -> dict[tuple[str, ...], tuple[float, float]]:
    return {k: (v, after.get(k, 0.0)) for k, v in before.items() if after.get(k, 0.0) < v}


def stop_cleanly(agent: AgentProcess) -> None:
    agent.signal(signal.SIGTERM)
    assert agent.process is not None
    code = agent.process.wait(20)
    agent.process = None
    assert code == 0, agent.log()[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("restart_disk", ["freed", "still_full"])
@pytest.mark.parametrize("store", ["on_disk", "in_memory"])
def test_a_clean_stop_on_a_full_disk_loses_nothing(
    tmp_path: Path, agent_process: AgentProcess, store: str, restart_disk: str
) -> None:
    broker = Broker(tmp_path / "broker")  # down while the Xids are read: nothing delivered
    log = tmp_path / "kern.log"
    log.write_text("")
    runtime_dir = tmp_path / "run"
    runtime_dir.mkdir(mode=0o700)
    agent_process.env = {"RUNTIME_DIRECTORY": str(runtime_dir)}
    agent_process.core_text = "state_retry_interval = 1.0\n"
    agent_process.config_text = agent_config(broker, log, heartbeat=0.5, read_interval=0.5)
    state_dir = agent_process.workdir / "state"
    sub: Subscriber | None = None
    with SmallDisk(state_dir, size=2 * MIB) as disk:
        try:
            if store == "in_memory":
                disk.fill()  # a fresh state dir with no room: the store starts in memory
            agent_process.start(timeout=60)
            if store == "on_disk":
                assert gauge(agent_process, "gpuwarden_state_store_durable") == 1
                disk.fill()
            else:
                assert gauge(agent_process, "gpuwarden_state_store_durable") == 0
            log.write_text(xid_lines(0, XIDS))
            wait_until(
                lambda: agent_process.log().count('"kind": "xid"') >= XIDS,
                60,
                "the Xids read",
            )
            if store == "on_disk":
                queued = gauge(agent_process, "gpuwarden_state_store_queued_events")
                assert queued is not None and queued >= XIDS  # waiting in memory
            before = counters(agent_process)
            assert any(k[0] == "gpuwarden_xid_errors_total" and v > 0 for k, v in before.items())
            stop_cleanly(agent_process)

            if restart_disk == "freed":
                disk.free()
            broker.start()
            sub = Subscriber(broker.port).start()
            wanted = {address(n) for n in range(XIDS)}
            for life in range(2):  # the second: nothing is delivered again
                agent_process.start(timeout=60)
                sub.wait_for(lambda s: wanted <= arrived_xids(s).keys(), what="every Xid")
                wait_until(
                    lambda: (
                        gauge(agent_process, "gpuwarden_mqtt_outbox_entries", 'kind="event"')
                        in (0.0, None)
                    ),
                    60,
                    "the outbox delivered",
                )
                twice = {k: ids for k, ids in arrived_xids(sub).items() if len(ids) > 1}
                assert not twice, f"an Xid arrived under two ids: {twice}"
                deliveries = Counter(m.json()["id"] for m in sub.on("/events"))
                again = {i: n for i, n in deliveries.items() if n > 1}
                assert not again, f"life {life}: events delivered more than once: {again}"
                after = counters(agent_process)
                assert not lowered(before, after), f"life {life}: {lowered(before, after)}"
                before = {k: max(v, after.get(k, 0.0)) for k, v in before.items()}
                stop_cleanly(agent_process)
            assert "Traceback" not in agent_process.log()
        finally:
            if sub is not None:
                sub.stop()
            agent_process.stop()
            broker.stop()
