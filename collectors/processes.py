"""Processes: counts per state, processes stuck in D state, and zombies piling up under a parent.

Reads /proc/[pid]/stat directly (one small read per process; psutil builds an object per
process and reads more). Only stat and, for D-state processes, wchan are read: /proc/[pid]/
cmdline and environ take the target's memory lock and can themselves hang on a process that is
stuck in the kernel. A process that exits between listing and reading is left out, normally.

Counts per state are per process, by the thread-group leader's state (what /proc/[pid]/stat
shows). With `scan_threads` a process also counts as stuck in D when any of its threads is (a
worker thread blocked in a driver call under a sleeping main thread); that costs one directory
listing and one read per thread.
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.contracts.collector import (
    CollectContext,
    CollectorDeps,
    CollectorSettings,
    CollectorSpec,
)
from agent.contracts.model import (
    Collection,
    Event,
    MetricFamily,
    MetricType,
    RepairAction,
    Sample,
    Severity,
)
from agent.contracts.settings import setting
from collectors._procfs import ProcStat, find_thread_in_state, read_all_stats, read_wchan

G = MetricType.GAUGE
SOURCE = "processes"

# proc(5): the letters of field 3. Letters not listed here are counted as "other".
STATE_NAMES = {
    "R": "running",
    "S": "sleeping",
    "D": "disk_sleep",
    "Z": "zombie",
    "T": "stopped",
    "t": "tracing_stop",
    "I": "idle",
    "X": "dead",
    "P": "parked",
    "W": "paging",
    "K": "wakekill",
}
# Always reported, 0 included: a count of none is a reading, not an absence.
ALWAYS_REPORTED = ("running", "sleeping", "disk_sleep", "zombie", "stopped", "idle")

PROCESSES = MetricFamily(
    "gpuwarden_processes", G, "Processes per state (the thread-group leader's state)", ("state",)
)
D_STATE = MetricFamily(
    "gpuwarden_process_disk_sleep_seconds",
    G,
    "Seconds a process has been seen in uninterruptible sleep (D), at least; only D processes, top N",
    ("pid", "comm", "wchan"),
    "seconds",
)
ZOMBIES = MetricFamily(
    "gpuwarden_zombie_processes",
    G,
    "Zombie children per parent process, top N parents",
    ("ppid", "parent"),
)
PROCESS_SCAN = MetricFamily("gpuwarden_processes_scanned", G, "Processes read in the last scan")

# Names (comm, at most 15 characters) of the NVIDIA driver's kernel threads and GPU tools. A
# Python process that uses the GPU cannot be told apart by name, so it is not listed.
DEFAULT_GPU_NAMES = (
    # nvidia* covers nvidia-smi, nvidia-persistenced and the "nvidia" kernel thread; nv_* the
    # driver's nv_queue and nv_open_q threads and "UVM *" the UVM queues (all seen in
    # /proc/[pid]/stat on an H200, driver 580.159.04, where kernel threads show full names). A
    # user process's comm is cut at 15 characters, hence nv-fabricmanage*.
    "nvidia*",
    "nv_*",
    "nv-hostengine",
    "nv-fabricmanage*",
    "dcgm*",
    "UVM *",
)


@dataclass(frozen=True)
class ProcessesSettings(CollectorSettings):
    proc_root: Path = setting(Path("/proc"), help="where /proc is mounted (fixture trees in tests)")
    d_state_threshold: float = setting(
        120.0, exclusive_minimum=0, help="seconds in D state after which a process is reported"
    )
    gpu_process_names: tuple[str, ...] = setting(
        DEFAULT_GPU_NAMES,
        help="glob patterns of process names whose D state is critical (the GPU driver and tools)",
    )
    scan_threads: bool = setting(
        True, help="also look for D state in every thread, not only in each process's main thread"
    )
    zombie_threshold: int = setting(
        10, minimum=1, help="zombies under one parent that raise an event (cleared below half)"
    )
    max_d_state_series: int = setting(20, minimum=0, help="D-state series kept, longest first")
    max_zombie_parent_series: int = setting(
        10, minimum=0, help="zombie series kept, parents with most first"
    )


@dataclass(frozen=True, slots=True)
class Scan:
    stats: dict[int, ProcStat]
    wchan: dict[int, str]
    """For every process taken as in D: where it (or its D thread) waits."""
    d_thread: dict[int, int]
    """pid -> a thread in D, for processes whose leader is not in D (with scan_threads)."""

    def in_d_state(self) -> list[ProcStat]:
        return [s for s in self.stats.values() if s.state == "D" or s.pid in self.d_thread]


def scan(proc_root: Path, threads: bool = False) -> Scan:
    stats = read_all_stats(proc_root)
    d_thread: dict[int, int] = {}
    if threads:
        for pid, stat in stats.items():
            # A leader in D is counted already; a single-threaded process has no other thread.
            if stat.state != "D" and stat.num_threads > 1:
                tid = find_thread_in_state(proc_root, pid, "D")
                if tid is not None:
                    d_thread[pid] = tid
    wchan = {pid: read_wchan(proc_root, pid) for pid, s in stats.items() if s.state == "D"}
    wchan.update({pid: read_wchan(proc_root, pid, tid) for pid, tid in d_thread.items()})
    return Scan(stats, wchan, d_thread)


def count_states(stats: dict[int, ProcStat]) -> dict[str, int]:
    counts = dict.fromkeys(ALWAYS_REPORTED, 0)
    for stat in stats.values():
        name = STATE_NAMES.get(stat.state, "other")
        counts[name] = counts.get(name, 0) + 1
    return counts


@dataclass(frozen=True, slots=True)
class ZombieParent:
    ppid: int
    name: str
    starttime: int
    count: int


def zombie_parents(stats: dict[int, ProcStat]) -> list[ZombieParent]:
    """Parents of zombies, most zombies first. A parent that vanished has name ""."""
    counts = Counter(s.ppid for s in stats.values() if s.state == "Z")
    parents = []
    for ppid, count in counts.items():
        parent = stats.get(ppid)
        parents.append(
            ZombieParent(
                ppid, parent.comm if parent else "", parent.starttime if parent else 0, count
            )
        )
    return sorted(parents, key=lambda p: (-p.count, p.ppid))


ProcessKey = tuple[int, int]  # (pid, starttime): a pid alone is reused


class ProcessesCollector:
    name = "processes"

    def __init__(self, settings: ProcessesSettings, deps: CollectorDeps) -> None:
        self.settings = settings
        self.deps = deps
        self._d_since: dict[ProcessKey, float] = {}
        self._d_reported: set[ProcessKey] = set()
        self._zombie_reported: set[ProcessKey] = set()
        self._held_taken = False

    def families(self) -> Sequence[MetricFamily]:
        return (PROCESSES, D_STATE, ZOMBIES, PROCESS_SCAN)

    async def collect(self, ctx: CollectContext) -> Collection:
        result = await ctx.call(
            "proc:processes", scan, self.settings.proc_root, self.settings.scan_threads
        )
        samples = [PROCESSES.sample(n, state) for state, n in count_states(result.stats).items()]
        samples.append(PROCESS_SCAN.sample(len(result.stats)))
        events: list[Event] = []
        if not self._held_taken:
            self._held_taken = True
            self._take_over(result)
        self._d_state(ctx.now, result, samples, events)
        self._zombies(result.stats, samples, events)
        return Collection(samples=samples, events=events)

    def _d_state(
        self, now: float, result: Scan, samples: list[Sample], events: list[Event]
    ) -> None:
        in_d = {(s.pid, s.starttime): s for s in result.in_d_state()}
        for key in list(self._d_since):
            if key not in in_d:
                since = self._d_since.pop(key)
                if key in self._d_reported:
                    self._d_reported.discard(key)
                    events.append(
                        Event(
                            source=SOURCE,
                            kind="process_d_state_ended",
                            severity=Severity.INFO,
                            repair_action=RepairAction.NONE,
                            clears=("process_stuck_d_state",),
                            subject=f"pid {key[0]}",
                            message=f"pid {key[0]} left D state (or exited) after at least "
                            f"{now - since:.0f} s",
                        )
                    )
        rows = []
        for key, stat in in_d.items():
            since = self._d_since.setdefault(key, now)
            seconds = now - since
            wchan = result.wchan.get(stat.pid, "")
            rows.append((seconds, stat, wchan))
            if seconds >= self.settings.d_state_threshold and key not in self._d_reported:
                self._d_reported.add(key)
                events.append(self._d_event(stat, seconds, wchan, result.d_thread.get(stat.pid)))
        rows.sort(key=lambda row: (-row[0], row[1].pid))
        for seconds, stat, wchan in rows[: self.settings.max_d_state_series]:
            samples.append(D_STATE.sample(seconds, str(stat.pid), stat.comm, wchan))

    def _take_over(self, result: Scan) -> None:
        """At the first round: the stuck processes and zombie parents an earlier instance
        (before a reload or a restart) reported and the ledger still holds are this one's,
        so that one still stuck is no news and one that is gone gets its all-clear. A
        process is the one reported if it has its pid and its start time (the finding's
        alias `pid N start T`): another that got the pid is news of its own. A finding of an
        agent that named the pid alone takes the process of that pid now."""
        held = self.deps.held_by(SOURCE, ("process_stuck_d_state", "zombies_accumulating"))
        for subject, kinds in held.items():
            pid_text = subject.removeprefix("pid ")
            if not pid_text.isdigit():
                continue
            pid = int(pid_text)
            stat = result.stats.get(pid)
            now_started = stat.starttime if stat is not None else 0
            for kind, repair in kinds.items():
                started = _started(pid, repair.aliases)
                key = (pid, now_started if started is None else started)
                if kind == "process_stuck_d_state":
                    self._d_since.setdefault(key, repair.since - self.settings.d_state_threshold)
                    self._d_reported.add(key)
                elif kind == "zombies_accumulating":
                    self._zombie_reported.add(key)

    def _d_event(self, stat: ProcStat, seconds: float, wchan: str, tid: int | None) -> Event:
        gpu = any(fnmatch.fnmatchcase(stat.comm, p) for p in self.settings.gpu_process_names)
        where = f"in the kernel function {wchan}" if wchan else "in the kernel"
        who = f"process {stat.comm} (pid {stat.pid}" + (f", thread {tid})" if tid else ")")
        no_kill = (
            "a process in D state does not die from any signal, SIGKILL included, "
            "until its wait ends"
        )
        if gpu:
            action = (
                f"the NVIDIA driver or a GPU tool is stuck: look for Xid errors "
                f"(dmesg | grep -i xid) and check the GPUs with 'timeout 30 nvidia-smi'; "
                f"{no_kill}, so if it does not recover the GPU needs a reset or the host "
                "a reboot"
            )
        else:
            action = (
                f"find what it waits on (cat /proc/{stat.pid}/stack as root; the disks and "
                f"network mounts it uses); {no_kill}: fix the device or mount it waits on"
            )
        return Event(
            source=SOURCE,
            kind="process_stuck_d_state",
            severity=Severity.CRITICAL if gpu else Severity.WARNING,
            repair_action=RepairAction.INVESTIGATE,
            subject=f"pid {stat.pid}",
            aliases=(_process_name(stat.pid, stat.starttime),),
            message=f"{who} has been in uninterruptible sleep "
            f"(D state) for at least {seconds:.0f} s, waiting {where}",
            action=action,
            attributes={
                "pid": stat.pid,
                "tid": tid,
                "comm": stat.comm,
                "wchan": wchan,
                "seconds": round(seconds, 1),
                "gpu_process": gpu,
            },
        )

    def _zombies(
        self, stats: dict[int, ProcStat], samples: list[Sample], events: list[Event]
    ) -> None:
        parents = zombie_parents(stats)
        for parent in parents[: self.settings.max_zombie_parent_series]:
            samples.append(ZOMBIES.sample(parent.count, str(parent.ppid), parent.name))
        threshold = self.settings.zombie_threshold
        # The parents gone first: an all-clear names the pid, and a new parent with that pid
        # raised before it would be cleared with it.
        seen = {(parent.ppid, parent.starttime) for parent in parents}
        for key in sorted(self._zombie_reported - seen):
            self._zombie_reported.discard(key)
            events.append(_zombies_reaped(key[0], ""))
        for parent in parents:
            key = (parent.ppid, parent.starttime)
            if parent.count >= threshold and key not in self._zombie_reported:
                self._zombie_reported.add(key)
                events.append(_zombie_event(parent))
            elif key in self._zombie_reported and parent.count < max(threshold / 2, 1):
                self._zombie_reported.discard(key)
                events.append(_zombies_reaped(parent.ppid, parent.name))

    async def close(self) -> None:
        return None


def _process_name(pid: int, starttime: int) -> str:
    """The name of one process, not of whichever has its pid: its start time (clock ticks
    after boot, /proc/<pid>/stat field 22) with it."""
    return f"pid {pid} start {starttime}"


def _started(pid: int, aliases: Sequence[str]) -> int | None:
    """The start time a finding's alias gives its process; None where it has none."""
    prefix = f"pid {pid} start "
    for alias in aliases:
        if alias.startswith(prefix) and alias[len(prefix) :].isdigit():
            return int(alias[len(prefix) :])
    return None


