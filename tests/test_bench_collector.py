"""The benchmark collector: idle gating, scheduling, events and metrics, with a fake NVML."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pynvml
import pytest
import structlog.testing

from agent.contracts.collector import CollectorDeps, SharedServices
from agent.contracts.errors import ConfigError
from agent.contracts.model import Event, Severity
from agent.program import config_file as config_module
from collectors._nvml import NvmlBackend
from collectors.benchmark.child import PLANT_WRONG_RESULT_ENV
from collectors.benchmark.collector import BenchmarkCollector, BenchmarkSettings
from collectors.benchmark.gpus import GpuBackendUnavailable, NvmlActivity
from collectors.benchmark.history import HISTORY_FILE
from collectors.benchmark.runner import ChildRunner
from tests.support.bench import (
    RECORD_CHILD,
    FakeGpuActivity,
    context,
    cpu_plan,
    deps,
    fake_child,
    gpu,
    record,
    series,
)
from tests.support.nvml_fake import FakeGpu, FakeNvml, FakeUtilization
from tests.support.stores import StateOnDisk

T0 = float(int(time.time()))  # the fake child stamps its records with the real clock


@pytest.fixture(autouse=True)
def _now() -> None:
    """T0 is now, at each test: taken once at import, it fell behind the fake child's real
    clock by as long as the tests collected before these ran (a minute of Slurm tests made
    a record look older than its period, and a round skip its run)."""
    global T0  # noqa: PLW0603
    T0 = float(int(time.time()))


MINUTE = 60.0


class CountingRunner(ChildRunner):
    def __init__(self, command: list[str], **kwargs: Any) -> None:
        super().__init__(command, **kwargs)
        self.arguments: list[list[str]] = []
        self.envs: list[dict[str, str]] = []

    async def run(self, arguments: Any, extra_env: Any = None) -> Any:
        self.arguments.append(list(arguments))
        self.envs.append(dict(extra_env or {}))
        return await super().run(arguments, extra_env)


def make(
    tmp_path: Path,
    activity: FakeGpuActivity,
    *,
    env: dict[str, str] | None = None,
    body: str = RECORD_CHILD,
    **settings: Any,
) -> tuple[BenchmarkCollector, CountingRunner]:
    runner = CountingRunner(fake_child(tmp_path, "child", body), timeout=30, env=env)
    collector = BenchmarkCollector(
        BenchmarkSettings(**settings), deps(tmp_path / "state"), activity=activity, runner=runner
    )
    return collector, runner


class TestNoGpu:
    """A host without GPUs says so once and never starts a child."""

    async def test_no_backend(self, tmp_path: Path) -> None:
        collector, runner = make(tmp_path, FakeGpuActivity(available=False))
        for i in range(3):
            result = await collector.collect(context(T0 + i * MINUTE, i))
            assert series(result.samples, "gpuwarden_benchmark_gpus") == [0]
        assert runner.arguments == []

    async def test_said_once(self, tmp_path: Path) -> None:
        collector, _ = make(tmp_path, FakeGpuActivity(available=False))
        with structlog.testing.capture_logs() as logs:
            for i in range(3):
                await collector.collect(context(T0 + i * MINUTE, i))
        said = [entry for entry in logs if entry["event"].startswith("no GPU")]
        assert len(said) == 1
        assert "driver not loaded" in said[0]["reason"]

    async def test_backend_with_zero_gpus(self, tmp_path: Path) -> None:
        collector, runner = make(tmp_path, FakeGpuActivity(devices=[]), when="always")
        result = await collector.collect(context(T0))
        assert series(result.samples, "gpuwarden_benchmark_gpus") == [0]
        assert runner.arguments == []


class TestIdleGate:
    """A due GPU runs only after idle_rounds quiet rounds; busy rounds are counted skips."""

    async def test_waits_for_idle_rounds(self, tmp_path: Path) -> None:
        collector, runner = make(tmp_path, FakeGpuActivity(), idle_rounds=3)
        for i in range(2):
            result = await collector.collect(context(T0 + i * MINUTE, i))
            assert series(result.samples, "gpuwarden_benchmark_skips_total", reason="settling") == [
                i + 1
            ]
        assert runner.arguments == []
        await collector.collect(context(T0 + 2 * MINUTE, 2))
        assert len(runner.arguments) == 1

    async def test_compute_process_blocks_and_resets(self, tmp_path: Path) -> None:
        activity = FakeGpuActivity(processes={0: 1})
        collector, runner = make(tmp_path, activity, idle_rounds=2)
        result = await collector.collect(context(T0))
        result = await collector.collect(context(T0 + MINUTE))
        assert series(
            result.samples, "gpuwarden_benchmark_skips_total", reason="busy_processes"
        ) == [2]
        assert series(result.samples, "gpuwarden_benchmark_gpu_idle") == [0]
        activity.processes[0] = 0
        await collector.collect(context(T0 + 2 * MINUTE))
        assert runner.arguments == []  # one quiet round is not enough
        activity.utilization[0] = 80.0  # a spike resets the window
        result = await collector.collect(context(T0 + 3 * MINUTE))
        assert series(
            result.samples, "gpuwarden_benchmark_skips_total", reason="busy_utilization"
        ) == [1]
        activity.utilization[0] = 2.0
        await collector.collect(context(T0 + 4 * MINUTE))
        assert runner.arguments == []
        await collector.collect(context(T0 + 5 * MINUTE))
        assert len(runner.arguments) == 1

    async def test_unknown_activity_is_not_idle(self, tmp_path: Path) -> None:
        collector, runner = make(tmp_path, FakeGpuActivity(processes={0: None}), idle_rounds=1)
        result = await collector.collect(context(T0))
        assert runner.arguments == []
        assert series(
            result.samples, "gpuwarden_benchmark_skips_total", reason="activity_unknown"
        ) == [1]

    async def test_always_runs_on_a_busy_gpu(self, tmp_path: Path) -> None:
        activity = FakeGpuActivity(processes={0: 3}, utilization={0: 100.0})
        collector, runner = make(tmp_path, activity, when="always")
        await collector.collect(context(T0))
        assert len(runner.arguments) == 1


class TestSchedule:
    """One GPU per round, each once per period, the child pinned to its GPU by UUID."""

    async def test_one_gpu_per_round_then_wait_for_the_period(self, tmp_path: Path) -> None:
        activity = FakeGpuActivity(devices=[gpu(0), gpu(1)])
        collector, runner = make(tmp_path, activity, when="always", period=3600.0)
        for i in range(4):
            await collector.collect(context(T0 + i * MINUTE, i))
        assert len(runner.arguments) == 2
        assert [env["CUDA_VISIBLE_DEVICES"] for env in runner.envs] == [gpu(0).uuid, gpu(1).uuid]
        assert all(args[args.index("--device") + 1] == "cuda:0" for args in runner.arguments)
        await collector.collect(context(T0 + 3700.0, 5))
        assert len(runner.arguments) == 3

    async def test_settings_reach_the_child(self, tmp_path: Path) -> None:
        collector, runner = make(
            tmp_path,
            FakeGpuActivity(),
            when="always",
            profile="bf16",
            iterations=7,
            min_window_seconds=1.5,
        )
        await collector.collect(context(T0))
        args = runner.arguments[0]
        assert args[args.index("--profile") + 1] == "bf16"
        assert args[args.index("--size") + 1] == "8192"
        assert args[args.index("--iterations") + 1] == "7"
        assert args[args.index("--min-window") + 1] == "1.5"


class TestRecords:
    """A run becomes a history line with the GPU's identity, and metrics."""

    async def test_history_line_and_metrics(self, tmp_path: Path) -> None:
        collector, _ = make(tmp_path, FakeGpuActivity(), env={"FAKE_TFLOPS": "49.5"}, when="always")
        result = await collector.collect(context(T0))
        lines = (tmp_path / "state" / HISTORY_FILE).read_text().splitlines()
        assert len(lines) == 1
        saved = json.loads(lines[0])
        assert saved["gpu_uuid"] == gpu(0).uuid
        assert saved["gpu_name"] == "NVIDIA H200"  # NVML's name, not the child's
        assert saved["driver_version"] == "580.159.04"
        assert saved["source"] == "agent"
        labels = {"uuid": gpu(0).uuid, "pci_bus_id": "0000:10:00.0", "model": "NVIDIA H200"}
        assert series(
            result.samples, "gpuwarden_benchmark_flops_per_second", profile="fp32", **labels
        ) == [pytest.approx(49.5e12)]
        assert series(result.samples, "gpuwarden_benchmark_correct") == [1]
        assert series(result.samples, "gpuwarden_benchmark_runs_total") == [1]
        assert series(result.samples, "gpuwarden_benchmark_baseline_ratio") == []
        assert len(series(result.samples, "gpuwarden_benchmark_last_run_timestamp_seconds")) == 1

    async def test_child_on_another_gpu_is_rejected(self, tmp_path: Path) -> None:
        collector, _ = make(
            tmp_path,
            FakeGpuActivity(),
            when="always",
            env={"FAKE_SEEN_UUID": "GPU-ffffffff-0000-0000-0000-000000000000"},
        )
        result = await collector.collect(context(T0))
        assert [e.kind for e in result.events] == ["benchmark_failed"]
        assert result.events[0].attributes["reason"] == "wrong_device"
        assert not (tmp_path / "state" / HISTORY_FILE).exists()

    async def test_same_uuid_without_prefix_is_accepted(self, tmp_path: Path) -> None:
        bare = gpu(0).uuid.removeprefix("GPU-").upper()
        collector, _ = make(
            tmp_path, FakeGpuActivity(), when="always", env={"FAKE_SEEN_UUID": bare}
        )
        result = await collector.collect(context(T0))
        assert result.events == []
        assert series(result.samples, "gpuwarden_benchmark_correct") == [1]


