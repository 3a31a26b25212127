"""Benchmark: a periodic matmul test per GPU, in a child process, only while the GPU is idle.

Every round (the collector's interval, a minute by default) samples each GPU's compute processes
and utilization; a GPU whose benchmark is due (`period`, six hours by default) is tested when it
has had no compute process and low utilization for `idle_rounds` rounds in a row (`when = "idle"`),
or at once (`when = "always"`). At most one GPU is tested per round, one at a time, so tests never
overlap and a round stays well inside the runtime's bound; none starts while a child killed
earlier (a reload, a pause, a timeout) is still alive, stuck in the driver (runner.LiveChildren).

The test runs in `python -m collectors.benchmark.child` (collectors/benchmark/runner.py starts it): the
daemon never imports torch and never holds a CUDA context. Its record joins the history
(collectors/benchmark/history.py), is judged against the GPU's baseline and its same-model peers, and
becomes samples and events: a wrong answer is critical (possible silent data corruption), a slow
GPU a warning, a test that could not run a warning once per cause.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import structlog

from agent.contracts.collector import (
    CollectContext,
    CollectorDeps,
    CollectorSettings,
    CollectorSpec,
    KeyValueStore,
)
from agent.contracts.errors import CallStillHung, CallTimedOut, ConfigError
from agent.contracts.model import GPU_LABELS, Collection, Event, MetricFamily, MetricType, Sample
from agent.contracts.pause import Released
from agent.contracts.settings import setting
from collectors._nvml import NvmlBackend
from collectors.benchmark import events as bench_events
from collectors.benchmark.gpus import GpuActivity, GpuBackendUnavailable, GpuIdentity, NvmlActivity
from collectors.benchmark.history import (
    BaselinePolicy,
    BenchmarkRecord,
    HistoryFile,
    RecordError,
    judge,
)
from collectors.benchmark.request import PROFILES, Request, child_arguments
from collectors.benchmark.runner import ChildOutcome, ChildRunner, LiveChildren, default_command

log = structlog.get_logger(component="benchmark")

SOURCE: Final = "benchmark"
KV: Final = "benchmark"
G, C = MetricType.GAUGE, MetricType.COUNTER
_P = (*GPU_LABELS, "profile")

GPUS = MetricFamily("gpuwarden_benchmark_gpus", G, "GPUs the benchmark collector found")
FLOPS = MetricFamily(
    "gpuwarden_benchmark_flops_per_second",
    G,
    "Matmul throughput of the last correct benchmark run, FLOP/s",
    _P,
)
BASELINE_RATIO = MetricFamily(
    "gpuwarden_benchmark_baseline_ratio",
    G,
    "Last run's throughput over the GPU's baseline (median of its last good comparable runs)",
    _P,
)
PEER_RATIO = MetricFamily(
    "gpuwarden_benchmark_peer_ratio",
    G,
    "Last run's throughput over the median of same-model GPUs on the node",
    _P,
)
WINDOW = MetricFamily(
    "gpuwarden_benchmark_window_seconds",
    G,
    "Median timed window of the last run (iterations x one matmul)",
    _P,
)
RUN_SECONDS = MetricFamily(
    "gpuwarden_benchmark_run_seconds",
    G,
    "Wall time of the last benchmark child process",
    GPU_LABELS,
)
LAST_RUN = MetricFamily(
    "gpuwarden_benchmark_last_run_timestamp_seconds",
    G,
    "When the last benchmark run on the GPU ended",
    GPU_LABELS,
)
LAST_SUCCESS = MetricFamily(
    "gpuwarden_benchmark_last_success_timestamp_seconds",
    G,
    "When the last benchmark run with a result ended",
    GPU_LABELS,
)
CORRECT = MetricFamily(
    "gpuwarden_benchmark_correct",
    G,
    "1 if the last run's product matched the float64 reference, 0 if not",
    GPU_LABELS,
)
IDLE = MetricFamily(
    "gpuwarden_benchmark_gpu_idle",
    G,
    "1 while the GPU counts as idle for the benchmark's gate",
    GPU_LABELS,
)
RUNS = MetricFamily("gpuwarden_benchmark_runs_total", C, "Benchmark runs started", GPU_LABELS)
FAILURES = MetricFamily(
    "gpuwarden_benchmark_failures_total",
    C,
    "Benchmark runs that gave no result, by reason",
    (*GPU_LABELS, "reason"),
)
WRONG = MetricFamily(
    "gpuwarden_benchmark_wrong_results_total",
    C,
    "Benchmark runs whose product was wrong",
    GPU_LABELS,
)
SKIPS = MetricFamily(
    "gpuwarden_benchmark_skips_total",
    C,
    "Rounds in which a due benchmark was not run, by reason",
    (*GPU_LABELS, "reason"),
)
UNSAVED = MetricFamily(
    "gpuwarden_benchmark_history_unsaved_records",
    G,
    "Benchmark records kept in memory that the history file in state_dir has not taken "
    "(full disk, read-only, failing or hung state dir); written when it takes them again",
)
BAD_LINES = MetricFamily(
    "gpuwarden_benchmark_history_bad_lines",
    G,
    "Lines of the history file in state_dir that are not records (cut short by a crash or a "
    "full disk, garbage): skipped, the records around them kept",
)

CLOSE_SAVE_SECONDS: Final = 1.0
"""How long a close waits for its last write of the history (the runtime bounds a close at
1.5 s at a stop)."""

Profile = Literal["fp32", "tf32", "bf16", "fp16"]
When = Literal["idle", "always"]
DevicePlan = Callable[[GpuIdentity], tuple[str, dict[str, str]]]


@dataclass(frozen=True)
class BenchmarkSettings(CollectorSettings):
    interval: float = setting(
        60.0,
        minimum=1.0,
        maximum=86400.0,
        help="seconds between rounds: idle sampling, and a run when due",
    )
    period: float = setting(
        21600.0,
        minimum=60.0,
        maximum=30 * 86400.0,
        help="seconds between benchmark runs of one GPU",
    )
    when: When = setting(
        "idle",
        help='"idle": only on a GPU with no compute process and low '
        'utilization for idle_rounds rounds; "always": when due',
    )
    idle_utilization_percent: float = setting(
        5.0, minimum=0.0, maximum=100.0, help="utilization at or under this counts as idle"
    )
    idle_rounds: int = setting(
        3, minimum=1, maximum=1000, help="consecutive idle rounds before a GPU may be tested"
    )
    profile: Profile = setting(
        "fp32",
        help="fp32 (fp32 highest, the benchmark record's), tf32, bf16 or fp16 (tensor cores)",
    )
    size: int = setting(
        0,
        minimum=0,
        maximum=16384,
        help="matrix side; 0: the profile's (fp32 2048, tf32 4096, bf16/fp16 8192)",
    )
    iterations: int = setting(
        20,
        minimum=1,
        maximum=100000,
        help="matmuls per timed window, at least (see min_window_seconds)",
    )
    warmup: int = setting(5, minimum=0, maximum=1000, help="untimed matmuls first")
    samples: int = setting(5, minimum=1, maximum=100, help="timed windows; the median counts")
    min_window_seconds: float = setting(
        0.5,
        minimum=0.0,
        maximum=60.0,
        help="iterations grow until a window lasts this long "
        "(short bursts read faster than sustained work)",
    )
    child_timeout: float = setting(
        90.0, minimum=5.0, maximum=3600.0, help="seconds before the child's process group is killed"
    )
    python: str = setting(
        "", help="Python with torch for the child; empty: the agent's own", path=True
    )
    baseline_runs: int = setting(
        5, minimum=1, maximum=100, help="baseline = median of this many last good runs"
    )
    baseline_min_runs: int = setting(
        3, minimum=1, maximum=100, help="good runs needed before a baseline exists"
    )
    regression_ratio: float = setting(
        0.90, exclusive_minimum=0.0, maximum=1.0, help="under this fraction of the baseline is slow"
    )
    regression_runs: int = setting(
        2, minimum=1, maximum=100, help="consecutive slow runs before a regression event"
    )
    peer_ratio: float = setting(
        0.90,
        exclusive_minimum=0.0,
        maximum=1.0,
        help="under this fraction of same-model peers' median is slow",
    )

    def __post_init__(self) -> None:
        profile = PROFILES[self.profile]
        if self.size and not profile.min_size <= self.size <= profile.max_size:
            raise ConfigError(
                "size",
                f"{self.size} is outside {profile.min_size}-"
                f"{profile.max_size} for the {self.profile} profile",
            )
        # The runtime's supervisor calls a collector stalled (and withholds the systemd
        # watchdog ping) when no round ends within 3 x interval + 5 s; between two round ends
        # lie one interval and one round. A round holds the child, up to 20 s to reap it and
        # read its pipes, and a few NVML calls: child_timeout must leave room for all that.
        allowance = 3 * max(self.interval, self.timeout) + 5
        longest_round = self.child_timeout + 25
        if max(self.interval, self.timeout) + longest_round > allowance:
            raise ConfigError(
                "child_timeout",
                f"{self.child_timeout:g} s does not fit in a "
                f"round: it must be at most 2 x interval - 20 s "
                f"({2 * max(self.interval, self.timeout) - 20:g} s here); raise "
                "interval or lower child_timeout",
            )

    def request(self, device: str) -> Request:
        profile = PROFILES[self.profile]
        return Request(
            device,
            profile,
            self.size or profile.default_size,
            self.iterations,
            self.warmup,
            self.samples,
            self.min_window_seconds,
        )

    def policy(self) -> BaselinePolicy:
        return BaselinePolicy(
            runs=self.baseline_runs,
            min_runs=self.baseline_min_runs,
            regression_ratio=self.regression_ratio,
            regression_runs=self.regression_runs,
            peer_ratio=self.peer_ratio,
            peer_max_age_seconds=max(3 * self.period, 86400.0),
        )


def cuda_device_plan(gpu: GpuIdentity) -> tuple[str, dict[str, str]]:
    """Pin the child to the GPU by UUID: CUDA numbers devices fastest-first by default, not in
    NVML's PCI order, and the child then creates a context on that one GPU only."""
    return "cuda:0", {"CUDA_VISIBLE_DEVICES": gpu.uuid}


