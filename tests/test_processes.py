"""The processes collector: state counts, D-state tracking, zombies per parent (real ones too)."""

from __future__ import annotations

import fnmatch
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.contracts.model import Severity
from agent.contracts.settings import build
from collectors._procfs import read_all_stats
from collectors.processes import ProcessesCollector, ProcessesSettings
from tests.support.host import (
    FIXTURES,
    ProcTree,
    by_kind,
    make_deps,
    pooled_caller,
    run_round,
    values,
)

HOST1 = FIXTURES / "host1"


def _collector(proc_root: Path, **changes: object) -> ProcessesCollector:
    settings = build(ProcessesSettings, {"proc_root": str(proc_root), **changes})
    return ProcessesCollector(settings, make_deps())


class TestCounts:
    """Counts per state from a fixture tree; a pid without a stat file is skipped."""

    async def test_fixture_counts(self) -> None:
        with pooled_caller() as caller:
            result = await run_round(_collector(HOST1), caller)
        counts = {labels[0]: v for labels, v in values(result, "gpuwarden_processes").items()}
        assert counts == {
            "running": 1,
            "sleeping": 4,
            "disk_sleep": 2,
            "zombie": 3,
            "stopped": 1,
            "idle": 1,
        }
        assert values(result, "gpuwarden_processes_scanned") == {(): 12}

    def test_processes_exiting_during_real_scans_are_not_errors(self) -> None:
        churn = subprocess.Popen(["sh", "-c", "while :; do /bin/true; done"])
        try:
            scans = [read_all_stats(Path("/proc")) for _ in range(30)]
        finally:
            churn.kill()
            churn.wait()
        assert all(churn.pid in scan for scan in scans)

    def test_vanished_pid_is_not_an_error(self) -> None:
        stats = read_all_stats(HOST1)
        assert 900 not in stats
        assert stats[600].comm == "weird ) (name"


class TestDState:
    """Processes in D are tracked by pid and start time across rounds."""

    async def test_event_after_threshold_with_wchan_and_an_end(self, tmp_path: Path) -> None:
        tree = ProcTree(tmp_path / "proc")
        tree.add_process(1, "systemd", "S", ppid=0)
        tree.add_process(4242, "rsync", "D", starttime=5000, wchan="rpc_wait_bit_killable")
        collector = _collector(tree.root, d_state_threshold=120.0)
        with pooled_caller() as caller:
            first = await run_round(collector, caller, now=1000.0)
            early = await run_round(collector, caller, now=1100.0)
            late = await run_round(collector, caller, now=1125.0)
            later = await run_round(collector, caller, now=1200.0)
            tree.add_process(4242, "rsync", "S", starttime=5000)
            ended = await run_round(collector, caller, now=1215.0)
        assert first.events == []
        assert early.events == []
        (event,) = late.events
        assert (event.kind, event.severity, event.subject) == (
            "process_stuck_d_state",
            Severity.WARNING,
            "pid 4242",
        )
        assert "rpc_wait_bit_killable" in event.message
        assert "SIGKILL" in event.action
        assert later.events == []
        assert values(later, "gpuwarden_process_disk_sleep_seconds") == {
            ("4242", "rsync", "rpc_wait_bit_killable"): 200.0
        }
        assert [e.kind for e in ended.events] == ["process_d_state_ended"]
        assert values(ended, "gpuwarden_process_disk_sleep_seconds") == {}

    async def test_a_worker_thread_in_d_under_a_sleeping_leader(self, tmp_path: Path) -> None:
        tree = ProcTree(tmp_path / "proc")
        tree.add_process(300, "python3", "S", starttime=10, threads=2)
        tree.add_thread(300, 300, "python3", "S")
        tree.add_thread(300, 311, "pt_nccl_watchdg", "D", wchan="nv_wait_event")
        with pooled_caller() as caller:
            blind = _collector(tree.root, scan_threads=False, d_state_threshold=5.0)
            await run_round(blind, caller, now=0.0)
            unseen = await run_round(blind, caller, now=10.0)
            seeing = _collector(tree.root, d_state_threshold=5.0)
            await run_round(seeing, caller, now=0.0)
            seen = await run_round(seeing, caller, now=10.0)
        assert unseen.events == []
        (event,) = seen.events
        assert event.attributes["tid"] == 311
        assert "thread 311" in event.message
        assert values(seen, "gpuwarden_process_disk_sleep_seconds") == {
            ("300", "python3", "nv_wait_event"): 10.0
        }
        counts = {labels[0]: v for labels, v in values(seen, "gpuwarden_processes").items()}
        assert counts["disk_sleep"] == 0  # counts stay per process, by the leader's state

    async def test_gpu_driver_thread_is_critical(self) -> None:
        collector = _collector(HOST1, d_state_threshold=10.0)
        with pooled_caller() as caller:
            await run_round(collector, caller, now=0.0)
            result = await run_round(collector, caller, now=30.0)
        severities = {e.attributes["comm"]: e.severity for e in result.events}
        assert severities == {"nv_queue": Severity.CRITICAL, "python3": Severity.WARNING}
        nv = next(e for e in result.events if e.attributes["comm"] == "nv_queue")
        assert "Xid" in nv.action

    # Kernel threads as /proc/[pid]/stat showed them on an H200 (driver 580.159.04; older
    # kernels cut them at 15 characters), and the tools' names, cut at 15.
    @pytest.mark.parametrize(
        "comm",
        [
            "nv_queue",
            "nv_open_q",
            "UVM global queue",
            "UVM deferred release queue",
            "UVM Tools Event Queue",
            "UVM deferred re",
            "nvidia",
            "nvidia-smi",
            "nvidia-persiste",
            "nv-hostengine",
            "dcgmi",
            "nv-fabricmanage",
        ],
    )
    async def test_nvidia_names_are_critical(self, tmp_path: Path, comm: str) -> None:
        tree = ProcTree(tmp_path / "proc")
        tree.add_process(50, comm, "D")
        collector = _collector(tree.root, d_state_threshold=1.0)
        with pooled_caller() as caller:
            await run_round(collector, caller, now=0.0)
            (event,) = (await run_round(collector, caller, now=2.0)).events
        assert event.severity is Severity.CRITICAL

    async def test_a_reused_pid_starts_a_new_clock(self, tmp_path: Path) -> None:
        tree = ProcTree(tmp_path / "proc")
        tree.add_process(77, "dd", "D", starttime=100)
        collector = _collector(tree.root, d_state_threshold=60.0)
        with pooled_caller() as caller:
            await run_round(collector, caller, now=0.0)
            tree.add_process(77, "dd", "D", starttime=999)  # another process, same pid
            result = await run_round(collector, caller, now=100.0)
        assert result.events == []
        assert values(result, "gpuwarden_process_disk_sleep_seconds") == {("77", "dd", ""): 0.0}

    async def test_series_are_capped_longest_first(self, tmp_path: Path) -> None:
        tree = ProcTree(tmp_path / "proc")
        tree.add_process(10, "old", "D")
        collector = _collector(tree.root, max_d_state_series=2)
        with pooled_caller() as caller:
            await run_round(collector, caller, now=0.0)
            for pid in (11, 12, 13):
                tree.add_process(pid, f"new{pid}", "D")
            result = await run_round(collector, caller, now=50.0)
        assert values(result, "gpuwarden_process_disk_sleep_seconds") == {
            ("10", "old", ""): 50.0,
            ("11", "new11", ""): 0.0,
        }