class TestEvents:
    """Failures once per cause, wrong answers always critical, regressions as states."""

    async def test_failure_once_per_cause_then_recovery(self, tmp_path: Path) -> None:
        crash = "import sys\nsys.stderr.write('boom\\n')\nsys.exit(9)\n"
        collector, runner = make(
            tmp_path, FakeGpuActivity(), when="always", period=60.0, body=crash
        )
        first = await collector.collect(context(T0))
        assert [e.kind for e in first.events] == ["benchmark_failed"]
        event = first.events[0]
        assert event.severity is Severity.WARNING
        assert event.subject == gpu(0).uuid
        assert "crashed" in event.message
        assert "boom" in str(event.attributes["stderr_tail"])
        second = await collector.collect(context(T0 + 120))
        assert second.events == []
        assert series(second.samples, "gpuwarden_benchmark_failures_total", reason="crash") == [2]
        runner.command = fake_child(tmp_path, "fixed", RECORD_CHILD)
        third = await collector.collect(context(T0 + 240))
        assert [e.kind for e in third.events] == ["benchmark_recovered"]

    async def test_wrong_result_from_the_real_child_is_critical(self, tmp_path: Path) -> None:
        runner = ChildRunner(timeout=120, env={PLANT_WRONG_RESULT_ENV: "1"})
        settings = BenchmarkSettings(
            when="always", size=128, iterations=1, warmup=0, samples=1, min_window_seconds=0.0
        )
        collector = BenchmarkCollector(
            settings,
            deps(tmp_path / "state"),
            activity=FakeGpuActivity(),
            runner=runner,
            device_plan=cpu_plan,
        )
        result = await collector.collect(context(T0))
        assert [e.kind for e in result.events] == ["benchmark_wrong_result"]
        event = result.events[0]
        assert event.severity is Severity.CRITICAL
        assert "silent data corruption" in event.message
        assert series(result.samples, "gpuwarden_benchmark_wrong_results_total") == [1]
        assert series(result.samples, "gpuwarden_benchmark_correct") == [0]
        assert series(result.samples, "gpuwarden_benchmark_flops_per_second") == []
        saved = json.loads((tmp_path / "state" / HISTORY_FILE).read_text())
        assert saved["correct"] is False

    async def test_regression_after_two_slow_runs_and_clearing(self, tmp_path: Path) -> None:
        state = tmp_path / "state"
        state.mkdir()
        with (state / HISTORY_FILE).open("w") as f:
            for i in range(3):
                f.write(
                    record(
                        50.0, T0 - 10 * 3600 + i, uuid=gpu(0).uuid, torch="2.11.0", window=0.5
                    ).to_json()
                    + "\n"
                )
        env: dict[str, str] = {"FAKE_TFLOPS": "40"}
        collector, runner = make(tmp_path, FakeGpuActivity(), env=env, when="always", period=60.0)
        kinds = []
        for i, tflops in enumerate(["40", "41", "42", "50"]):
            runner.env["FAKE_TFLOPS"] = tflops
            result = await collector.collect(context(T0 + i * 120))
            kinds.append([e.kind for e in result.events])
        assert kinds == [[], ["benchmark_regression"], [], ["benchmark_regression_cleared"]]

    async def test_peer_slow(self, tmp_path: Path) -> None:
        activity = FakeGpuActivity(devices=[gpu(0), gpu(1), gpu(2)])
        collector, runner = make(tmp_path, activity, when="always", period=3600.0)
        events: list[Event] = []
        for i, tflops in enumerate(["50", "51", "40"]):
            runner.env["FAKE_TFLOPS"] = tflops
            result = await collector.collect(context(T0 + i * MINUTE))
            events += result.events
        assert [(e.kind, e.subject) for e in events] == [("benchmark_peer_slow", gpu(2).uuid)]
        assert "0.79" in events[0].message
        assert series(result.samples, "gpuwarden_benchmark_peer_ratio", uuid=gpu(2).uuid) == [
            pytest.approx(40 / 50.5)
        ]


