"""Woken, not polled: a kernel-log record is read when it arrives, not at the next interval.

The runtime waits on a WakeableCollector's `wake` between rounds; the kernel_log collector
wakes on /dev/kmsg's descriptor (poll) and on a followed file (inotify). Every test here runs
the collector with an interval far longer than its bound (30 s against a few seconds), so
only a wake-up can pass it; the bounds are gross, the figures are bench/kernel_log_latency.py's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import os
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from agent.contracts.collector import (
    CollectContext,
    CollectorDeps,
    CollectorSettings,
    CollectorSpec,
    MemoryKeyValueStore,
    SharedServices,
)
from agent.contracts.model import Collection, MetricFamily
from agent.program import config_file, registry
from agent.runtime.blocking import PooledCaller
from agent.runtime.core import Runtime
from agent.runtime.state import StateStore
from collectors.kernel_log.collector import KernelLogCollector, KernelLogSettings
from tests.support.collectors import ROUNDS
from tests.support.kmsg import FakeKmsg, write_boot_id
from tests.support.waiting import until

INTERVAL = 30.0
"""Far longer than any bound below: a test passes only if the reader was woken."""
BOUND = 5.0


def kernel_log_runtime(state_dir: Path, **kernel_log: Any) -> Runtime:
    """The daemon's runtime with only the kernel_log collector, on a real state store."""
    others = {name: {"enabled": False} for name in registry.COLLECTORS if name != "kernel_log"}
    cfg = config_file.parse(
        {
            "state_dir": str(state_dir),
            "prometheus": {"enabled": False},
            "collectors": {**others, "kernel_log": {"interval": INTERVAL, **kernel_log}},
        }
    )
    return Runtime(
        cfg, StateStore.open(state_dir), collectors=registry.COLLECTORS, sinks=registry.SINKS
    )


def xid_line(code: int, bus: int) -> str:
    return f"NVRM: Xid (PCI:0000:{bus:02x}:00): {code}, pid=4242, name=python3, wake test"


def stored_xids(runtime: Runtime) -> list[tuple[str, Any]]:
    """Xid events the runtime has stored and announced (announced only after the store)."""
    return [(e.kind, e.attributes.get("xid")) for e in runtime.recent_events if e.kind == "xid"]


def _has_xid(runtime: Runtime, code: int) -> bool:
    return ("xid", code) in stored_xids(runtime)


class TestFollowedFile:
    async def test_lines_appended_are_stored_long_before_the_interval(self, tmp_path: Path) -> None:
        log = tmp_path / "kern.log"
        log.write_text("[    1.0] boot\n")
        runtime = kernel_log_runtime(tmp_path / "state", path=str(log))
        await runtime.start()
        try:
            await until(runtime.first_round.is_set, BOUND, "the first round")
            for n, code in enumerate((31, 79, 13)):
                with log.open("a") as handle:
                    handle.write(f"[  {n + 2}.0] {xid_line(code, 0x10 + n)}\n")
                started = time.monotonic()
                await until(
                    functools.partial(_has_xid, runtime, code),
                    BOUND,
                    f"Xid {code} appended to the followed file to be stored",
                )
                assert time.monotonic() - started < INTERVAL / 2
        finally:
            await runtime.stop()
            runtime.store.close()

    async def test_a_rotated_file_is_still_followed(self, tmp_path: Path) -> None:
        """Renamed away and created anew (logrotate): the new file wakes the reader too."""
        log = tmp_path / "kern.log"
        log.write_text("[    1.0] boot\n")
        runtime = kernel_log_runtime(tmp_path / "state", path=str(log))
        await runtime.start()
        try:
            await until(runtime.first_round.is_set, BOUND, "the first round")
            log.rename(tmp_path / "kern.log.1")
            # A round woken by the rename finds no file; the creation must wake the next one.
            await asyncio.sleep(0.5)
            log.write_text(f"[    2.0] {xid_line(48, 0x21)}\n")
            await until(lambda: ("xid", 48) in stored_xids(runtime), BOUND, "the rotated file")
            with log.open("a") as handle:
                handle.write(f"[    3.0] {xid_line(94, 0x22)}\n")
            await until(lambda: ("xid", 94) in stored_xids(runtime), BOUND, "its next line")
        finally:
            await runtime.stop()
            runtime.store.close()


def _kmsg_usable() -> bool:
    try:
        os.close(os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK))
        os.close(os.open("/dev/kmsg", os.O_WRONLY))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _kmsg_usable(), reason="needs /dev/kmsg readable and writable (root)")
