"""Collectors across reloads with their calls hung: one gpu_unresponsive per hung GPU, with its
UUID (kept per boot in the state store, for a GPU that hangs before this collector read it),
and one mount_stuck per dead mount."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from agent.contracts.collector import CollectorDeps, CollectorSpec, MemoryKeyValueStore
from agent.contracts.model import Event
from agent.contracts.settings import build
from agent.runtime.core import Runtime
from collectors._nvml import NvmlBackend
from collectors.disk.collector import DiskCollector, DiskSettings
from collectors.gpu.collector import GpuSettings
from tests.support.host import HangingStatvfs, ProcTree
from tests.support.nvml import GpuRig, fake_gpus, kinds, value
from tests.support.nvml_fake import FakeNvml
from tests.support.waiting import until
from tests.test_reload_hangs import kind_of, reload_with, runtime_for


def gpu_runtime(fake: FakeNvml, settings: GpuSettings) -> Runtime:
    runtime = runtime_for({"gpu": settings})
    runtime.shared.put(NvmlBackend, NvmlBackend(fake))
    return runtime


class TestHungGpusAcrossReloads:
    """The measured defect: 4 GPUs hung, 6 reloads: +4 threads a reload and 28
    gpu_unresponsive events, the later ones with the index as subject."""

    @pytest.mark.parametrize("slow_start", [False, True], ids=["", "slow-first-round"])
    async def test_six_reloads(self, slow_start: bool) -> None:
        fake = FakeNvml(fake_gpus(4))
        release = threading.Event()
        settings = GpuSettings(interval=0.05, timeout=0.2, event_thread=False)
        runtime = gpu_runtime(fake, settings)
        late = threading.Event()
        if slow_start:  # as on a loaded machine: two GPUs answer the first round too late
            fake.gpus[0].hang = fake.gpus[1].hang = late
        await runtime.start()
        try:
            if slow_start:
                await until(lambda: runtime.hung_calls() == 2, what="the first round to hang")
                fake.gpus[0].hang = fake.gpus[1].hang = None
                late.set()
            await until(lambda: runtime.collectors["gpu"].rounds_done >= 2, what="GPU rounds")

            # A first (full) round slower than the 0.2 s timeout on a loaded machine reports its
            # GPUs unresponsive, then recovered: those events are not this test's. They are
            # announced after the round's samples are seen (stored first): every GPU up is not
            # enough, the recoveries must have cleared what the timeouts raised.
            def all_answer() -> bool:
                samples = runtime.collectors["gpu"].samples
                up = [s.value for s in samples if s.family.name == "gpuwarden_gpu_up"]
                return runtime.hung_calls() == 0 and up == [1.0] * 4 and runtime.repairs() == []

            await until(all_answer, what="every GPU to answer")
            await asyncio.sleep(0.05)  # a call_recovered from a worker thread, then announced
            assert await runtime.settle()  # in order: the first round's raises, then clears
            assert runtime.repairs() == []
            early = {e.id for e in runtime.recent_events}

            def fresh(kind: str) -> list[Event]:
                return [e for e in kind_of(runtime, kind) if e.id not in early]

            for gpu in fake.gpus:
                gpu.hang = release
            await until(lambda: runtime.hung_calls() == 4, what="the GPUs to hang")
            await until(lambda: len(fresh("gpu_unresponsive")) == 4, what="events")
            pool = runtime.collectors["gpu"].executor
            threads = threading.active_count()
            for i in range(6):
                await reload_with(runtime, "gpu", settings.replace(interval=0.05 + i / 100))
            assert runtime.collectors["gpu"].executor is pool
            # At most one more: a new instance reads the GPU count first, and the pool may
            # add a worker for it beside the four hung ones (before the fix: +4 a reload).
            assert threading.active_count() <= threads + 1
            assert runtime.hung_calls() == 4
            hung = [
                s for s in runtime.samples() if s.family.name == "gpuwarden_collector_hung_calls"
            ]
            assert [(s.label_values, s.value) for s in hung] == [(("gpu",), 4.0)]
            uuids = sorted(gpu.uuid for gpu in fake.gpus)
            unresponsive = fresh("gpu_unresponsive")
            assert sorted(e.subject for e in unresponsive) == uuids
            assert len(fresh("call_hung")) == 4
            # The series keep their identity labels through the reloads.
            samples = runtime.collectors["gpu"].samples
            up = {s.labels["uuid"]: s.value for s in samples if s.family.name == "gpuwarden_gpu_up"}
            assert up == dict.fromkeys(uuids, 0.0)
            for gpu in fake.gpus:
                gpu.hang = None
            release.set()
            await until(lambda: len(fresh("gpu_recovered")) == 4, what="recovery")
            assert sorted(e.subject for e in fresh("gpu_recovered")) == uuids
            assert len(fresh("gpu_unresponsive")) == 4
        finally:
            release.set()
            late.set()
            await runtime.stop()


class TestGpuIdentityFromState:
    """A GPU that hangs before this collector read it is named by the UUID an earlier round
    (an earlier process, this boot) stored; never read at all, the event says so."""

    async def test_restart_names_the_hung_gpu_by_its_uuid(self) -> None:
        state = MemoryKeyValueStore()
        fake = FakeNvml(fake_gpus(2))
        first = GpuRig(fake, state=state, timeout=0.2)
        release = threading.Event()
        try:
            await first.collect()
        finally:
            await first.close()
        fake.gpus[1].hang = release
        second = GpuRig(fake, state=state, timeout=0.2)  # a new process: new pool, new caller
        try:
            result = await second.collect()
            (event,) = result.events
            assert event.kind == "gpu_unresponsive"
            assert event.subject == fake.gpus[1].uuid
            assert value(result, "gpuwarden_gpu_up", uuid=fake.gpus[1].uuid) == 0
        finally:
            release.set()
            await second.close()

    async def test_never_read_says_so(self) -> None:
        fake = FakeNvml(fake_gpus(2))
        release = threading.Event()
        fake.gpus[1].hang = release
        rig = GpuRig(fake, timeout=0.2)
        try:
            result = await rig.collect()
            assert kinds(result) == ["gpu_unresponsive"]
            event = result.events[0]
            assert event.subject == "1"
            assert "never read" in event.message
            assert event.attributes["uuid"] == ""
        finally:
            release.set()
            await rig.close()

    async def test_another_gpu_count_is_not_trusted(self) -> None:
        """Indexes are renumbered when the GPU set changes: a stored identity of index 1 with
        three GPUs says nothing of index 1 with two."""
        state = MemoryKeyValueStore()
        first = GpuRig(FakeNvml(fake_gpus(3)), state=state, timeout=0.2)
        try:
            await first.collect()
        finally:
            await first.close()
        fake = FakeNvml(fake_gpus(2))
        release = threading.Event()
        fake.gpus[1].hang = release
        second = GpuRig(fake, state=state, timeout=0.2)
        try:
            result = await second.collect()
            unresponsive = [e for e in result.events if e.kind == "gpu_unresponsive"]
            assert [e.subject for e in unresponsive] == ["1"]
        finally:
            release.set()
            await second.close()


class TestStuckMountAcrossReloads:
    async def test_one_mount_stuck_event(self, tmp_path: Path) -> None:
        tree = ProcTree(tmp_path / "proc")
        tree.set_mountinfo(
            "27 1 259:2 / / rw - ext4 /dev/sda1 rw\n"
            "30 27 0:45 / /mnt/nfs rw - nfs4 storage01:/export rw,hard\n"
        )
        statvfs = HangingStatvfs(hanging={"/mnt/nfs"}, answer=lambda path: os.statvfs("/"))

        def make(settings: DiskSettings, deps: CollectorDeps) -> DiskCollector:
            return DiskCollector(settings, deps, statvfs)

        settings = build(
            DiskSettings, {"proc_root": str(tree.root), "interval": 0.05, "timeout": 0.2}
        )
        spec: CollectorSpec[Any] = CollectorSpec("disk", "test", DiskSettings, make)
        runtime = runtime_for({"disk": settings}, disk=spec)
        await runtime.start()
        try:
            await until(lambda: runtime.hung_calls() == 1, what="statvfs to hang")
            threads = threading.active_count()
            for i in range(6):
                await reload_with(runtime, "disk", settings.replace(interval=0.05 + i / 100))
            assert statvfs.calls.count("/mnt/nfs") == 1
            # The pool may add one worker for the healthy mount's statvfs beside the hung one
            # (before the fix: one more hung thread a reload).
            assert threading.active_count() <= threads + 1
            assert len(kind_of(runtime, "mount_stuck")) == 1
            statvfs.release.set()
            await until(lambda: len(kind_of(runtime, "mount_recovered")) == 1, what="recovery")
        finally:
            statvfs.release.set()
            await runtime.stop()