class TestStateStoreFull:
    """A disk that refuses the state store's writes costs neither the run's round nor its
    schedule; the bookkeeping is stored once there is room."""

    async def test_failed_run_is_reported_once_and_not_rerun_before_its_period(
        self, tmp_path: Path, state_on_disk: StateOnDisk
    ) -> None:
        crash = "import sys\nsys.exit(9)\n"
        state_on_disk.fill()
        runner = CountingRunner(fake_child(tmp_path, "child", crash), timeout=30)
        collector = BenchmarkCollector(
            BenchmarkSettings(when="always", period=3600.0),
            CollectorDeps(
                "test-node",
                tmp_path / "state",
                state_on_disk.state,
                SharedServices(),
                lambda _e: None,
            ),
            activity=FakeGpuActivity(),
            runner=runner,
        )
        first = await collector.collect(context(T0))
        assert not state_on_disk.end_round()
        second = await collector.collect(context(T0 + MINUTE, 1))
        assert not state_on_disk.end_round()
        assert [e.kind for e in first.events] == ["benchmark_failed"]
        assert series(first.samples, "gpuwarden_benchmark_failures_total", reason="crash") == [1]
        assert second.events == []
        assert len(runner.arguments) == 1  # the unsaved last attempt is remembered in memory
        again = await collector.collect(context(T0 + 3700.0, 2))
        assert not state_on_disk.end_round()
        assert again.events == []  # the same cause: said once
        assert state_on_disk.store.items("benchmark") == {}
        state_on_disk.disk.free()
        runner.command = fake_child(tmp_path, "fixed", RECORD_CHILD)
        fixed = await collector.collect(context(T0 + 7400.0, 3))
        assert state_on_disk.end_round()
        assert [e.kind for e in fixed.events] == ["benchmark_recovered"]
        assert state_on_disk.store.items("benchmark") == {
            f"last_attempt:{gpu(0).uuid}": pytest.approx(T0 + 7400.0, abs=60)
        }