@dataclass(frozen=True)
class RunResult:
    gpu: GpuIdentity
    record: BenchmarkRecord | None
    """None when the test gave no result (see outcome.failure)."""
    outcome: ChildOutcome
    events: Sequence[Event]


@dataclass
class GpuState:
    quiet: collections.deque[bool] = field(default_factory=collections.deque)
    busy_reason: str = "settling"
    last: BenchmarkRecord | None = None
    last_run: float | None = None
    last_success: float | None = None
    run_seconds: float | None = None
    runs: int = 0
    wrong: int = 0
    failures: collections.Counter[str] = field(default_factory=collections.Counter)
    skips: collections.Counter[str] = field(default_factory=collections.Counter)


@dataclass
class _ProcessBench:
    """What the benchmark collectors of one process share (the runtime's SharedServices): a
    reload makes the collector again, and an instance that began empty lost what the one it
    replaced held.

    - `gpus`: each GPU's `GpuState`. The runs, failures and skips are the agent's counts and
      the last run and success its record; an empty instance lowered every counter and
      dropped the last run's and last success's times until the next run (a `period`
      later), which hid a failing GPU from GpuwardenBenchmarkFailing and paged
      GpuwardenBenchmarkStale for an idle one.
    - the history file of each state dir (`history_at`): the records that wait for a full or
      read-only disk (`HistoryFile.unsaved`) were gone with the instance, the agent running
      on.
    """

    gpus: dict[str, GpuState] = field(default_factory=dict)
    histories: dict[Path, HistoryFile] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def history_at(self, state_dir: Path) -> HistoryFile:
        with self.lock:
            found = self.histories.get(state_dir)
            if found is None:
                found = self.histories[state_dir] = HistoryFile.in_state_dir(state_dir)
            return found


