"""A kill -9 while the state store is not durable loses nothing the spill could have kept.

The real agent, a real broker (down in the killed life: nothing is delivered there), a real
tmpfs for the state dir that fills up while the agent runs (the store's writes refused: the
events wait in the store guard), or that is full or read-only from the start (the store in
memory; read-only: it read back the database there). Xids are read meanwhile; the agent keeps a spill in the runtime dir up to
date (agent/runtime/spill.py `LiveSpill`) and is then killed with SIGKILL, which writes no
spill of its own:

- `spilled`: once the spill holds the Xids;
- `more_read`: once more Xids are read after that (those may be lost: they arrived within
  the spill's delay), the first ones must not be;
- `stored_again`: once the fault is gone and the store holds everything again (the spill,
  if still there, must not be adopted over the newer state).

What must hold at the next start, the fault cleared: every Xid the spill held reaches the
broker once, under one id, with one payload per id, and none says it was logged before the
agent started (the agent was running); no carried counter (`gpuwarden_events_total`, the Xid
counters) is lower than when the spill held them. Without the live spill all of it died with
the process, and the kernel log read again from the old cursor raised the Xids a second
time as "(logged before the agent started)".
"""

from __future__ import annotations

import contextlib
import json
import signal
import sqlite3
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

from agent.runtime import spill
from tests.support.agent_proc import AgentProcess
from tests.support.disk import MIB, SmallDisk
from tests.support.mosquitto import Broker
from tests.support.mqtt import Subscriber
from tests.support.waiting import wait_until
from tests.test_kernel_log_sigkill import agent_config
from tests.test_state_disk_full_at_start import address, gauge, xid_lines
from tests.test_state_spill_agent import counters, lowered, stop_cleanly

FIRST, MORE = 4, 3


def spilled_xids(runtime_dir: Path) -> set[str]:
    """The GPU addresses of the Xid events queued in the spills in `runtime_dir` now."""
    found: set[str] = set()
    for path in runtime_dir.glob(
        f"{spill.PREFIX}*{spill.SUFFIX}"
    ):  # not found(): it removes a spill being written
        uri = f"{path.resolve().as_uri()}?mode=ro"
        with (
            contextlib.suppress(sqlite3.Error),
            contextlib.closing(sqlite3.connect(uri, uri=True, timeout=1)) as db,
        ):
            for (payload,) in db.execute("SELECT payload FROM outbox WHERE kind='event'"):
                event = json.loads(bytes(payload))
                if event["kind"] == "xid":
                    found.add(event["attributes"]["pci_bus_id"])
    return found


def remount(disk: SmallDisk, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(disk.path)], check=True)


def end_fault(disk: SmallDisk, fault: str) -> None:
    if fault == "read_only":
        remount(disk, "rw")
    else:
        disk.free()


def killed(agent: AgentProcess) -> None:
    agent.signal(signal.SIGKILL)
    assert agent.process is not None
    assert agent.process.wait(20) == -signal.SIGKILL
    agent.process = None


@pytest.mark.slow
@pytest.mark.parametrize("point", ["spilled", "more_read", "stored_again"])
@pytest.mark.parametrize("fault", ["full", "read_only", "in_memory"])
def test_a_kill_on_an_unusable_state_disk_loses_nothing_spilled(
    tmp_path: Path, agent_process: AgentProcess, fault: str, point: str
) -> None:
    broker = Broker(tmp_path / "broker")  # down in the killed life
    log = tmp_path / "kern.log"
    log.write_text("")
    runtime_dir = tmp_path / "run"
    runtime_dir.mkdir(mode=0o700)
    agent_process.env = {"RUNTIME_DIRECTORY": str(runtime_dir)}
    agent_process.core_text = "state_retry_interval = 1.0\n"
    agent_process.config_text = agent_config(broker, log, heartbeat=0.5, read_interval=0.2)
    state_dir = agent_process.workdir / "state"
    sub: Subscriber | None = None
    with SmallDisk(state_dir, size=2 * MIB) as disk:
        try:
            if fault == "in_memory":
                disk.fill()  # a fresh state dir with no room: the store starts in memory
            elif fault == "read_only":  # a database there, its file system read-only since
                agent_process.start(timeout=60)
                stop_cleanly(agent_process)
                remount(disk, "ro")
            agent_process.start(timeout=60)
            if fault == "full":
                assert gauge(agent_process, "gpuwarden_state_store_durable") == 1
                disk.fill()
            else:
                assert gauge(agent_process, "gpuwarden_state_store_durable") == 0
            # Its first round read the log's backlog: the lines below are logged while it runs
            # (written before that read, they would rightly predate it).
            wait_until(
                lambda: (
                    (
                        gauge(
                            agent_process,
                            "gpuwarden_collector_runs_total",
                            'collector="kernel_log"',
                        )
                        or 0.0
                    )
                    >= 1.0
                ),
                60,
                "the kernel_log collector's first round",
            )
            with log.open("a") as handle:
                handle.write(xid_lines(0, FIRST))
            first = {address(n) for n in range(FIRST)}
            wait_until(lambda: first <= spilled_xids(runtime_dir), 60, "the Xids spilled")
            before = counters(agent_process)
            assert any(k[0] == "gpuwarden_xid_errors_total" and v > 0 for k, v in before.items())
            if point == "more_read":
                with log.open("a") as handle:
                    handle.write(xid_lines(FIRST, MORE))
                wait_until(
                    lambda: agent_process.log().count('"kind": "xid"') >= FIRST + MORE,
                    60,
                    "the later Xids read",
                )
            elif point == "stored_again":
                end_fault(disk, fault)
                wait_until(
                    lambda: (
                        gauge(agent_process, "gpuwarden_state_store_durable") == 1
                        and gauge(agent_process, "gpuwarden_state_store_queued_events") == 0
                    ),
                    60,
                    "the store durable again, holding all",
                )
                before = counters(agent_process)
            killed(agent_process)
            if point != "stored_again":
                end_fault(disk, fault)

            broker.start()
            sub = Subscriber(broker.port).start()
            agent_process.start(timeout=60)
            sub.wait_for(
                lambda s: (
                    first <= {m.json()["attributes"].get("pci_bus_id") for m in s.on("/events")}
                ),
                what="every spilled Xid",
            )
            wait_until(
                lambda: (
                    gauge(agent_process, "gpuwarden_mqtt_outbox_entries", 'kind="event"')
                    in (0.0, None)
                ),
                60,
                "the outbox delivered",
            )
            payloads: dict[str, list[str]] = defaultdict(list)
            ids: dict[str, set[str]] = defaultdict(set)
            for message in sub.on("/events"):
                event = message.json()
                payloads[str(event["id"])].append(json.dumps(event, sort_keys=True))
                if event["kind"] == "xid":
                    ids[event["attributes"]["pci_bus_id"]].add(str(event["id"]))
                    assert event["attributes"]["predates_agent"] is False, event
                    assert "before the agent started" not in event["message"], event
            again = {i: len(p) for i, p in payloads.items() if len(p) > 1}
            assert not again, f"events delivered more than once: {again}"
            twice = {pci: found for pci, found in ids.items() if len(found) > 1}
            assert not twice, f"an Xid raised twice, under two ids: {twice}"
            after = counters(agent_process)
            assert not lowered(before, after), lowered(before, after)
            assert "Traceback" not in agent_process.log()
        finally:
            if sub is not None:
                sub.stop()
            agent_process.stop()
            broker.stop()
            with contextlib.suppress(subprocess.CalledProcessError):
                remount(disk, "rw")
