"""`gpuwarden_events_total` survives kill -9 on the same boot: its counts are stored with the
events they count.

The alert rules read the counter (GpuwardenFatalSxid: `increase()` on it, or a new series): an
SXid stored and then killed before any scrape used to come back as a counter at zero, and the
increase was never seen. The count of each (source, kind, severity) is now written in the
transaction of the event that raised it, so no kill point separates them; pruning the event
history never lowers it (a lower value reads as a counter reset); a new boot starts from zero;
a store that cannot write (a full disk) still counts, and stores the counts with the events
once it can.

The kill points are exact: a real runtime in a child process (the pattern of
tests/test_repairs_sigkill.py) is SIGKILLed just before the write that holds the last event,
just after its commit (stored, not yet announced), or after it was announced and the writer
went on. Whatever the store then holds, the next life counts exactly the stored events.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from agent.contracts.model import Event, RepairAction, Severity
from agent.runtime.state import StateStore
from tests.support.agent_proc import REPO, AgentProcess, http_get, pythonpath
from tests.support.collectors import scripted_runtime
from tests.support.disk import SmallDisk
from tests.support.kmsg import kmsg_record
from tests.support.waiting import wait_until
from tests.support.watch import metric_value
from tests.test_kernel_log_counts_restart import SXID, config, stored_count

BOOT = "boot-a"

LIFE = """
import asyncio, json, os, signal, sys
from pathlib import Path
from agent.contracts.model import Event
from agent.runtime.state import StateStore
from tests.support.collectors import scripted_runtime

state_dir, point, boot = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
events = [Event.from_dict(e) for e in json.loads(sys.argv[4])]
last = events[-1].id
store = StateStore.open(state_dir)
write_batch = store.write_batch

def killed_at(batch, values, *, outbox):
    holds_last = any(e.id == last for e in batch)
    if holds_last and point == "before the write":  # emitted, never stored
        os.kill(os.getpid(), signal.SIGKILL)
    write_batch(batch, values, outbox=outbox)
    if holds_last and point == "after the commit":  # stored, not yet announced
        os.kill(os.getpid(), signal.SIGKILL)

store.write_batch = killed_at
runtime, _ = scripted_runtime({}, store=store, boot_id=boot)

async def main():
    await runtime.start()
    for event in events:
        runtime.emit(event)
    if point == "after the announcement":  # between rounds: announced, the writer went on
        await runtime.settle()
        runtime.emit(Event.from_dict({**events[0].to_dict(), "id": "f" * 32, "kind": "later"}))
        await runtime.settle()
        os.kill(os.getpid(), signal.SIGKILL)
    await asyncio.sleep(60)

