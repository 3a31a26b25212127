"""Nothing lost, raised at first sight: an Xid is an event as soon as either source sees it,
in the same step that moves the source's cursor; the other source's sighting confirms it.

The class under test: whatever the code, GPU and order of the sources, no Xid waits in memory
once it is read (a crash after the read loses nothing), the second sighting is never a second
alert, and an event made again from the same kernel-log record has the same id.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest

from agent.contracts.collector import (
    CollectContext,
    CollectorDeps,
    MemoryKeyValueStore,
    SharedServices,
)
from agent.contracts.model import Event, Severity
from agent.runtime.blocking import PooledCaller
from collectors._nvml import NvmlBackend
from collectors._xid import XidCorrelator, XidObservation, XidSource
from collectors.gpu.events import GpuEventThread
from collectors.kernel_log.collector import KernelLogCollector, KernelLogSettings
from collectors.kernel_log.kmsg import FILE_CURSOR_KEY, KMSG_CURSOR_KEY, STATE_NAMESPACE
from tests.support.kmsg import FakeKmsg, capture_records, write_boot_id
from tests.support.nvml import fake_gpus
from tests.support.nvml_fake import FakeNvml
from tests.support.waiting import wait_until

PCI = "0000:3b:00.0"
CODES = (13, 31, 48, 79, 94, 119)
GPUS = ("0000:3b:00.0", "0000:86:00.0", "0001:0a:00.0")


def obs(
    source: XidSource, at: float, code: int = 79, pci: str = PCI, text: str = ""
) -> XidObservation:
    return XidObservation(source, pci, code, at, text=text or f"{source} Xid {code}")


def xid_line(code: int, pci: str) -> str:
    domain, bus, device = pci.split(".", maxsplit=1)[0].split(":")
    return f"NVRM: Xid (PCI:{domain}:{bus}:{device}): {code}, pid=4242, name=python3, test fault"


@pytest.fixture
def executor() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    pool = concurrent.futures.ThreadPoolExecutor(2)
    yield pool
    pool.shutdown(wait=True)


class TestFirstSight:
    """The correlator hands back the event at the first sighting, from either source."""

    @pytest.mark.parametrize("source", ["kmsg", "nvml"])
    @pytest.mark.parametrize("code", CODES)
    def test_the_first_sighting_is_the_event(self, source: XidSource, code: int) -> None:
        correlator = XidCorrelator(window=5.0, clock=lambda: 1000.0)
        event = correlator.observe(obs(source, 1000.0, code=code))
        assert event is not None and event.kind == "xid"
        assert event.attributes["xid"] == code
        assert event.attributes["sources"] == source
        assert correlator.counts == {(PCI, code): 1}

    @pytest.mark.parametrize(("first", "second"), [("kmsg", "nvml"), ("nvml", "kmsg")])
    @pytest.mark.parametrize("code", CODES)
    def test_the_twin_confirms_and_is_not_a_second_alert(
        self, first: XidSource, second: XidSource, code: int
    ) -> None:
        correlator = XidCorrelator(window=5.0, clock=lambda: 1000.0)
        raised = correlator.observe(obs(first, 1000.0, code=code))
        assert raised is not None
        follow = correlator.observe(obs(second, 1000.4, code=code))
        assert follow is not None
        assert follow.kind == "xid_confirmed"
        assert follow.severity is Severity.INFO
        assert follow.attributes["confirms"] == raised.id
        assert follow.subject == raised.subject
        assert follow.attributes["sources"] == "kmsg,nvml"
        assert follow.id != raised.id
        assert correlator.counts == {(PCI, code): 1}  # one Xid, seen twice
        assert correlator.confirmations == {(PCI, code): 1}
        # A third sighting of the pair within the window is neither.
        assert correlator.observe(obs(second, 1000.5, code=code)) is None

    def test_a_twin_after_the_window_is_a_new_incident(self) -> None:
        correlator = XidCorrelator(window=5.0, clock=lambda: 1000.0, holdoff=0.0)
        assert correlator.observe(obs("kmsg", 1000.0)) is not None
        event = correlator.observe(obs("nvml", 1010.0))
        assert event is not None and event.kind == "xid"
        assert correlator.confirmations == {}

    def test_worse_words_of_the_twin_escalate(self) -> None:
        """NVML carries no words; the kernel line saying Fatal makes it critical, once."""
        correlator = XidCorrelator(window=5.0, clock=lambda: 100.0)
        line = "NVRM: Xid (PCI:0000:3b:00): 149, NETIR_LINK_EVT  Fatal   XC0 i0 Link 01 (0x1)"
        first = correlator.observe(obs("nvml", 100.0, code=149, text="NVML Xid event"))
        assert first is not None
        follow = correlator.observe(obs("kmsg", 100.1, code=149, text=line))
        assert follow is not None and follow.kind == "xid_escalated"
        assert follow.severity is Severity.CRITICAL
        assert follow.attributes["confirms"] == first.id
        assert first.severity < Severity.CRITICAL

    def test_repeats_of_one_source_are_counted_and_told_with_the_next_event(self) -> None:
        correlator = XidCorrelator(window=5.0, clock=lambda: 1000.0, holdoff=300.0)
        events = [correlator.observe(obs("kmsg", 1000.0 + i * 0.5, code=13)) for i in range(3)]
        assert [e is not None for e in events] == [True, False, False]
        assert correlator.counts == {(PCI, 13): 3}
        later = correlator.observe(obs("kmsg", 1400.0, code=13))
        assert later is not None
        assert later.attributes["repeats_since_last_event"] == 2

    def test_the_same_record_gives_the_same_event_id(self) -> None:
        """Read again after a crash (a new correlator, the same origin): the same id."""
        origin = ("node-a", "kmsg:boot-1", "4711")
        ids = []
        for _ in range(2):
            correlator = XidCorrelator(window=5.0, clock=lambda: 1000.0)
            event = correlator.observe(
                XidObservation("kmsg", PCI, 79, 1000.0, text="x", origin=origin)
            )
            assert event is not None
            ids.append(event.id)
        assert ids[0] == ids[1]
        other = XidCorrelator().observe(
            XidObservation("kmsg", PCI, 79, 1000.0, text="x", origin=("node-b", *origin[1:]))
        )
        assert other is not None and other.id != ids[0]


class TestNvmlThread:
    def test_an_nvml_xid_is_emitted_by_the_thread_at_once(self) -> None:
        """No round, no window: the event thread hands the Xid to emit itself."""
        fake = FakeNvml(fake_gpus(1))
        emitted: list[Event] = []
        backend = NvmlBackend(fake)
        backend.start()
        thread = GpuEventThread(
            backend, XidCorrelator(window=5.0), emitted.append, [(0, 0xFF9F)], dict, wait_ms=50
        )
        thread.start()
        try:
            assert thread.ready.wait(5)
            fake.push_event(fake.gpus[0], pynvml.nvmlEventTypeXidCriticalError, 31)
            wait_until(lambda: bool(emitted), timeout=3.0, what="the NVML Xid event")
        finally:
            thread.stop()
        [event] = emitted
        assert (event.kind, event.attributes["xid"], event.attributes["sources"]) == (
            "xid",
            31,
            "nvml",
        )


class KmsgHarness:
    """The collector as the runtime builds it, with a state that a crash throws away."""

    def __init__(self, tmp_path: Path, device: FakeKmsg, executor: concurrent.futures.Executor):
        self.tmp_path = tmp_path
        self.device = device
        self.executor = executor
        self.boot_id = write_boot_id(tmp_path / "boot_id", "boot-a")
        self.state = MemoryKeyValueStore()
        self.rounds = 0
        self.collector = self.build()

    def build(self) -> KernelLogCollector:
        settings = KernelLogSettings(path=Path("/dev/kmsg"), boot_id_path=self.boot_id)
        deps = CollectorDeps("node", self.tmp_path, self.state, SharedServices(), lambda e: None)
        return KernelLogCollector(settings, deps, io=self.device)

    async def collect(self) -> list[Event]:
        ctx = CollectContext(PooledCaller(self.executor, 5.0), time.time(), self.rounds)
        self.rounds += 1
        return list((await self.collector.collect(ctx)).events)


class TestNothingWaitsPastTheCursor:
    """Each round's events hold every Xid the round read: the cursor it commits is never past
    an Xid that is not among the events stored with it."""

    @pytest.mark.parametrize("per_round", [1, 3])
    async def test_every_xid_read_is_an_event_of_the_round_that_moves_the_cursor(
        self, tmp_path: Path, executor: concurrent.futures.Executor, per_round: int
    ) -> None:
        h = KmsgHarness(tmp_path, FakeKmsg.with_records(capture_records()), executor)
        assert await h.collect() == []  # the H200 capture holds no Xid
        written: list[tuple[str, int]] = []
        for index in range(4):
            batch = []
            for j in range(per_round):
                code, pci = CODES[(index + j) % len(CODES)], GPUS[j % len(GPUS)]
                h.device.write(xid_line(code, pci), usec=int(time.monotonic() * 1e6))
                batch.append((pci, code))
            written += batch
            events = await h.collect()
            cursor = h.state.get(STATE_NAMESPACE, KMSG_CURSOR_KEY)
            assert isinstance(cursor, dict) and cursor["seq"] == h.device.next_seq - 1
            got = sorted((e.attributes["pci_bus_id"], e.attributes["xid"]) for e in events)
            assert got == sorted(batch), f"round {index}: cursor moved past {batch}, got {got}"
        await h.collector.close()

    async def test_a_reread_after_a_crash_makes_the_same_events(
        self, tmp_path: Path, executor: concurrent.futures.Executor
    ) -> None:
        """Killed after the read and before the store: the next process reads the records
        again and makes events with the same ids (consumers deduplicate on them)."""
        device = FakeKmsg.with_records(capture_records())
        device.write(xid_line(79, PCI))
        device.write("I/O error, dev sdb, sector 2048 op 0x1:(WRITE) flags 0x800", level=3)
        h = KmsgHarness(tmp_path, device, executor)
        before = await h.collect()
        h.state = MemoryKeyValueStore()  # the cursor never reached the disk
        h.collector = h.build()
        after = await h.collect()
        assert sorted(e.kind for e in before) == ["io_error", "xid"]
        assert sorted(e.id for e in before) == sorted(e.id for e in after)

    async def test_a_followed_file_line_reread_keeps_its_id(
        self, tmp_path: Path, executor: concurrent.futures.Executor
    ) -> None:
        log = tmp_path / "kern.log"
        log.write_text(f"[ 10.0] {xid_line(31, PCI)}\n[ 11.0] {xid_line(31, GPUS[1])}\n")
        ids = []
        for _ in range(2):
            state = MemoryKeyValueStore()
            settings = KernelLogSettings(path=log)
            deps = CollectorDeps("node", tmp_path, state, SharedServices(), lambda e: None)
            collector = KernelLogCollector(settings, deps)
            ctx = CollectContext(PooledCaller(executor, 5.0), time.time(), 0)
            events = (await collector.collect(ctx)).events
            assert state.get(STATE_NAMESPACE, FILE_CURSOR_KEY) is not None
            ids.append(sorted(e.id for e in events))
            await collector.close()
        assert len(ids[0]) == 2
        assert ids[0] == ids[1]