@pytest.mark.gpu
@pytest.mark.skipif(
    not Path("/proc/driver/nvidia/version").exists(), reason="the NVIDIA driver is not loaded here"
)
class TestRealNvidiaThreads:
    """On a host with the NVIDIA driver loaded, its kernel threads match the default names."""

    def test_driver_threads_match_gpu_process_names(self) -> None:
        names = {
            s.comm
            for s in read_all_stats(Path("/proc")).values()
            if s.ppid == 2 and (s.comm.startswith(("nv", "UVM")))
        }
        assert "nv_queue" in names
        patterns = ProcessesSettings().gpu_process_names
        assert {n for n in names if not any(fnmatch.fnmatchcase(n, p) for p in patterns)} == set()


class TestZombieFixtures:
    """Zombies grouped by parent, an event past the threshold, cleared below half."""

    async def test_threshold_and_clearing(self, tmp_path: Path) -> None:
        tree = ProcTree(tmp_path / "proc")
        tree.add_process(700, "trainer", "S", starttime=10)
        for pid in range(701, 705):
            tree.add_process(pid, "trainer", "Z", ppid=700)
        collector = _collector(tree.root, zombie_threshold=4)
        with pooled_caller() as caller:
            raised = await run_round(collector, caller)
            tree.remove_process(704)
            held = await run_round(collector, caller)
            tree.remove_process(703)
            tree.remove_process(702)
            cleared = await run_round(collector, caller)
        (event,) = raised.events
        assert (event.kind, event.subject) == ("zombies_accumulating", "pid 700")
        assert "trainer (pid 700)" in event.action
        assert values(raised, "gpuwarden_zombie_processes") == {("700", "trainer"): 4}
        assert held.events == []
        assert [e.kind for e in cleared.events] == ["zombies_reaped"]


ZOMBIE_PARENT = """
import os, sys, time
for _ in range(int(sys.argv[1])):
    if os.fork() == 0:
        os._exit(0)
print("ready", flush=True)
time.sleep(120)
"""


@pytest.fixture
def zombie_parent() -> Iterator[subprocess.Popen[str]]:
    """A real parent that forks three children, lets them exit and never waits for them."""
    parent = subprocess.Popen(
        [sys.executable, "-c", ZOMBIE_PARENT, "3"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        assert parent.stdout.readline().strip() == "ready"
        yield parent
    finally:
        parent.send_signal(signal.SIGKILL)  # init then adopts and reaps the zombies
        parent.wait()


def _zombies_of(ppid: int) -> int:
    return sum(
        1 for s in read_all_stats(Path("/proc")).values() if s.state == "Z" and s.ppid == ppid
    )


class TestRealZombies:
    """Zombies made here, found in the real /proc."""

    async def test_real_zombies_name_their_parent(
        self, zombie_parent: subprocess.Popen[str]
    ) -> None:
        deadline = time.monotonic() + 10
        while _zombies_of(zombie_parent.pid) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        collector = _collector(Path("/proc"), zombie_threshold=3)
        with pooled_caller() as caller:
            result = await run_round(collector, caller)
        (event,) = [
            e
            for e in by_kind(result.events, "zombies_accumulating")
            if e.attributes["ppid"] == zombie_parent.pid
        ]
        assert event.attributes["zombies"] == 3
        assert f"pid {zombie_parent.pid}" in event.action
        assert "cannot be killed" in event.action
        comm = Path(f"/proc/{zombie_parent.pid}/comm").read_text().strip()
        assert event.attributes["parent"] == comm
        zombies = values(result, "gpuwarden_zombie_processes")
        assert zombies[(str(zombie_parent.pid), comm)] == 3
