"""The kernel_log collector end to end on a /dev/kmsg stand-in: events, counters, no replay
after a restart, and one event for an Xid both the kernel log and NVML saw."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.contracts.collector import CollectContext, CollectorDeps, SharedServices
from agent.contracts.errors import CallTimedOut
from agent.contracts.model import Event, Sample, Severity
from agent.runtime.blocking import PooledCaller
from agent.runtime.state import StateStore
from collectors._xid import XidCorrelator, XidObservation
from collectors.kernel_log.collector import SPEC, KernelLogCollector, KernelLogSettings
from collectors.kernel_log.kmsg import FileLogReader, ReadBatch
from tests.support.kmsg import FakeKmsg, capture_records, write_boot_id
from tests.support.stores import StateOnDisk

PCI = "0000:3b:00.0"
IDENTITY = {
    "gpu": "0",
    "uuid": "GPU-5b3c1d2e",
    "pci_bus_id": "00000000:3B:00.0",
    "model": "NVIDIA H200",
}
IO_ERROR = "I/O error, dev sdb, sector 2048 op 0x1:(WRITE) flags 0x800 phys_seg 1 prio class 2"


@pytest.fixture
def executor() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    pool = concurrent.futures.ThreadPoolExecutor(2)
    yield pool
    pool.shutdown(wait=True)


class Harness:
    """A collector as the runtime builds it: real thread pool, real state store."""

    def __init__(
        self, tmp_path: Path, device: FakeKmsg, executor: concurrent.futures.Executor
    ) -> None:
        self.tmp_path = tmp_path
        self.device = device
        self.executor = executor
        self.boot_id = write_boot_id(tmp_path / "boot_id", "boot-a")
        self.store = StateStore.open(tmp_path / "state")
        self.shared = SharedServices()
        self.round = 0
        self.collector = self.build()

    def build(self) -> KernelLogCollector:
        settings = KernelLogSettings(
            path=Path("/dev/kmsg"), boot_id_path=self.boot_id, repeat_holdoff=300.0
        )
        deps = CollectorDeps("node", self.tmp_path, self.store, self.shared, lambda e: None)
        return KernelLogCollector(settings, deps, io=self.device)

    async def collect(self, now: float | None = None) -> tuple[list[Event], list[Sample]]:
        caller = PooledCaller(self.executor, 5.0)
        ctx = CollectContext(caller, time.time() if now is None else now, self.round)
        self.round += 1
        result = await self.collector.collect(ctx)
        # The snapshot as the runtime makes it: the round's and the shared series (the Xid
        # counters are the correlator's, agent/contracts/collector.py SharedSeries).
        shared = [s for source in self.shared.series() for s in source.shared_samples()]
        return list(result.events), [*result.samples, *shared]

    async def restart(self) -> None:
        await self.collector.close()
        self.store.close()
        self.store = StateStore.open(self.tmp_path / "state")
        self.shared = SharedServices()
        self.round = 0
        self.collector = self.build()


def value(samples: list[Sample], name: str, **labels: str) -> float | None:
    for sample in samples:
        if sample.family.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
            return sample.value
    return None


def planted_device() -> FakeKmsg:
    device = FakeKmsg.with_records(capture_records())
    device.write(
        "NVRM: Xid (PCI:0000:3b:00): 79, pid=2314, name=python3, GPU has fallen off the bus."
    )
    device.write("NVRM: Xid (PCI:0000:3b:00): 48, pid=1, name=fake, forged", facility=1, level=6)
    for _ in range(3):
        device.write(IO_ERROR, level=3)
    device.write("Out of memory: Killed process 9876 (python3) total-vm:1kB, anon-rss:1kB", level=3)
    return device


class TestKernelLogCollector:
    """What the runtime gets from the collector, round by round."""

    async def test_first_start_reports_backlog_once(
        self, tmp_path: Path, executor: concurrent.futures.Executor
    ) -> None:
        """The backlog's findings are events marked predates_agent; a forged Xid is only counted;
        repeated I/O errors raise one event; the counters count every line."""
        h = Harness(tmp_path, planted_device(), executor)
        h.shared.get(XidCorrelator, XidCorrelator).set_identity(PCI, IDENTITY)
        events, samples = await h.collect()
        kinds = sorted(e.kind for e in events)
        assert kinds == ["io_error", "oom_kill", "xid"]
        xid = next(e for e in events if e.kind == "xid")
        assert xid.attributes["predates_agent"] is True
        assert xid.attributes["xid"] == 79
        assert xid.severity is Severity.CRITICAL
        assert "seen by kmsg" in xid.message
        assert xid.subject == "GPU-5b3c1d2e"
        oom = next(e for e in events if e.kind == "oom_kill")
        assert oom.attributes["process"] == "python3"
        assert oom.attributes["pid"] == 9876
        assert oom.source == "kernel_log"
        assert oom.attributes["predates_agent"] is True
        assert (
            value(
                samples,
                "gpuwarden_xid_errors_total",
                xid="79",
                gpu="0",
                uuid="GPU-5b3c1d2e",
                model="NVIDIA H200",
            )
            == 1
        )
        assert value(samples, "gpuwarden_kernel_log_ignored_records_total", kind="xid") == 1
        assert value(samples, "gpuwarden_kernel_log_findings_total", kind="io_error") == 3
        assert value(samples, "gpuwarden_kernel_log_suppressed_events_total", kind="io_error") == 2
        assert value(samples, "gpuwarden_kernel_log_findings_total", kind="hung_task") == 0
        assert value(samples, "gpuwarden_kernel_log_records_total") == len(h.device.records)
        assert value(samples, "gpuwarden_kernel_log_malformed_records_total") == 0
        assert {s.family for s in samples} <= set(h.collector.families())
        await h.collector.close()

    async def test_restart_reports_nothing_again(
        self, tmp_path: Path, executor: concurrent.futures.Executor
    ) -> None:
        """Same boot, restarted agent: no event repeats; the skipped records are counted."""
        h = Harness(tmp_path, planted_device(), executor)
        events, _ = await h.collect()
        assert events
        await h.restart()
        events, samples = await h.collect()
        assert events == []
        assert value(samples, "gpuwarden_kernel_log_replay_skipped_records_total") == len(
            h.device.records
        )
        assert value(samples, "gpuwarden_kernel_log_records_total") == 0
        await h.collector.close()

    async def test_a_full_disk_keeps_the_rounds_findings_and_stores_the_cursor_later(
        self,
        tmp_path: Path,
        executor: concurrent.futures.Executor,
        state_on_disk: StateOnDisk,
    ) -> None:
        """The state disk refuses the cursor: the round's findings still come out, the
        cursor waits in memory and is stored once there is room, so a restart replays
        nothing."""
        h = Harness(tmp_path, planted_device(), executor)
        h.collector.deps = CollectorDeps(
            "node", tmp_path, state_on_disk.state, h.shared, lambda e: None
        )
        state_on_disk.fill()
        events, samples = await h.collect()
        assert not state_on_disk.end_round()
        assert sorted(e.kind for e in events) == ["io_error", "oom_kill", "xid"]
        assert value(samples, "gpuwarden_kernel_log_findings_total", kind="io_error") == 3
        events, _ = await h.collect()  # nothing new
        assert events == []
        assert not state_on_disk.end_round()
        state_on_disk.disk.free()
        assert state_on_disk.end_round()
        await h.collector.close()
        h.store.close()
        h.store = state_on_disk.store  # a restarted agent reads what reached the disk
        h.shared = SharedServices()
        h.round = 0
        h.collector = h.build()
        events, samples = await h.collect()
        assert events == []
        assert value(samples, "gpuwarden_kernel_log_replay_skipped_records_total") == len(
            h.device.records
        )
        await h.collector.close()

    async def test_reload_does_not_mark_new_records_as_backlog(
        self, tmp_path: Path, executor: concurrent.futures.Executor
    ) -> None:
        """A collector made again by a configuration reload (same process, same shared
        services) reports records written since the last round as live, not predating."""
        h = Harness(tmp_path, FakeKmsg.with_records(capture_records()), executor)
        events, _ = await h.collect()
        assert events == []
        await h.collector.close()
        h.device.write(
            "Out of memory: Killed process 4321 (trainer) total-vm:1kB, anon-rss:1kB", level=3
        )
        h.collector = h.build()  # what Runtime.reload does: same store, same SharedServices
        events, _ = await h.collect()
        [oom] = events
        assert oom.attributes["predates_agent"] is False
        assert "before the agent started" not in oom.message
        await h.collector.close()

    async def test_live_xid_seen_by_both_sources_is_one_alert(
        self, tmp_path: Path, executor: concurrent.futures.Executor
    ) -> None:
        """An Xid NVML reports and the kernel log writes at the same time: NVML's event, and
        the kernel log's confirmation of it in the round that reads the line."""
        h = Harness(tmp_path, FakeKmsg.with_records(capture_records()), executor)
        events, _ = await h.collect()
        assert events == []  # the H200 capture holds no findings
        correlator = h.shared.get(XidCorrelator, XidCorrelator)
        correlator.set_identity(PCI, IDENTITY)
        now = time.time()
        first = correlator.observe(
            XidObservation(
                source="nvml", pci_bus_id=PCI, code=48, time=now, text="NVML event: Xid 48"
            )
        )
        assert first is not None and first.kind == "xid"
        h.device.write(
            "NVRM: Xid (PCI:0000:3b:00): 48, pid=77, name=sim, DBE",
            usec=int(time.monotonic() * 1e6),
        )
        events, samples = await h.collect(now=now)
        [confirmed] = events
        assert confirmed.kind == "xid_confirmed"
        assert confirmed.attributes["confirms"] == first.id
        assert confirmed.attributes["sources"] == "kmsg,nvml"
        assert confirmed.severity is Severity.INFO
        assert value(samples, "gpuwarden_xid_errors_total", xid="48") == 1
        assert value(samples, "gpuwarden_xid_confirmed_total", xid="48") == 1
        await h.collector.close()

    async def test_a_live_xid_is_an_event_of_the_round_that_reads_it(
        self, tmp_path: Path, executor: concurrent.futures.Executor
    ) -> None:
        """Nothing waits for a twin past the round (and its cursor): close hands on nothing."""
        h = Harness(tmp_path, FakeKmsg.with_records(capture_records()), executor)
        emitted: list[Event] = []
        h.collector.deps = CollectorDeps("node", tmp_path, h.store, h.shared, emitted.append)
        await h.collect()
        h.device.write(
            "NVRM: Xid (PCI:0000:3b:00): 94, Contained", usec=int(time.monotonic() * 1e6)
        )
        events, _ = await h.collect()
        assert [e.attributes["xid"] for e in events] == [94]
        await h.collector.close()
        assert emitted == []

    async def test_saved_file_source(
        self, tmp_path: Path, executor: concurrent.futures.Executor
    ) -> None:
        """A file of saved lines works as the source, tail-like."""
        log = tmp_path / "kern.log"
        log.write_text(f"[  1.0] {IO_ERROR}\n")
        store = StateStore.open(tmp_path / "state")
        deps = CollectorDeps("node", tmp_path, store, SharedServices(), lambda e: None)
        collector = SPEC.make(SPEC.defaults().replace(path=log), deps)
        ctx = CollectContext(PooledCaller(executor, 5.0), time.time(), 0)
        result = await collector.collect(ctx)
        assert [e.kind for e in result.events] == ["io_error"]
        with log.open("a") as handle:
            handle.write("[  2.0] INFO: task python3:55012 blocked for more than 245 seconds.\n")
        result = await collector.collect(ctx)
        assert [(e.kind, e.attributes["predates_agent"]) for e in result.events] == [
            ("hung_task", False)
        ]
        await collector.close()
        store.close()

    async def test_read_outliving_its_timeout_loses_no_finding(
        self,
        tmp_path: Path,
        executor: concurrent.futures.Executor,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """A read of a saved log that outlives the call timeout fails that round; the batch
        it read is dropped by the runtime, and the next round reads it again: the finding is
        raised, once."""
        log = tmp_path / "kern.log"
        log.write_text(f"[  1.0] {IO_ERROR}\n")
        store = StateStore.open(tmp_path / "state")
        deps = CollectorDeps("node", tmp_path, store, SharedServices(), lambda e: None)
        collector = SPEC.make(SPEC.defaults().replace(path=log), deps)
        real_read = FileLogReader.read
        slow = [True]

        def read(reader: FileLogReader) -> ReadBatch:
            batch = real_read(reader)
            if slow:  # the first read only: a huge file on a slow disk
                slow.clear()
                time.sleep(0.6)
            return batch

        monkeypatch.setattr(FileLogReader, "read", read)
        ctx = CollectContext(PooledCaller(executor, 0.2), time.time(), 0)
        with pytest.raises(CallTimedOut):
            await collector.collect(ctx)
        await asyncio.sleep(0.8)  # the hung read finishes; its result goes nowhere
        result = await collector.collect(ctx)
        assert [e.kind for e in result.events] == ["io_error"]
        result = await collector.collect(ctx)
        assert result.events == []
        await collector.close()
        store.close()

    def test_registered(self) -> None:
        """The registry finds the collector; its interval is shorter than the Xid window."""
        from agent.program import registry

        assert registry.collector_spec("kernel_log") is SPEC
        assert SPEC.defaults().interval < 5.0  # shorter than the correlator's window
