"""A repair requirement is stored in the same transaction as the event that raises or clears it.

The ledger takes an event in when it is announced, after the store writer has stored it, and
its own write (the requirement, or its removal) used to wait for the writer's next flush. An
agent killed between the two (SIGKILL, the OOM killer, a watchdog) came back with the event
stored and delivered and its kernel-log cursor past the record, so that nothing would make it
again, but without its requirement: a GPU that had fallen off the bus needed no reboot as far
as `gpuwarden_repair_required`, the heartbeat and Slurm's resume were concerned; and an
all-clear delivered before the kill came back as a requirement nothing would clear.

The test runs a real runtime in a child process and SIGKILLs it at the one moment that tells:
right after the transaction holding the last event committed. Whatever the ledger holds after
a restart must be what those events made it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from agent.contracts.model import Event, RepairAction, Severity
from agent.runtime.repairs import RepairLedger
from agent.runtime.state import StateStore
from tests.support.agent_proc import REPO, pythonpath

LIFE = """
import asyncio, json, os, signal, sys
from pathlib import Path
from agent.contracts.model import Event
from agent.runtime.state import StateStore
from tests.support.collectors import scripted_runtime

store = StateStore.open(Path(sys.argv[1]))
events = [Event.from_dict(e) for e in json.loads(sys.argv[2])]
last = events[-1].id
write_batch = store.write_batch

def killed_after(batch, values, *, outbox):
    write_batch(batch, values, outbox=outbox)
    if any(e.id == last for e in batch):  # committed: what is not in it now is lost
        os.kill(os.getpid(), signal.SIGKILL)

store.write_batch = killed_after
runtime, _ = scripted_runtime({}, store=store)

async def main():
    await runtime.start()
    for event in events:
        runtime.emit(event)
    await asyncio.sleep(60)

asyncio.run(main())
"""


def gpu_fault(gpu: int, action: RepairAction = RepairAction.REBOOT_NODE) -> Event:
    return Event(
        source="kernel_log",
        kind="xid",
        severity=Severity.CRITICAL,
        subject=f"GPU-{gpu}",
        repair_action=action,
        message=f"Xid 79 on GPU-{gpu}",
        attributes={"xid": 79},
    )


def all_clear(gpu: int) -> Event:
    return Event(
        source="kernel_log",
        kind="gpu_recovered",
        severity=Severity.INFO,
        subject=f"GPU-{gpu}",
        repair_action=RepairAction.NONE,
        clears=("xid",),
        message=f"GPU-{gpu} answers again",
    )


def life_killed_after(state_dir: Path, events: list[Event]) -> None:
    import json

    done = subprocess.run(
        [sys.executable, "-c", LIFE, str(state_dir), json.dumps([e.to_dict() for e in events])],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": pythonpath()},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr


def held(state_dir: Path) -> set[tuple[str, str]]:
    store = StateStore.open(state_dir)
    try:
        stored = {e.id for e in store.recent_events(limit=1000)}
        return {(r.subject, r.action.value) for r in RepairLedger(store).active()} | {
            ("stored", i) for i in stored
        }
    finally:
        store.close()


SHAPES = {
    "one raise": ([], [gpu_fault(1)], {("GPU-1", "reboot_node")}),
    "a burst": (
        [],
        [gpu_fault(i, RepairAction.RESET_GPU) for i in range(5)],
        {(f"GPU-{i}", "reset_gpu") for i in range(5)},
    ),
    "an all-clear": ([gpu_fault(1), gpu_fault(2)], [all_clear(1)], {("GPU-2", "reboot_node")}),
    "a raise and its all-clear": ([], [gpu_fault(3), all_clear(3)], set()),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_the_ledger_after_a_kill_is_what_the_stored_events_made_it(
    tmp_path: Path, shape: str
) -> None:
    before, events, expected = SHAPES[shape]
    seed = StateStore.open(tmp_path)
    ledger = RepairLedger(seed)
    for event in before:  # an earlier life's requirements, stored
        seed.record_event(event, outbox=False)
        ledger.apply(event)
    seed.close()

    life_killed_after(tmp_path, events)

    found = held(tmp_path)
    assert {("stored", e.id) for e in events} <= found  # the events are stored...
    requirements = {item for item in found if item[0] != "stored"}
    assert requirements == expected  # ...and so is what they did to the ledger