def _zombie_event(parent: ZombieParent) -> Event:
    name = parent.name or "a parent that has exited"
    if parent.ppid == 1:
        action = (
            "pid 1 does not reap its children: in a container, run it with an init "
            "(docker run --init, tini); on a host, the init system is broken"
        )
    else:
        action = (
            f"a zombie cannot be killed (it is already dead); only its parent can reap it. "
            f"Fix or restart the parent, {name} (pid {parent.ppid}); once it exits, init "
            "adopts its zombies and reaps them"
        )
    return Event(
        source=SOURCE,
        kind="zombies_accumulating",
        severity=Severity.WARNING,
        repair_action=RepairAction.INVESTIGATE,
        subject=f"pid {parent.ppid}",
        aliases=(_process_name(parent.ppid, parent.starttime),),
        message=f"{parent.count} zombie processes wait for their parent {name} "
        f"(pid {parent.ppid}) to reap them",
        action=action,
        attributes={"ppid": parent.ppid, "parent": parent.name, "zombies": parent.count},
    )


def _zombies_reaped(ppid: int, name: str) -> Event:
    return Event(
        source=SOURCE,
        kind="zombies_reaped",
        severity=Severity.INFO,
        repair_action=RepairAction.NONE,
        clears=("zombies_accumulating",),
        subject=f"pid {ppid}",
        message=f"the zombies of {name or 'the parent'} (pid {ppid}) have been reaped "
        "(or the parent exited)",
    )


SPEC = CollectorSpec(
    name="processes",
    description="process counts per state, D-state processes, zombies per parent",
    settings_type=ProcessesSettings,
    factory=ProcessesCollector,
    default_settings=ProcessesSettings(interval=15.0),
)