asyncio.run(main())
"""


def event(source: str, kind: str, severity: Severity, n: int = 0) -> Event:
    return Event(
        source=source,
        kind=kind,
        severity=severity,
        repair_action=RepairAction.NONE,
        subject=f"subject-{n}",
        message=f"{kind} {n}",
    )


SHAPES = {
    "one sxid": [event("kernel_log", "sxid", Severity.CRITICAL)],
    "a burst of one key": [event("kernel_log", "sxid", Severity.CRITICAL, n) for n in range(20)],
    "mixed keys": [
        event("kernel_log", "sxid", Severity.CRITICAL),
        event("kernel_log", "sxid", Severity.WARNING, 1),
        event("gpu", "xid", Severity.CRITICAL, 2),
        event("disk", "filesystem_space_low", Severity.WARNING, 3),
        event("gpu", "xid", Severity.CRITICAL, 4),
    ],
}
POINTS = ("before the write", "after the commit", "after the announcement")


def life_killed_at(state_dir: Path, point: str, events: list[Event]) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            LIFE,
            str(state_dir),
            point,
            BOOT,
            json.dumps([e.to_dict() for e in events]),
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": pythonpath()},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr


def stored_keys(state_dir: Path) -> Counter[tuple[str, str, str]]:
    store = StateStore.open(state_dir)
    try:
        return Counter((e.source, e.kind, e.severity.label) for e in store.recent_events(10_000))
    finally:
        store.close()


def next_life(state_dir: Path, boot: str = BOOT) -> Counter[tuple[str, str, str]]:
    """What a new process of `boot` counts before it has raised anything."""
    store = StateStore.open(state_dir)
    try:
        runtime, _ = scripted_runtime({}, store=store, boot_id=boot)
        return Counter(runtime.events_by_key)
    finally:
        store.close()


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_the_count_after_a_kill_is_the_stored_events(
    tmp_path: Path, shape: str, point: str
) -> None:
    events = SHAPES[shape]
    life_killed_at(tmp_path, point, events)
    stored = stored_keys(tmp_path)
    if point != "before the write":
        mine = Counter((e.source, e.kind, e.severity.label) for e in events)
        assert mine <= stored  # the kill came after they were stored
    assert +next_life(tmp_path) == stored


def _life(
    store: StateStore, events: list[Event], boot: str = BOOT
) -> Counter[tuple[str, str, str]]:
    async def run() -> Counter[tuple[str, str, str]]:
        runtime, _ = scripted_runtime({}, store=store, boot_id=boot)
        await runtime.start()
        for e in events:
            runtime.emit(e)
        await runtime.settle()
        await runtime.stop()
        return Counter(runtime.events_by_key)

    return asyncio.run(run())


def _fresh(events: list[Event]) -> list[Event]:
    """The same events under new ids (raised again)."""
    return [Event.from_dict({**e.to_dict(), "id": os.urandom(16).hex()}) for e in events]


def test_pruning_the_history_never_lowers_the_count(tmp_path: Path) -> None:
    store = StateStore.open(tmp_path)
    counted = _life(store, SHAPES["mixed keys"])
    runtime, _ = scripted_runtime({}, store=store, boot_id=BOOT)
    assert runtime.prune_history(now=time.time() + 365 * 86400) >= len(SHAPES["mixed keys"])
    assert store.recent_events(10_000) == []
    store.close()
    assert +next_life(tmp_path) == +counted  # the events are gone, their count is not
    store = StateStore.open(tmp_path)
    again = _life(store, _fresh(SHAPES["one sxid"]))
    store.close()
    assert (
        again[("kernel_log", "sxid", "critical")] == counted[("kernel_log", "sxid", "critical")] + 1
    )


def test_a_new_boot_counts_from_zero(tmp_path: Path) -> None:
    store = StateStore.open(tmp_path)
    _life(store, SHAPES["mixed keys"])
    store.close()
    assert +next_life(tmp_path, "boot-b") == Counter()
    store = StateStore.open(tmp_path)
    counted = _life(store, _fresh(SHAPES["one sxid"]), "boot-b")
    store.close()
    assert +counted == Counter({("kernel_log", "sxid", "critical"): 1})
    assert +next_life(tmp_path, "boot-b") == +counted


def test_an_unknown_boot_carries_nothing(tmp_path: Path) -> None:
    store = StateStore.open(tmp_path)
    _life(store, SHAPES["one sxid"], boot="")
    store.close()
    assert +next_life(tmp_path, "") == Counter()
    assert +next_life(tmp_path, BOOT) == Counter()


def test_a_store_in_memory_still_counts() -> None:
    counted = _life(StateStore.in_memory(), SHAPES["mixed keys"])
    want = Counter((e.source, e.kind, e.severity.label) for e in SHAPES["mixed keys"])
    assert +counted >= want


def test_a_full_disk_counts_and_stores_the_counts_once_it_can(tmp_path: Path) -> None:
    events = SHAPES["mixed keys"]
    want = Counter((e.source, e.kind, e.severity.label) for e in events)
    with SmallDisk(tmp_path / "disk") as disk:
        store = StateStore.open(disk.path / "state")

        async def run() -> Counter[tuple[str, str, str]]:
            runtime, _ = scripted_runtime({}, store=store, boot_id=BOOT)
            await runtime.start()
            disk.fill(store)
            for e in events:
                runtime.emit(e)
            await runtime.settle()
            counted = Counter(runtime.events_by_key)
            assert runtime.guard.failing is not None  # nothing of it could be written
            disk.free()
            await runtime.stop()  # stores what waited
            return counted

        counted = asyncio.run(run())
        assert +counted >= want  # counted while the disk was full
        store.close()
        assert stored_keys(disk.path / "state") >= want
        after = next_life(disk.path / "state")
        assert +after == stored_keys(disk.path / "state")


# -- the agent as a process: the SXid the alert rule reads ------------------------------------


def _scrape(agent: AgentProcess) -> str:
    status, text = http_get(agent.metrics_url)
    assert status == 200
    return text


@pytest.mark.slow
@pytest.mark.parametrize("wait", [0.0, 1.5], ids=["stored", "rounds later"])
def test_an_sxid_counted_before_a_kill_9_is_counted_after(tmp_path: Path, wait: float) -> None:
    log = tmp_path / "kmsg-records"
    log.write_bytes(kmsg_record(1, "Linux version 6.8.0 (boot)"))
    agent = AgentProcess(tmp_path / "agent", config(log)).start()
    state_dir = agent.workdir / "state"
    try:
        time.sleep(1.0)  # the first round (the backlog) done
        before = stored_count(state_dir)
        with log.open("ab") as handle:
            handle.write(kmsg_record(2, SXID, level=3, usec=int(time.monotonic() * 1e6)))
        wait_until(lambda: stored_count(state_dir) > before, 10.0, "the SXid stored")
        time.sleep(wait)
        agent.signal(signal.SIGKILL)  # no scrape saw it
        assert agent.process is not None
        agent.process.wait(10)
        agent.process = None
        sxids = stored_keys(state_dir)[("kernel_log", "sxid", "critical")]
        assert sxids == 1
        agent.start()
        text = _scrape(agent)
        got = metric_value(
            text, "gpuwarden_events_total", source="kernel_log", kind="sxid", severity="critical"
        )
        assert got == sxids, agent.log()[-3000:]
    finally:
        agent.stop()