class BenchmarkCollector:
    name = SOURCE

    def __init__(
        self,
        settings: BenchmarkSettings,
        deps: CollectorDeps,
        *,
        activity: GpuActivity | None = None,
        runner: ChildRunner | None = None,
        device_plan: DevicePlan = cuda_device_plan,
        source: str = "agent",
    ) -> None:
        self.settings = settings
        self.deps = deps
        self.activity: GpuActivity = activity or NvmlActivity(
            deps.shared.get(NvmlBackend, NvmlBackend)
        )
        self.runner = runner or ChildRunner(
            default_command(settings.python),
            settings.child_timeout,
            children=deps.shared.get(LiveChildren, LiveChildren),
        )
        self._alive_logged: list[int] = []
        """The earlier children still alive that the log has named (said once)."""
        self.device_plan = device_plan
        self.source = source
        self.policy = settings.policy()
        process = deps.shared.get(_ProcessBench, _ProcessBench)
        self.history = process.history_at(deps.state_dir)
        self._history_error: str | None = None
        """Why the history file failed last (logged once per outage), None while it works."""
        self._bad_lines_said = 0
        """The count of unreadable history lines the log has told (said again when it moves)."""
        self.gpus = process.gpus
        self._no_gpu_logged = False
        self.state: KeyValueStore = deps.state
        """Never raises: what a full disk refuses the runtime keeps (this process still sees
        it: no second failure event, no new run every round) and writes later."""
        self.paused = False
        """Released on request (agent/contracts/pause.py): no NVML call, no child."""
        self._round_lock = asyncio.Lock()

    def families(self) -> Sequence[MetricFamily]:
        return (
            GPUS,
            UNSAVED,
            BAD_LINES,
            FLOPS,
            BASELINE_RATIO,
            PEER_RATIO,
            WINDOW,
            RUN_SECONDS,
            LAST_RUN,
            LAST_SUCCESS,
            CORRECT,
            IDLE,
            RUNS,
            FAILURES,
            WRONG,
            SKIPS,
        )

    async def close(self) -> None:
        """One more write of the records that wait (bounded: the runtime gives a close
        1.5 s, and a hung state dir must not take them); what still waits is said, with the
        file: after a reload the next instance writes it, after a stop it is lost."""
        if not self.history.unsaved:
            return
        try:
            await asyncio.wait_for(asyncio.to_thread(self.history.save), CLOSE_SAVE_SECONDS)
        except (OSError, TimeoutError) as exc:
            error = str(exc) or type(exc).__name__
        else:
            error = self._history_error or ""
        if self.history.unsaved:
            log.warning(
                "benchmark history not written at close: records wait in memory (a reload "
                "writes them later; they are lost if the agent stops now)",
                path=str(self.history.path),
                unsaved=len(self.history.unsaved),
                error=error,
            )

    # -- pause and resume (agent/contracts/pause.py) -------------------------------------------

    async def pause(self) -> Released:
        """No child from now on; a running one is killed (the operator wants the GPU now, and
        its run counts for nothing), then the round ends and the backend is let go."""
        self.paused = True
        killed = await self.runner.stop_children()
        async with self._round_lock:
            wait = self.settings.timeout + 1.0
            if not await asyncio.to_thread(self.activity.hold, wait):
                return Released(
                    self.name, False, f"an NVML call has not returned within {wait:g} s"
                )
        alive = self.runner.children.alive()
        if alive:  # killed (now, or by a reload or a timeout before) and stuck in the driver
            pids = ", ".join(map(str, alive))
            return Released(
                self.name,
                False,
                f"benchmark child {pids} is still alive after its SIGKILL (stuck in the "
                "driver?) and may hold its GPU",
            )
        if killed:
            return Released(self.name, True, "the running benchmark child was killed")
        return Released(self.name, True, "no benchmark child was running; none starts")

    async def resume(self) -> None:
        async with self._round_lock:
            self.activity.release()
            self.runner.allow()
            self.paused = False

    # -- one round ----------------------------------------------------------------------------

    async def collect(self, ctx: CollectContext) -> Collection:
        async with self._round_lock:
            if self.paused:
                return Collection()
            return await self._collect(ctx)

    async def _collect(self, ctx: CollectContext) -> Collection:
        reason = "NVML lists no GPU"
        try:
            gpus = await ctx.call("benchmark:gpus", self.activity.gpus)
        except GpuBackendUnavailable as exc:
            gpus, reason = [], str(exc)
        if not gpus:
            if not self._no_gpu_logged:  # said once: a host without GPUs is not an error
                log.info("no GPU: the benchmark has nothing to test", reason=reason)
                self._no_gpu_logged = True
            return Collection(samples=[GPUS.sample(0)])
        await self._sync_history(ctx)
        for gpu in gpus:
            await self._observe(ctx, gpu)
        chosen: GpuIdentity | None = None
        earlier = self._earlier_child_alive()
        for gpu in sorted(gpus, key=lambda g: self._last_attempt(g) or 0.0):
            if not self._due(gpu, ctx.now):
                continue
            reason = "previous_child_alive" if earlier else self._blocked(gpu)
            if reason:
                self._state(gpu).skips[reason] += 1
            elif chosen is None:
                chosen = gpu
        events = list((await self.benchmark(ctx, chosen, gpus)).events) if chosen else []
        return Collection(samples=self._samples(gpus), events=events)

    async def _sync_history(self, ctx: CollectContext) -> None:
        """Write the records that wait and read others' lines (`gpuwarden bench`). A history
        that fails or hangs leaves the one in memory as it is: said once per outage, and in
        gpuwarden_benchmark_history_unsaved_records. While a call hangs it is not asked
        again (CallStillHung at once), so the round never waits on the state dir twice."""
        try:
            written = await ctx.call("benchmark:history", self.history.sync)
        except (OSError, CallTimedOut, CallStillHung) as exc:
            error = type(exc).__name__ if isinstance(exc, CallStillHung) else str(exc)
            if self._history_error is None:
                log.warning(
                    "benchmark history not written: records wait in memory",
                    path=str(self.history.path),
                    error=error,
                    unsaved=len(self.history.unsaved),
                )
            self._history_error = self._history_error or error
            return
        self._say_bad_lines()
        if self._history_error is not None:
            log.info(
                "benchmark history written again",
                path=str(self.history.path),
                written=written,
                unsaved=len(self.history.unsaved),
            )
            self._history_error = None

    def _say_bad_lines(self) -> None:
        """Lines of the history that are not records: skipped (the rest are read), said once
        for each count, with the first few line numbers and why."""
        bad = self.history.bad_lines
        if len(bad) == self._bad_lines_said:
            return
        self._bad_lines_said = len(bad)
        if bad:
            log.warning(
                "benchmark history: unreadable lines skipped, the other records read",
                path=str(self.history.path),
                bad_lines=len(bad),
                first=[f"line {number}: {reason}" for number, reason in bad[:3]],
            )

    def _state(self, gpu: GpuIdentity) -> GpuState:
        state = self.gpus.get(gpu.uuid)
        if state is None:
            state = self.gpus[gpu.uuid] = GpuState(
                collections.deque(maxlen=self.settings.idle_rounds)
            )
            mine = [r for r in self.history.records if r.gpu_uuid == gpu.uuid]
            state.last = mine[-1] if mine else None
        elif state.quiet.maxlen != self.settings.idle_rounds:  # an earlier instance's
            state.quiet = collections.deque(state.quiet, maxlen=self.settings.idle_rounds)
        return state

    async def _observe(self, ctx: CollectContext, gpu: GpuIdentity) -> None:
        """One idle sample: no compute process now, and utilization at or under the limit."""
        state = self._state(gpu)
        key = f"benchmark:gpu{gpu.index}"
        try:
            processes = await ctx.call(key, self.activity.compute_process_count, gpu.index)
            utilization = await ctx.call(key, self.activity.utilization_percent, gpu.index)
        except (CallTimedOut, CallStillHung, GpuBackendUnavailable) as exc:
            log.warning("cannot read GPU activity", gpu=gpu.index, error=str(exc))
            processes = utilization = None
        if processes is None or utilization is None:
            state.quiet.clear()
            state.busy_reason = "activity_unknown"
        elif processes > 0:
            state.quiet.clear()
            state.busy_reason = "busy_processes"
        elif utilization > self.settings.idle_utilization_percent:
            state.quiet.clear()
            state.busy_reason = "busy_utilization"
        else:
            state.quiet.append(True)
            state.busy_reason = "settling"

    def _earlier_child_alive(self) -> bool:
        """A child killed earlier (by a reload, a pause, its timeout) that has not died: no
        run starts beside it (two tests on one GPU, or a second one stuck in the driver)."""
        pids = self.runner.children.alive()
        if pids and pids != self._alive_logged:
            log.warning(
                "an earlier benchmark child is still alive after its kill (stuck in the "
                "driver?): no benchmark runs until it is gone",
                pids=pids,
            )
        self._alive_logged = pids
        return bool(pids)

    def _idle(self, gpu: GpuIdentity) -> bool:
        quiet = self._state(gpu).quiet
        return len(quiet) == self.settings.idle_rounds and all(quiet)

    def _blocked(self, gpu: GpuIdentity) -> str:
        if self.settings.when == "always" or self._idle(gpu):
            return ""
        return self._state(gpu).busy_reason

    def _last_attempt(self, gpu: GpuIdentity) -> float | None:
        stored = self.state.get(KV, f"last_attempt:{gpu.uuid}")
        times = [r.time for r in self.history.records if r.gpu_uuid == gpu.uuid]
        candidates = [float(stored)] if isinstance(stored, (int, float)) else []
        candidates += times[-1:]
        return max(candidates) if candidates else None

    def _due(self, gpu: GpuIdentity, now: float) -> bool:
        last = self._last_attempt(gpu)
        return last is None or now - last >= self.settings.period

    # -- a run --------------------------------------------------------------------------------

    async def benchmark(
        self, ctx: CollectContext, gpu: GpuIdentity, gpus: Sequence[GpuIdentity]
    ) -> RunResult:
        """Run the test on `gpu` now (also used by `gpuwarden bench`)."""
        state = self._state(gpu)
        device, env = self.device_plan(gpu)
        driver = await ctx.call("benchmark:driver", self.activity.driver_version)
        state.runs += 1
        try:
            outcome = await self.runner.run(child_arguments(self.settings.request(device)), env)
        except asyncio.CancelledError:
            # Cut short by a reload that restarts this collector, or by a stop: its child is
            # killed, and like one a pause kills it is no run of the GPU's (the instance a
            # reload makes runs it again when due, at once: no attempt was stored).
            state.runs -= 1
            raise
        if self.runner.stopped:
            # Killed by a pause: not a failure of the GPU, not an attempt (it runs when due
            # after the pause), no record.
            state.runs -= 1
            return RunResult(gpu, None, outcome, ())
        finished = ctx.now + outcome.wall_seconds
        self.state.put(KV, f"last_attempt:{gpu.uuid}", finished)
        state.last_run, state.run_seconds = finished, outcome.wall_seconds
        record, outcome = self._record(gpu, driver or "", outcome)
        if record is None:
            state.failures[outcome.failure] += 1
            return RunResult(gpu, None, outcome, self._failure_events(gpu, outcome))
        await self._sync_history(ctx)
        record = judge(self.history.records, record, self.policy)
        # Kept first: a state dir that refuses or hangs loses neither the result nor its
        # events; the record waits, and a later round writes it.
        self.history.keep(record)
        await self._sync_history(ctx)
        state.last, state.last_success = record, finished
        if record.correct is False:
            state.wrong += 1
        events = self._recovery_events(gpu)
        events += bench_events.judge_events(
            self.state, self.history.records, record, gpu=gpu, gpus=gpus, policy=self.policy
        )
        return RunResult(gpu, record, outcome, events)

    def _record(
        self, gpu: GpuIdentity, driver: str, outcome: ChildOutcome
    ) -> tuple[BenchmarkRecord | None, ChildOutcome]:
        if outcome.record is None:
            return None, outcome
        data: dict[str, Any] = dict(outcome.record)
        seen = str(data.get("gpu_uuid") or "")
        if seen and _bare_uuid(seen) != _bare_uuid(gpu.uuid):
            return None, _failed(outcome, "wrong_device", f"asked for {gpu.uuid}, ran on {seen}")
        if data.get("device") != "cpu":
            data.update(gpu_index=gpu.index, gpu_uuid=gpu.uuid, gpu_name=gpu.name)
        else:
            data.update(gpu_uuid=data.get("gpu_uuid") or gpu.uuid)
        data.update(driver_version=driver, source=self.source)
        try:
            return BenchmarkRecord.from_dict(data), outcome
        except RecordError as exc:
            return None, _failed(outcome, "bad_output", f"record rejected: {exc}")

    def _failure_events(self, gpu: GpuIdentity, outcome: ChildOutcome) -> list[Event]:
        key = f"failure:{gpu.uuid}"
        if self.state.get(KV, key) == outcome.failure:
            return []  # the same cause again: said once, counted in the metric
        self.state.put(KV, key, outcome.failure)
        return [bench_events.failure_event(gpu, outcome)]

    def _recovery_events(self, gpu: GpuIdentity) -> list[Event]:
        key = f"failure:{gpu.uuid}"
        previous = self.state.get(KV, key)
        if previous is None:
            return []
        self.state.delete(KV, key)
        return [bench_events.recovered_event(gpu, str(previous))]

    # -- samples ------------------------------------------------------------------------------

    def _samples(self, gpus: Sequence[GpuIdentity]) -> list[Sample]:
        samples = [
            GPUS.sample(len(gpus)),
            UNSAVED.sample(len(self.history.unsaved)),
            BAD_LINES.sample(len(self.history.bad_lines)),
        ]
        for gpu in gpus:
            state, labels = self._state(gpu), gpu.labels()
            samples.append(IDLE.sample_map(1 if self._idle(gpu) else 0, labels))
            samples.append(RUNS.sample_map(state.runs, labels))
            samples.append(WRONG.sample_map(state.wrong, labels))
            for reason, count in sorted(state.failures.items()):
                samples.append(FAILURES.sample_map(count, {**labels, "reason": reason}))
            for reason, count in sorted(state.skips.items()):
                samples.append(SKIPS.sample_map(count, {**labels, "reason": reason}))
            for family, value in (
                (RUN_SECONDS, state.run_seconds),
                (LAST_RUN, state.last_run),
                (LAST_SUCCESS, state.last_success),
            ):
                if value is not None:
                    samples.append(family.sample_map(value, labels))
            samples.extend(_record_samples(state.last, labels))
        return samples


