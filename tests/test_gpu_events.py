"""The NVML event thread over the fake library: registration, Xids to the correlator, ECC events."""

from __future__ import annotations

import time
from collections.abc import Mapping

import pynvml

from agent.contracts.model import Event, Severity
from collectors._nvml import EVENT_XID, NvmlBackend
from collectors._xid import XidCorrelator, XidObservation, XidSource
from collectors.gpu.collector import GpuSettings
from collectors.gpu.events import WANTED_EVENTS, GpuEventThread
from tests.support.nvml import GpuRig, fake_gpus, kinds
from tests.support.nvml_fake import FakeGpu, FakeNvml

LABELS = {"gpu": "0", "uuid": "GPU-x", "pci_bus_id": "0000:18:00.0", "model": "NVIDIA H200"}


def wait_for(condition: object, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(condition) and condition():
            return True
        time.sleep(0.01)
    return False


def make_thread(
    fake: FakeNvml, correlator: XidCorrelator, emitted: list[Event], masks: list[int | None]
) -> GpuEventThread:
    backend = NvmlBackend(fake)
    backend.start()
    return GpuEventThread(
        backend,
        correlator,
        emitted.append,
        list(enumerate(masks)),
        lambda: {"0000:18:00.0": LABELS},
        wait_ms=50,
    )


class TestEventThread:
    """Start, register only supported types, deliver, stop cleanly."""

    def test_start_stop_frees_the_event_set(self) -> None:
        fake = FakeNvml(fake_gpus(2))
        thread = make_thread(fake, XidCorrelator(), [], [0xFF9F, 0xFF9F])
        thread.start()
        assert thread.ready.wait(5)
        assert thread.running
        assert thread.registered == {0: WANTED_EVENTS, 1: WANTED_EVENTS}
        assert thread.stop()  # True: the thread has ended
        assert fake.event_sets_open == 0

    def test_only_supported_types_are_registered(self) -> None:
        fake = FakeNvml([FakeGpu.h200(0, supported_events=EVENT_XID), FakeGpu.h200(1)])
        thread = make_thread(fake, XidCorrelator(), [], [EVENT_XID, 0])
        thread.start()
        try:
            assert thread.ready.wait(5)
            assert thread.registered == {0: EVENT_XID}
            assert fake.gpus[0].registered_events == EVENT_XID
        finally:
            thread.stop()

    def test_no_supported_gpu_ends_the_thread(self) -> None:
        fake = FakeNvml(fake_gpus(1))
        thread = make_thread(fake, XidCorrelator(), [], [0])
        thread.start()
        assert thread.ready.wait(5)
        assert wait_for(lambda: not thread.running)
        assert "no GPU supports" in thread.error
        assert fake.event_sets_open == 0

    def test_xid_reaches_the_correlator(self) -> None:
        fake = FakeNvml(fake_gpus(1))
        built: list[tuple[XidObservation, frozenset[XidSource], Mapping[str, str]]] = []

        def build(
            obs: XidObservation, sources: frozenset[XidSource], labels: Mapping[str, str]
        ) -> Event:
            built.append((obs, sources, labels))
            return Event(source="xid", kind="xid", severity=Severity.CRITICAL, message="xid")

        correlator = XidCorrelator(window=0.0, build_event=build)
        thread = make_thread(fake, correlator, [], [0xFF9F])
        thread.start()
        try:
            assert thread.ready.wait(5)
            fake.push_event(fake.gpus[0], pynvml.nvmlEventTypeXidCriticalError, 79)
            assert wait_for(lambda: bool(built))
        finally:
            thread.stop()
        obs, sources, _ = built[0]
        assert obs.code == 79
        assert obs.pci_bus_id == "0000:18:00.0"  # NVML's 00000000:18:00.0, normalised
        assert sources == frozenset({"nvml"})

    def test_ecc_events_are_emitted(self) -> None:
        fake = FakeNvml(fake_gpus(1))
        emitted: list[Event] = []
        thread = make_thread(fake, XidCorrelator(), emitted, [0xFF9F])
        thread.start()
        try:
            assert thread.ready.wait(5)
            fake.push_event(fake.gpus[0], pynvml.nvmlEventTypeDoubleBitEccError)
            assert wait_for(lambda: bool(emitted))
        finally:
            thread.stop()
        assert emitted[0].kind == "ecc_double_bit_event"
        assert emitted[0].severity is Severity.CRITICAL
        assert emitted[0].subject == "GPU-x"

    def test_unregistered_types_are_not_delivered(self) -> None:
        fake = FakeNvml([FakeGpu.h200(0, supported_events=EVENT_XID)])
        emitted: list[Event] = []
        thread = make_thread(fake, XidCorrelator(), emitted, [EVENT_XID])
        thread.start()
        try:
            assert thread.ready.wait(5)
            fake.push_event(fake.gpus[0], pynvml.nvmlEventTypeSingleBitEccError)
            fake.push_event(fake.gpus[0], pynvml.nvmlEventTypeDoubleBitEccError)
            time.sleep(0.2)
        finally:
            thread.stop()
        assert emitted == []


class TestCollectorRunsTheThread:
    """The collector starts the thread once GPUs are known and drains the correlator."""

    async def test_xid_event_is_emitted_by_the_thread(self) -> None:
        rig = GpuRig(FakeNvml(fake_gpus(1)), settings=GpuSettings(event_wait_ms=50))

        def build(
            obs: XidObservation, sources: frozenset[XidSource], labels: Mapping[str, str]
        ) -> Event:
            return Event(
                source="xid",
                kind=f"xid_{obs.code}",
                severity=Severity.CRITICAL,
                message="xid",
                subject=labels.get("uuid", ""),
            )

        rig.correlator.set_builder(build)
        rig.correlator.window = 0.0
        try:
            first = await rig.collect()
            assert [
                s.value for s in first.samples if s.family.name == "gpuwarden_gpu_event_thread_up"
            ] == [1.0]
            thread = rig.collector.events_thread
            assert thread is not None
            assert thread.ready.wait(5)
            rig.fake.push_event(rig.fake.gpus[0], pynvml.nvmlEventTypeXidCriticalError, 48)
            # Raised by the event thread at once, through emit: no round needed.
            assert wait_for(lambda: bool(rig.emitted))
            assert [e.kind for e in rig.emitted] == ["xid_48"]
            assert rig.emitted[0].subject == rig.fake.gpus[0].uuid
            result = await rig.collect()
            assert "xid_48" not in kinds(result)
        finally:
            await rig.close()
        assert thread is not None
        assert wait_for(lambda: not thread.running)


class _BreakingEmit(list[Event]):
    """An emit target that raises while `broken`, like a handler with a bug."""

    broken = False

    def append(self, event: Event) -> None:
        if self.broken:
            raise RuntimeError("emit is broken")
        super().append(event)


class TestDeadThreadRestarts:
    """A dead event thread is reported once, then restarted at most once per retry interval."""

    async def test_dead_thread_is_reported_and_restarted(self) -> None:
        emitted = _BreakingEmit()
        rig = GpuRig(
            FakeNvml(fake_gpus(1)),
            emitted=emitted,
            settings=GpuSettings(event_wait_ms=50, nvml_retry_interval=60.0),
        )
        try:
            await rig.collect()
            first = rig.collector.events_thread
            assert first is not None
            assert first.ready.wait(5)
            emitted.broken = True
            rig.fake.push_event(rig.fake.gpus[0], pynvml.nvmlEventTypeDoubleBitEccError)
            assert wait_for(lambda: not first.running)
            emitted.broken = False
            died = await rig.collect()
            assert kinds(died) == ["nvml_event_thread_stopped"]
            assert died.events[0].severity is Severity.WARNING
            assert "emit is broken" in str(died.events[0].attributes["reason"])
            assert rig.collector.events_thread is first  # within the backoff: not yet
            assert kinds(await rig.collect()) == []  # reported once
            rig.now += 60.0
            restarted = await rig.collect()
            assert kinds(restarted) == []
            second = rig.collector.events_thread
            assert second is not None and second is not first
            assert [
                s.value
                for s in restarted.samples
                if s.family.name == "gpuwarden_gpu_event_thread_up"
            ] == [1.0]
            assert second.ready.wait(5)
            rig.fake.push_event(rig.fake.gpus[0], pynvml.nvmlEventTypeDoubleBitEccError)
            assert wait_for(lambda: "ecc_double_bit_event" in kinds(emitted))
        finally:
            await rig.close()
