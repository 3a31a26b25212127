"""Releasing the GPUs on request (`gpuwarden pause`), against the fake NVML.

The class under test: while paused, nothing in the agent calls NVML (whoever asks, through
whatever backend method), the event thread has ended, NVML is shut down and its device files
are closed, and the GPU collectors give no GPU series; after resume, everything is read
afresh and a GPU that did not come back is reported lost. And a pause always ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pynvml
import pytest

from agent.contracts.collector import SharedServices
from agent.contracts.model import Event
from agent.contracts.pause import PausableCollector
from agent.program.diagnose.check import CheckOptions, CheckReport, run_check
from agent.program.diagnose.findings import Status
from agent.runtime.state import StateStore
from collectors._nvml import NvmlBackend, NvmlPaused
from collectors._procfs import open_files, read_boot_id
from collectors.benchmark.collector import BenchmarkCollector, BenchmarkSettings
from collectors.benchmark.runner import ChildRunner
from collectors.gpu.collector import GpuSettings
from collectors.gpu.events import GpuEventThread
from tests.support.bench import FakeGpuActivity, context, cpu_plan, deps, fake_child
from tests.support.diag import load, make_proc_tree, write_config
from tests.support.nvml import GpuRig, fake_gpus, kinds, value
from tests.support.nvml_fake import FakeNvml
from tests.support.waiting import until


def nvml_calls(fake: FakeNvml) -> int:
    return sum(fake.lib_calls.values())


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[GpuRig]:
    devices = tmp_path / "dev"
    devices.mkdir()
    fake = FakeNvml(fake_gpus(2), device_dir=devices)
    settings = GpuSettings(event_thread=True, event_wait_ms=50)
    rig = GpuRig(fake, settings=settings)
    rig.backend.device_prefix = f"{devices}/"
    yield rig
    await rig.close()


def is_running(thread: GpuEventThread) -> bool:
    return thread.running


def is_held(activity: FakeGpuActivity) -> bool:
    return activity.held


def held_files(rig: GpuRig) -> list[str]:
    return open_files(Path("/proc"), "self", rig.backend.device_prefix)


class TestPauseReleasesNvml:
    async def test_shutdown_thread_joined_no_device_file_no_call(self, rig: GpuRig) -> None:
        await rig.collect()
        await rig.collect()  # the event thread starts once the GPUs are known
        thread = rig.collector.events_thread
        assert thread is not None and thread.running
        assert rig.fake.initialised == 1 and len(held_files(rig)) == 3

        released = await rig.collector.pause()

        assert released.released, released.detail
        assert "no NVIDIA device file open" in released.detail
        assert rig.collector.events_thread is None
        assert not is_running(thread)  # joined, not only asked to stop
        assert rig.fake.initialised == 0
        assert rig.fake.event_sets_open == 0
        assert held_files(rig) == []
        before = nvml_calls(rig.fake)
        for _ in range(3):
            result = await rig.collect()
            assert not result.samples and not result.events
        assert nvml_calls(rig.fake) == before  # not one call, not even nvmlInit

    async def test_device_files_left_open_are_reported(self, rig: GpuRig, tmp_path: Path) -> None:
        """The check is real: a device file the process still holds makes the pause say so."""
        await rig.collect()
        stray = open(Path(rig.backend.device_prefix) / "nvidia-uvm", "w")  # noqa: SIM115
        try:
            released = await rig.collector.pause()
        finally:
            stray.close()
        assert not released.released
        assert "nvidia-uvm" in released.detail

    async def test_a_round_in_flight_ends_before_the_shutdown(self, rig: GpuRig) -> None:
        """NVML is never shut down under a call: pause waits for the round that is running."""
        await rig.collect()
        calls = rig.fake.gpus[0].calls
        before = calls.total()
        gate = threading.Event()
        rig.fake.gpus[0].hang = gate
        round_task = asyncio.ensure_future(rig.collect())
        await until(lambda: calls.total() > before)  # the round's first call, hung
        pause_task = asyncio.ensure_future(rig.collector.pause())
        await asyncio.sleep(0.2)
        assert not pause_task.done() and rig.fake.initialised == 1
        gate.set()
        rig.fake.gpus[0].hang = None
        await round_task
        assert (await pause_task).released
        assert rig.fake.initialised == 0

    async def test_a_call_that_never_returns_is_not_shut_under(self, tmp_path: Path) -> None:
        gate = threading.Event()
        rig = GpuRig(FakeNvml(fake_gpus(1)), settings=GpuSettings(timeout=0.2), timeout=0.2)
        try:
            await rig.collect()
            rig.fake.gpus[0].hang = gate
            await rig.collect()  # the call times out and stays in the driver
            released = await rig.collector.pause()
            assert not released.released
            assert "has not returned" in released.detail
            assert rig.fake.initialised == 1  # not shut down under the hung call
            before = nvml_calls(rig.fake)
            await rig.collect()
            assert nvml_calls(rig.fake) == before  # held all the same: no new call
        finally:
            gate.set()
            await rig.close()


class TestResume:
    async def test_fresh_values_and_the_event_thread_again(self, rig: GpuRig) -> None:
        await rig.collect()
        await rig.collect()
        before = next(
            s for s in (await rig.collect()).samples if s.family.name == "gpuwarden_gpu_info"
        )
        assert before.labels["vbios_version"] == "96.00.A5.00.1A"
        await rig.collector.pause()
        # What a reset or a MIG change may change, changed while paused.
        rig.fake.gpus[0].vbios_version = "96.00.A5.00.FF"
        rig.fake.gpus[0].temperature = 71
        inits = rig.fake.init_calls
        await rig.collector.resume()
        result = await rig.collect()
        assert rig.fake.init_calls == inits + 1
        assert value(result, "gpuwarden_gpu_temperature_celsius", gpu="0", sensor="gpu") == 71
        infos = [s for s in result.samples if s.family.name == "gpuwarden_gpu_info"]
        assert {s.labels["vbios_version"] for s in infos if s.labels["gpu"] == "0"} == {
            "96.00.A5.00.FF"
        }  # the static facts are read again, not kept from before the pause
        assert value(result, "gpuwarden_gpu_up", gpu="1") == 1
        assert rig.fake.gpus[0].calls["nvmlDeviceGetVbiosVersion"] >= 2
        thread = rig.collector.events_thread
        assert thread is not None and thread.running
        assert held_files(rig) != []

    async def test_a_gpu_that_did_not_come_back_is_lost(self, rig: GpuRig) -> None:
        await rig.collect()
        gone = rig.fake.gpus[1]
        await rig.collector.pause()
        rig.fake.gpus.remove(gone)  # the reset failed: the driver no longer lists it
        await rig.collector.resume()
        result = await rig.collect()
        lost = [e for e in result.events if e.kind == "gpu_lost"]
        assert [e.subject for e in lost] == [gone.uuid]
        assert lost[0].attributes["after_pause"] is True
        assert "gpu_count_dropped" in kinds(result)
        assert kinds(await rig.collect()).count("gpu_lost") == 0  # said once

    async def test_a_gpu_lost_at_its_index_is_reported_once(self, rig: GpuRig) -> None:
        await rig.collect()
        await rig.collector.pause()
        rig.fake.gpus[1].lost = True  # still listed, but fallen off the bus
        await rig.collector.resume()
        result = await rig.collect()
        assert kinds(result).count("gpu_lost") == 1
        assert value(result, "gpuwarden_gpu_up", gpu="1") == 0

    async def test_all_back_raises_no_loss(self, rig: GpuRig) -> None:
        await rig.collect()
        await rig.collector.pause()
        await rig.collector.resume()
        result = await rig.collect()
        assert "gpu_lost" not in kinds(result)
        assert "nvml_unavailable" not in kinds(result)
        assert value(result, "gpuwarden_gpus_visible") == 2


# Every backend method that reaches the library, with arguments that would work unpaused.
BACKEND_CALLS: dict[str, Callable[[NvmlBackend], Any]] = {
    "start": lambda b: b.start(),
    "ensure_started": lambda b: b.ensure_started(),
    "device_count": lambda b: b.device_count(),
    "driver_version": lambda b: b.driver_version(),
    "identity": lambda b: b.identity(0),
    "gpus": lambda b: b.gpus(),
    "compute_process_count": lambda b: b.compute_process_count(0),
    "utilization": lambda b: b.utilization(0),
    "read_gpu": lambda b: b.read_gpu(0, True, True, True, True),
    "event_set_create": lambda b: b.event_set_create(),
    "register_events": lambda b: b.register_events(0, 8, object()),
    "wait_event": lambda b: b.wait_event(object(), 10),
}


class TestHeldBackend:
    @pytest.mark.parametrize("call", sorted(BACKEND_CALLS))
    def test_every_method_refuses_without_a_library_call(self, call: str) -> None:
        fake = FakeNvml(fake_gpus(1))
        backend = NvmlBackend(fake)
        backend.start()
        assert backend.hold("test", 1.0)
        before = nvml_calls(fake)
        with pytest.raises(NvmlPaused):
            BACKEND_CALLS[call](backend)
        assert nvml_calls(fake) == before
        backend.release()
        BACKEND_CALLS["start"](backend)
        assert fake.initialised == 1

    def test_every_public_method_is_in_the_table(self) -> None:
        """A new backend method must be added above (and so be held by a pause)."""
        lifecycle = {"stop", "hold", "release", "held", "up", "event_set_free", "lib"}
        public = {n for n in dir(NvmlBackend) if not n.startswith("_") and n not in lifecycle}
        assert public == set(BACKEND_CALLS)


class TestBenchmarkPause:
    async def test_a_running_child_is_killed_and_not_counted(self, tmp_path: Path) -> None:
        child = fake_child(tmp_path, "slow", "import time\ntime.sleep(60)\n")
        activity = FakeGpuActivity()
        emitted: list[Event] = []
        collector = BenchmarkCollector(
            BenchmarkSettings(when="always", child_timeout=30.0),
            deps(tmp_path / "state", emitted),
            activity=activity,
            device_plan=cpu_plan,
            runner=ChildRunner(child, timeout=30.0),
        )
        round_task = asyncio.ensure_future(collector.collect(context()))
        await until(lambda: collector.runner._running is not None, timeout=10.0)
        pid = collector.runner._running.pid  # type: ignore[union-attr]
        released = await asyncio.wait_for(collector.pause(), 10.0)
        assert released.released and "killed" in released.detail
        result = await asyncio.wait_for(round_task, 10.0)
        assert (
            not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
        )
        assert result.events == [] and emitted == []  # a pause is not a failure of the GPU
        assert collector.gpus[activity.devices[0].uuid].failures == {}
        assert activity.held
        calls = activity.calls
        for _ in range(3):
            assert not (await collector.collect(context())).samples
        assert activity.calls == calls
        await collector.resume()
        assert not is_held(activity) and not collector.runner.stopped

    async def test_both_gpu_collectors_are_pausable(self, rig: GpuRig, tmp_path: Path) -> None:
        bench = BenchmarkCollector(
            BenchmarkSettings(), deps(tmp_path / "state"), activity=FakeGpuActivity()
        )
        assert isinstance(rig.collector, PausableCollector)
        assert isinstance(bench, PausableCollector)


def test_settings_refuse_a_default_above_the_maximum() -> None:
    from agent.contracts.errors import ConfigError
    from agent.contracts.pause import PauseSettings

    with pytest.raises(ConfigError, match="default_duration"):
        PauseSettings(default_duration=100.0, max_duration=50.0)
    assert dataclasses.replace(PauseSettings(), max_duration=1800.0).max_duration == 1800.0


class TestAcrossARestart:
    async def test_a_restarted_agent_paused_at_once_still_finds_the_gpu_that_is_gone(
        self, rig: GpuRig
    ) -> None:
        """The pause outlived the agent: the new collector read nothing before it, and
        compares with the GPUs the last one stored this boot."""
        await rig.collect()
        await rig.restart()
        await rig.collector.pause()  # before its first round, as the runtime does
        gone = rig.fake.gpus.pop()
        await rig.collector.resume()
        result = await rig.collect()
        assert [e.subject for e in result.events if e.kind == "gpu_lost"] == [gone.uuid]


class TestGpm:
    async def test_gpm_samples_are_freed_and_taken_afresh(self, tmp_path: Path) -> None:
        gpus = fake_gpus(2)
        for gpu in gpus:
            gpu.gpm = {pynvml.NVML_GPM_METRIC_SM_UTIL: 50.0}
        rig = GpuRig(FakeNvml(gpus), settings=GpuSettings(gpm_interval=1.0))
        try:
            await rig.collect()
            await rig.collect()
            assert rig.fake.gpm_samples_live > 0
            await rig.collector.pause()
            assert rig.fake.gpm_samples_live == 0  # nothing of NVML's kept across the pause
            await rig.collector.resume()
            first = await rig.collect()
            # One sample after the pause is no span yet: absent, not the old reading.
            assert value(first, "gpuwarden_gpu_activity_ratio", gpu="0", metric="sm_active") is None
            second = await rig.collect()
            assert value(second, "gpuwarden_gpu_activity_ratio", gpu="0", metric="sm_active") == 0.5
        finally:
            await rig.close()


class TestCheckHonoursThePause:
    """`gpuwarden check` (Slurm's HealthCheckProgram, say) opens nothing of the GPUs while the
    running agent has them paused: it would make the reset under way fail."""

    @staticmethod
    async def check(tmp_path: Path, until: float, boot: str) -> tuple[CheckReport, FakeNvml]:
        cfg = load(write_config(tmp_path, proc_root=make_proc_tree(tmp_path / "proc")))
        store = StateStore.open(cfg.state_dir)
        store.put(
            "runtime",
            "gpu_pause",
            {"since": 1.0, "until": until, "reason": "reset GPU 3", "by": "root", "boot": boot},
        )
        store.close()
        fake = FakeNvml(fake_gpus(2))
        shared = SharedServices()
        shared.put(NvmlBackend, NvmlBackend(fake))
        options = CheckOptions(torch=True, bench=True, process_gap=0.05)
        return await run_check(cfg, options, shared=shared), fake

    async def test_paused_no_gpu_is_opened(self, tmp_path: Path) -> None:
        report, fake = await self.check(tmp_path, time.time() + 600, read_boot_id(Path("/proc")))
        assert nvml_calls(fake) == 0
        (gpu,) = [f for f in report.findings if f.area == "gpu"]
        assert gpu.status is Status.SKIP and "reset GPU 3" in gpu.detail
        assert report.torch_probe is None
        bench = [f for f in report.findings if f.area == "bench"]
        assert bench and all("paused" in f.detail for f in bench)

    @pytest.mark.parametrize("case", ["past its deadline", "an earlier boot"])
    async def test_an_ended_pause_is_not_honoured(self, tmp_path: Path, case: str) -> None:
        boot = read_boot_id(Path("/proc"))
        until = time.time() + 600
        if case == "past its deadline":
            until = time.time() - 1
        else:
            boot = "another-boot"
        report, fake = await self.check(tmp_path, until, boot)
        assert nvml_calls(fake) > 0
        assert not [
            f
            for f in report.findings
            if f.status is Status.SKIP and "paused" in f.detail and f.area == "gpu"
        ]