class TestSettings:
    """Settings are validated where they are read, with the key named."""

    def test_size_outside_profile(self) -> None:
        with pytest.raises(ConfigError, match="size"):
            config_module.parse({"collectors": {"benchmark": {"size": 8192}}})

    def test_tensor_profile_allows_large_sizes(self) -> None:
        cfg = config_module.parse({"collectors": {"benchmark": {"profile": "bf16", "size": 16384}}})
        assert cfg.collector("benchmark").enabled

    def test_child_timeout_must_fit_the_round(self) -> None:
        with pytest.raises(ConfigError, match="child_timeout"):
            config_module.parse({"collectors": {"benchmark": {"interval": 10.0}}})

    def test_defaults(self) -> None:
        settings = config_module.parse({}).collector("benchmark")
        assert isinstance(settings, BenchmarkSettings)
        assert settings.period == 21600.0
        assert settings.when == "idle"
        assert settings.request("cuda:0").size == 2048


class TestNvmlAdapter:
    """NvmlActivity reads the shared NVML backend (driven here by its fake pynvml)."""

    def test_identities_processes_and_utilization(self) -> None:
        fake = FakeNvml([FakeGpu.h200(0), FakeGpu.h200(1, processes=2)])
        fake.gpus[0].utilization = FakeUtilization(37, 5)
        activity = NvmlActivity(NvmlBackend(fake))
        gpus = activity.gpus()
        assert [g.index for g in gpus] == [0, 1]
        assert gpus[1].uuid.startswith("GPU-")
        assert activity.compute_process_count(0) == 0
        assert activity.compute_process_count(1) == 2
        assert activity.utilization_percent(0) == pytest.approx(37.0)
        assert activity.driver_version() == "580.159.04"

    def test_lost_gpu_and_unsupported_read_as_unknown(self) -> None:
        fake = FakeNvml([FakeGpu.h200(0), FakeGpu.h200(1)])
        activity = NvmlActivity(NvmlBackend(fake))
        activity.gpus()
        fake.gpus[0].lost = True
        fake.gpus[1].utilization = None
        assert activity.compute_process_count(0) is None
        assert activity.utilization_percent(1) is None

    async def test_no_driver_means_no_gpu_and_no_child(self, tmp_path: Path) -> None:
        fake = FakeNvml([FakeGpu.h200(0)], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        activity = NvmlActivity(NvmlBackend(fake))
        with pytest.raises(GpuBackendUnavailable):
            activity.gpus()
        runner = CountingRunner(fake_child(tmp_path, "child", RECORD_CHILD), timeout=30)
        collector = BenchmarkCollector(
            BenchmarkSettings(when="always"), deps(tmp_path / "s"), activity=activity, runner=runner
        )
        result = await collector.collect(context(T0))
        assert series(result.samples, "gpuwarden_benchmark_gpus") == [0]
        assert runner.arguments == []

    async def test_gate_over_the_fake_backend(self, tmp_path: Path) -> None:
        fake = FakeNvml([FakeGpu.h200(0, processes=1)])
        activity = NvmlActivity(NvmlBackend(fake))
        runner = CountingRunner(fake_child(tmp_path, "child", RECORD_CHILD), timeout=30)
        collector = BenchmarkCollector(
            BenchmarkSettings(idle_rounds=1), deps(tmp_path / "s"), activity=activity, runner=runner
        )
        result = await collector.collect(context(T0))
        assert series(
            result.samples, "gpuwarden_benchmark_skips_total", reason="busy_processes"
        ) == [1]
        fake.gpus[0].processes = 0
        await collector.collect(context(T0 + MINUTE))
        assert len(runner.arguments) == 1
        assert runner.envs[0]["CUDA_VISIBLE_DEVICES"] == fake.gpus[0].uuid
