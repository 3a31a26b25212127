"""Test helpers for the host collectors: /proc fixture trees, a hanging statvfs, one-round runs."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from agent.contracts.collector import (
    BlockingCaller,
    CollectContext,
    Collector,
    CollectorDeps,
    KeyValueStore,
    MemoryKeyValueStore,
    SharedServices,
)
from agent.contracts.model import Collection, Event, Sample
from agent.runtime.blocking import PooledCaller

GIB = 1024**3
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "proc"


def make_deps(state: KeyValueStore | None = None) -> CollectorDeps:
    emitted: list[Event] = []
    return CollectorDeps(
        "test-node",
        Path("/nonexistent"),
        state or MemoryKeyValueStore(),
        SharedServices(),
        emitted.append,
    )


@contextmanager
def pooled_caller(timeout: float = 5.0) -> Iterator[PooledCaller]:
    """The runtime's real PooledCaller on a private pool; hung threads are not waited for."""
    executor = concurrent.futures.ThreadPoolExecutor(4)
    try:
        yield PooledCaller(executor, timeout)
    finally:
        executor.shutdown(wait=False, cancel_futures=True)


async def run_round(
    collector: Collector, caller: BlockingCaller, now: float | None = None, round_number: int = 0
) -> Collection:
    ctx = CollectContext(caller=caller, now=time.time() if now is None else now, round=round_number)
    return await collector.collect(ctx)


def values(collection: Collection, name: str) -> dict[tuple[str, ...], float]:
    """label values -> value for every sample of the metric `name`."""
    return {s.label_values: s.value for s in collection.samples if s.family.name == name}


def by_kind(events: Iterable[Event], kind: str) -> list[Event]:
    return [e for e in events if e.kind == kind]


def sample_names(samples: Iterable[Sample]) -> set[str]:
    return {s.family.name for s in samples}


def stat_line(
    pid: int, comm: str, state: str, ppid: int, starttime: int = 1000, *, num_threads: int = 1
) -> str:
    """A /proc/[pid]/stat line with the fields the kernel writes (52 of them)."""
    fields = [state, str(ppid)] + ["0"] * 15 + [str(num_threads), "0", str(starttime)] + ["0"] * 30
    return f"{pid} ({comm}) {' '.join(fields)}\n"


class ProcTree:
    """A writable /proc fixture tree in a temporary directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def add_process(
        self,
        pid: int,
        comm: str,
        state: str,
        *,
        ppid: int = 1,
        starttime: int = 1000,
        wchan: str = "0",
        threads: int = 1,
    ) -> None:
        directory = self.root / str(pid)
        directory.mkdir(exist_ok=True)
        (directory / "stat").write_text(
            stat_line(pid, comm, state, ppid, starttime, num_threads=threads)
        )
        (directory / "wchan").write_text(wchan)

    def add_thread(self, pid: int, tid: int, comm: str, state: str, wchan: str = "0") -> None:
        directory = self.root / str(pid) / "task" / str(tid)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "stat").write_text(stat_line(tid, comm, state, 1))
        (directory / "wchan").write_text(wchan)

    def remove_process(self, pid: int) -> None:
        shutil.rmtree(self.root / str(pid))

    def set_mountinfo(self, text: str) -> None:
        (self.root / "self").mkdir(exist_ok=True)
        (self.root / "self" / "mountinfo").write_text(text)

    def set_system(self, boot_id: str, uptime: float = 1234.5) -> None:
        (self.root / "meminfo").write_text(
            "MemTotal:       16384000 kB\nMemFree:         1000000 kB\n"
            "MemAvailable:    8192000 kB\nSwapTotal:             0 kB\nSwapFree:              0 kB\n"
            "HugePages_Total:       0\n"
        )
        (self.root / "loadavg").write_text("0.50 0.25 0.10 1/123 4567\n")
        (self.root / "uptime").write_text(f"{uptime} 100.00\n")
        (self.root / "sys/kernel/random").mkdir(parents=True, exist_ok=True)
        (self.root / "sys/kernel/random/boot_id").write_text(boot_id + "\n")


def fake_statvfs_result(
    *,
    size: int,
    available: int,
    free: int | None = None,
    inodes: int = 1000,
    inodes_free: int = 500,
    read_only: bool = False,
    unit: int = 4096,
) -> os.statvfs_result:
    """A statvfs answer in bytes, for scripting how full a file system is."""
    free = available if free is None else free
    flag = os.ST_RDONLY if read_only else 0
    return os.statvfs_result(
        (
            unit,
            unit,
            size // unit,
            free // unit,
            available // unit,
            inodes,
            inodes_free,
            inodes_free,
            flag,
            255,
        )
    )


class HangingStatvfs:
    """statvfs that blocks on `release` for the paths in `hanging`, like a dead NFS server.

    Other paths are answered by `answer` (default: the real os.statvfs).
    """

    def __init__(
        self, hanging: Iterable[str], answer: Callable[[str], os.statvfs_result] = os.statvfs
    ) -> None:
        self.hanging = set(hanging)
        self.release = threading.Event()
        self.calls: list[str] = []
        self._answer = answer

    def __call__(self, path: str) -> os.statvfs_result:
        self.calls.append(path)
        if path in self.hanging:
            self.release.wait()
        return self._answer(path)


class ScriptedStatvfs:
    """statvfs answers by path, changeable between rounds; unknown paths raise ENOENT."""

    def __init__(self, answers: dict[str, os.statvfs_result | OSError] | None = None) -> None:
        self.answers: dict[str, os.statvfs_result | OSError] = dict(answers or {})

    def __call__(self, path: str) -> os.statvfs_result:
        answer = self.answers.get(path)
        if answer is None:
            raise FileNotFoundError(2, "No such file or directory", path)
        if isinstance(answer, OSError):
            raise answer
        return answer