def _record_samples(record: BenchmarkRecord | None, labels: dict[str, str]) -> list[Sample]:
    if record is None:
        return []
    out: list[Sample] = []
    if record.correct is not None:
        out.append(CORRECT.sample_map(1 if record.correct else 0, labels))
    with_profile = {**labels, "profile": record.profile}
    out.append(WINDOW.sample_map(record.median_seconds, with_profile))
    if record.correct is not False:
        out.append(FLOPS.sample_map(record.estimated_tflops * 1e12, with_profile))
    for family, ratio in ((BASELINE_RATIO, record.baseline_ratio), (PEER_RATIO, record.peer_ratio)):
        if ratio is not None:
            out.append(family.sample_map(ratio, with_profile))
    return out


def _bare_uuid(text: str) -> str:
    text = text.strip().lower()
    return text[4:] if text.startswith("gpu-") else text


def _failed(outcome: ChildOutcome, kind: str, message: str) -> ChildOutcome:
    return ChildOutcome(
        None, kind, message, outcome.exit_code, outcome.stderr_tail, outcome.wall_seconds
    )


SPEC = CollectorSpec(
    name=SOURCE,
    description="periodic matmul benchmark per GPU in a child process, while the GPU is idle",
    settings_type=BenchmarkSettings,
    factory=BenchmarkCollector,
)