class TestDevKmsg:
    async def test_a_record_wakes_the_reader(self, tmp_path: Path) -> None:
        """A record written into this machine's /dev/kmsg (from user space, so an Xid in it is
        counted as forged, never trusted) is read within the bound."""
        runtime = kernel_log_runtime(tmp_path / "state")
        await runtime.start()
        try:
            await until(runtime.first_round.is_set, BOUND, "the first round (the ring's backlog)")
            collector: Any = runtime.collectors["kernel_log"].collector
            before = collector.matchers.ignored["xid"]
            marker = uuid.uuid4().hex[:8]
            fd = os.open("/dev/kmsg", os.O_WRONLY)
            try:
                os.write(fd, f"<4>{xid_line(31, 0x3B)} {marker}\n".encode())
            finally:
                os.close(fd)
            await until(
                lambda: collector.matchers.ignored["xid"] > before,
                BOUND,
                "the record written to /dev/kmsg to be read",
            )
        finally:
            await runtime.stop()
            runtime.store.close()


class Woken:
    """A WakeableCollector whose wake returns when the test sets `work`."""

    name = "woken"

    def __init__(self) -> None:
        self.work = asyncio.Event()
        self.rounds = 0

    def families(self) -> Sequence[MetricFamily]:
        return (ROUNDS,)

    async def collect(self, ctx: CollectContext) -> Collection:
        self.rounds += 1
        return Collection(samples=[ROUNDS.sample(self.rounds, self.name)])

    async def close(self) -> None:
        return None

    async def wake(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self.work.wait(), timeout)
        except TimeoutError:
            return
        self.work.clear()


class Broken(Woken):
    async def wake(self, timeout: float) -> None:
        raise RuntimeError("a wake that fails")


def _rounds_are(collector: Woken, count: int) -> bool:
    return collector.rounds == count


def woken_runtime(collector: Woken, interval: float) -> Runtime:
    spec = CollectorSpec("woken", "test", CollectorSettings, lambda s, d: collector)
    cfg = config_file.parse({"prometheus": {"enabled": False}})
    settings = CollectorSettings(interval=interval, timeout=1.0)
    cfg = dataclasses.replace(cfg, collectors={"woken": settings})
    return Runtime(cfg, StateStore.in_memory(), collectors={"woken": spec}, sinks=registry.SINKS)


class TestRuntimeWake:
    """The runtime side of the contract, for any WakeableCollector."""

    async def test_each_wake_runs_a_round_before_the_interval(self) -> None:
        collector = Woken()
        runtime = woken_runtime(collector, INTERVAL)
        await runtime.start()
        try:
            await until(lambda: collector.rounds == 1, BOUND, "the first round")
            for expected in (2, 3, 4):
                collector.work.set()
                await until(functools.partial(_rounds_are, collector, expected), BOUND, "a round")
        finally:
            await runtime.stop()

    async def test_a_wake_that_fails_leaves_the_interval(self) -> None:
        collector = Broken()
        runtime = woken_runtime(collector, 0.2)
        await runtime.start()
        try:
            await until(lambda: collector.rounds >= 4, BOUND, "rounds on the interval")
        finally:
            await runtime.stop()


class TestBoundedRead:
    async def test_a_read_that_stopped_at_its_bound_does_not_wait(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """More records than one read takes: the rest is read at once, not an interval later."""
        monkeypatch.setattr("collectors.kernel_log.kmsg.MAX_RECORDS_PER_READ", 10)
        device = FakeKmsg.with_records([])
        for n in range(25):
            device.write(f"record {n}")
        settings = KernelLogSettings(
            path=Path("/dev/kmsg"), boot_id_path=write_boot_id(tmp_path / "boot_id", "boot-a")
        )
        deps = CollectorDeps("node", tmp_path, MemoryKeyValueStore(), SharedServices(), print)
        collector = KernelLogCollector(settings, deps, io=device)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            ctx = CollectContext(PooledCaller(pool, 5.0), time.time(), 0)
            for _ in range(2):
                await collector.collect(ctx)
                await asyncio.wait_for(collector.wake(INTERVAL), BOUND)
            await collector.collect(ctx)
            assert collector.totals["records"] == 25
            # All read, and a test double has no descriptor: the wait is the timeout's.
            started = time.monotonic()
            await collector.wake(0.2)
            assert time.monotonic() - started >= 0.2
        await collector.close()


def _inotify_descriptors() -> int:
    fds = Path("/proc/self/fd")
    return sum(1 for fd in fds.iterdir() if "inotify" in str(_readlink(fd)))


def _readlink(fd: Path) -> str:
    try:
        return os.readlink(fd)
    except OSError:
        return ""


def test_a_watch_dropped_without_close_gives_its_descriptor_back(tmp_path: Path) -> None:
    """inotify instances are few per user (128 by default): a reader dropped without close()
    must not hold one, or later watches fall back to polling on the interval."""
    import gc

    from collectors.kernel_log.wake import FileWatch

    log = tmp_path / "kern.log"
    log.write_text("")
    before = _inotify_descriptors()
    watches = [FileWatch.open(log) for _ in range(20)]
    assert all(w is not None for w in watches)
    assert _inotify_descriptors() == before + 20
    del watches
    gc.collect()
    assert _inotify_descriptors() == before
