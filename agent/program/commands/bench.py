"""Run one matmul benchmark now and print the record; or show or import the history.

Without --device every GPU is tested, one after the other, busy or not (you asked). Each run is
appended to the history in state_dir, like the daemon's. Exit codes: 0 every test ran and
computed the right product; 1 a test could not run (or no GPU was found); 2 a usage or
configuration error; 3 a GPU computed a wrong product (possible silent data corruption).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from agent.contracts.collector import (
    CollectContext,
    CollectorDeps,
    MemoryKeyValueStore,
    SharedServices,
)
from agent.contracts.errors import ConfigError
from agent.program import config_file as config_module
from agent.program import output
from agent.runtime.rounds import collector_pool
from collectors._nvml import NvmlBackend
from collectors.benchmark.collector import BenchmarkCollector, BenchmarkSettings, RunResult
from collectors.benchmark.events import FAILURE_ACTIONS
from collectors.benchmark.gpus import GpuActivity, GpuBackendUnavailable, GpuIdentity, NvmlActivity
from collectors.benchmark.history import (
    BenchmarkRecord,
    HistoryFile,
    current_segment,
    is_good,
    parse_lines,
)
from collectors.benchmark.request import PROFILES
from collectors.benchmark.runner import FAILURE_MESSAGES

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_WRONG = 0, 1, 2, 3
CPU = GpuIdentity(index=-1, uuid="cpu", name="cpu", pci_bus_id="")
_DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        metavar="N|cpu",
        default=None,
        help="one GPU by NVML index, or cpu (default: every GPU)",
    )
    parser.add_argument("--size", type=int, default=None, help="matrix side (default: config)")
    parser.add_argument(
        "--dtype",
        "--profile",
        dest="profile",
        default=None,
        choices=sorted({*PROFILES, *_DTYPE_ALIASES}),
        help="fp32 (highest precision), tf32, bf16 or fp16 (default: config)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per GPU tested")
    parser.add_argument(
        "--history",
        action="store_true",
        help="show each GPU's past runs and ratios instead of testing",
    )
    parser.add_argument(
        "--import",
        dest="import_file",
        type=Path,
        default=None,
        metavar="FILE",
        help="add the runs of a gpu_benchmark.jsonl (the field guide's script) to the history",
    )
    parser.add_argument(
        "--gpu-uuid",
        default=None,
        help="with --import: the UUID of the GPU the file's runs were made on",
    )


def main(args: argparse.Namespace) -> int:
    try:
        cfg = config_module.load(args.config)
        settings = cfg.collector("benchmark")
        assert isinstance(settings, BenchmarkSettings)
        changes: dict[str, Any] = {}
        if args.profile:
            changes["profile"] = _DTYPE_ALIASES.get(args.profile, args.profile)
            changes["size"] = 0 if args.size is None else args.size
        elif args.size is not None:
            changes["size"] = args.size
        settings = settings.replace(**changes)
    except ConfigError as exc:
        print(f"gpuwarden bench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    history = HistoryFile.in_state_dir(cfg.state_dir)
    if args.history:
        return show_history(history, as_json=args.json, settings=settings)
    if args.import_file is not None:
        return import_file(history, args.import_file, args.gpu_uuid)
    return asyncio.run(_run(settings, cfg.node_id, cfg.state_dir, args.device, args.json))


async def _run(
    settings: BenchmarkSettings, node_id: str, state_dir: Path, device: str | None, as_json: bool
) -> int:
    activity: GpuActivity = NvmlActivity(NvmlBackend())
    deps = CollectorDeps(
        node_id=node_id,
        state_dir=state_dir,
        state=MemoryKeyValueStore(),
        shared=SharedServices(),
        emit=lambda event: None,
    )
    if device == "cpu":
        collector = BenchmarkCollector(
            settings,
            deps,
            activity=_CpuActivity(),
            source="cli",
            device_plan=lambda gpu: ("cpu", {}),
        )
        targets = all_gpus = [CPU]
    else:
        collector = BenchmarkCollector(settings, deps, activity=activity, source="cli")
        try:
            all_gpus = await asyncio.to_thread(activity.gpus)
        except GpuBackendUnavailable as exc:
            print(f"gpuwarden bench: no GPU to test ({exc}); try --device cpu", file=sys.stderr)
            return EXIT_FAILED
        if not all_gpus:
            print("gpuwarden bench: NVML found no GPU; try --device cpu", file=sys.stderr)
            return EXIT_FAILED
        selected = _select(all_gpus, device)
        if selected is None:
            known = ", ".join(str(g.index) for g in all_gpus) or "none"
            print(f"gpuwarden bench: no GPU {device!r} (GPUs here: {known})", file=sys.stderr)
            return EXIT_USAGE
        targets = selected
    # The daemon's pool policy: each NVML or history call bounded by the collector's timeout
    # (the child process has its own, child_timeout), a hung one not called again.
    pool = collector_pool("benchmark", settings.timeout, lambda _event: None)
    ctx = CollectContext(caller=pool.caller, now=time.time(), round=0)
    try:
        await asyncio.to_thread(collector.history.refresh)
        code = EXIT_OK
        for gpu in targets:
            said = output.wrap(describe_target(gpu, settings), output.width(sys.stderr), "", 2)
            print("\n".join(said), file=sys.stderr, flush=True)
            async with progress(f"{_where(gpu)}: running", settings.child_timeout, sys.stderr):
                result = await collector.benchmark(ctx, gpu, all_gpus)
            text = result_text(
                result, settings, collector.history.records, output.width(sys.stdout)
            )
            print(json.dumps(_result_json(result)) if as_json else text, flush=True)
            if result.record is None:
                code = max(code, EXIT_FAILED)
            elif result.record.correct is False:
                code = EXIT_WRONG
    finally:
        pool.shutdown()
    return code


def _select(gpus: list[GpuIdentity], device: str | None) -> list[GpuIdentity] | None:
    if device is None:
        return gpus
    chosen = [g for g in gpus if str(g.index) == device.strip() or g.uuid == device.strip()]
    return chosen or None


class _CpuActivity:
    def gpus(self) -> list[GpuIdentity]:
        return [CPU]

    def compute_process_count(self, index: int) -> int | None:
        return None

    def utilization_percent(self, index: int) -> float | None:
        return None

    def driver_version(self) -> str | None:
        return None

    def hold(self, timeout: float) -> bool:
        return True  # no GPU backend to let go of

    def release(self) -> None:
        return None


def _result_json(result: RunResult) -> dict[str, Any]:
    if result.record is not None:
        return {**result.record.to_dict(), "events": [e.to_dict() for e in result.events]}
    outcome = result.outcome
    return {
        "gpu_index": None if result.gpu is CPU else result.gpu.index,
        "gpu_uuid": result.gpu.uuid,
        "gpu_name": result.gpu.name,
        "error": outcome.failure,
        "message": outcome.message,
        "exit_code": outcome.exit_code,
        "stderr_tail": outcome.stderr_tail[-2000:],
    }


def _where(gpu: GpuIdentity) -> str:
    if gpu is CPU:
        return "cpu"
    return output.join(
        [f"GPU {gpu.index}", gpu.name or "model unknown", gpu.uuid or "UUID unknown"], " "
    )


def describe_target(gpu: GpuIdentity, settings: BenchmarkSettings) -> str:
    """What is about to be tested, said before the test starts (it takes seconds)."""
    request = settings.request("cpu" if gpu is CPU else "cuda")
    profile = request.profile
    window = (
        f", each window at least {request.min_window_seconds:g} s"
        if request.min_window_seconds > 0
        else ""
    )
    where = "the CPU" if gpu is CPU else _where(gpu)
    if gpu is not CPU and gpu.pci_bus_id:
        where += f" at {gpu.pci_bus_id}"
    return (
        f"testing {where}: profile {profile.name} ({profile.dtype}, matmul precision "
        f"{profile.matmul_precision}), size {request.size}, {request.samples} windows of "
        f"{request.iterations} products{window}; the test is stopped after "
        f"{settings.child_timeout:g} s"
    )


PROGRESS_EVERY = 10.0
"""Seconds between progress lines when stderr is not a terminal (a log keeps each one)."""
TTY_TICK = 1.0


@contextlib.asynccontextmanager
async def progress(
    label: str, limit: float, stream: TextIO, every: float | None = None
) -> AsyncIterator[None]:
    """While the block runs: on a terminal one line rewritten every second, elsewhere a line
    every PROGRESS_EVERY seconds; nothing for a block shorter than that."""
    tty = stream.isatty()
    step = every if every is not None else (TTY_TICK if tty else PROGRESS_EVERY)
    started = time.monotonic()

    async def tick() -> None:
        while True:
            await asyncio.sleep(step)
            text = f"{label}, {time.monotonic() - started:.0f} s of at most {limit:g} s"
            stream.write(f"\r{text}\x1b[K" if tty else text + "\n")
            stream.flush()

    task = asyncio.create_task(tick())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if tty and time.monotonic() - started >= step:
            stream.write("\r\x1b[K")
            stream.flush()


def result_text(
    result: RunResult,
    settings: BenchmarkSettings,
    history: Sequence[BenchmarkRecord],
    width: int = output.DEFAULT_WIDTH,
) -> str:
    """The run for a person: throughput, what was measured, whether the product was right,
    the ratios and why one is missing, and what to do about a failure."""
    record = result.record
    if record is None:
        return _failure_text(result)
    if record.correct is False:
        verdict = (
            f"WRONG RESULT (max error {output.shown(record.max_error)}, "
            f"tolerance {_number(record.tolerance)})"
        )
    elif record.correct is None:
        verdict = "not checked"
    else:
        verdict = (
            f"correct (max error {_number(record.max_error, '.2g')}, "
            f"tolerance {_number(record.tolerance)})"
        )
    parts = [
        f"{record.profile} ({record.dtype}, matmul precision {record.matmul_precision}), "
        f"size {record.size}, {record.iterations} iterations per window, median window "
        f"{record.median_seconds:.3f} s of {len(record.sample_seconds)}, "
        f"torch {output.shown(record.torch)} ({_cuda(record.torch_cuda)})",
        f"result {verdict}",
        f"baseline ratio {_baseline(record, settings, history)}",
        f"peer ratio {_peer(record)}",
        *(f"{e.severity.label.upper()}: {e.message}" for e in result.events),
    ]
    lines = [f"{_where(result.gpu)}: {record.estimated_tflops:.2f} TFLOP/s"]
    for part in parts:
        lines += output.wrap(part, width, "  ", 4)
    return "\n".join(lines)


def _failure_text(result: RunResult) -> str:
    outcome = result.outcome
    what = FAILURE_MESSAGES.get(outcome.failure, outcome.failure or "no result")
    text = f"{_where(result.gpu)}: FAILED ({what})"
    if outcome.message:
        text += f": {outcome.message}"
    tail = outcome.stderr_tail.strip().splitlines()[-5:]
    text += "".join(f"\n  stderr: {line}" for line in tail)
    action = FAILURE_ACTIONS.get(outcome.failure)
    if action is None:
        index = "cpu" if result.gpu is CPU else result.gpu.index
        action = f"read the error above; gpuwarden bench --device {index} runs it again"
    return text + f"\n  what to do: {action}"


def _cuda(version: str | None) -> str:
    return f"CUDA {version}" if version else "CPU-only build"


def _number(value: float | None, spec: str = "g") -> str:
    return "unknown" if value is None else format(value, spec)


def _baseline(
    record: BenchmarkRecord, settings: BenchmarkSettings, history: Sequence[BenchmarkRecord]
) -> str:
    if record.baseline_ratio is not None:
        return f"{record.baseline_ratio:.3f}"
    policy = settings.policy()
    good = [r for r in current_segment(history, record) if is_good(r, policy)]
    return (
        f"- (no baseline yet: it needs {policy.min_runs} comparable runs of this GPU, "
        f"profile, size and window, with the same driver and torch; {len(good)} so far)"
    )


def _peer(record: BenchmarkRecord) -> str:
    if record.peer_ratio is not None:
        return f"{record.peer_ratio:.3f}"
    return "- (no recent comparable run of another GPU of this model)"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def show_history(
    history: HistoryFile, *, as_json: bool, settings: BenchmarkSettings | None = None
) -> int:
    records = history.refresh()
    if as_json:
        for record in records:
            print(record.to_json())
        return EXIT_OK
    if not records:
        print(f"no benchmark history in {history.path}")
        return EXIT_OK
    by_gpu: dict[str, list[BenchmarkRecord]] = {}
    for record in records:
        key = record.gpu_uuid or f"(no UUID) index {output.shown(record.gpu_index)}"
        by_gpu.setdefault(key, []).append(record)
    for uuid, runs in by_gpu.items():
        last = runs[-1]
        index = "cpu" if last.gpu_index is None else f"index {last.gpu_index}"
        print(f"{uuid}  {output.shown(last.gpu_name, 'model unknown')}  {index}")
        print(
            f"  {'time (UTC)':<20} {'source':<6} {'profile':<7} {'size':>5} {'window':<9} "
            f"{'TFLOP/s':>9} {'baseline':>8} {'peers':>6}  correct"
        )
        for r in runs:
            correct = {True: "yes", False: "WRONG", None: "-"}[r.correct]
            print(
                f"  {r.time_utc:<20} {r.source:<6} {r.profile:<7} {r.size:>5} "
                f"{r.duration_class:<9} {r.estimated_tflops:>9.2f} "
                f"{_ratio(r.baseline_ratio):>8} {_ratio(r.peer_ratio):>6}  {correct}"
            )
    needed = (settings or BenchmarkSettings()).baseline_min_runs
    note = (
        f"baseline -: fewer than {needed} comparable good runs before it; peers -: no recent "
        "run of another GPU of the model; correct -: not checked (an imported run)"
    )
    print("\n".join(output.wrap(note, output.width(sys.stdout))))
    if history.bad_lines:
        print(f"({len(history.bad_lines)} unreadable line(s) in {history.path} skipped)")
    return EXIT_OK


def import_file(history: HistoryFile, path: Path, gpu_uuid: str | None) -> int:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as exc:
        print(f"gpuwarden bench: cannot read {path}: {exc.strerror}", file=sys.stderr)
        return EXIT_USAGE
    loaded = parse_lines(lines)
    existing = {_identity(r) for r in history.refresh()}
    added = 0
    for parsed in loaded.records:
        record = parsed.with_changes(source="import", gpu_uuid=parsed.gpu_uuid or gpu_uuid or "")
        if _identity(record) in existing:
            continue
        history.append(record)
        existing.add(_identity(record))
        added += 1
    print(
        f"imported {added} run(s) from {path} into {history.path}"
        f" ({len(loaded.records) - added} already there)"
    )
    for number, reason in loaded.bad_lines:
        print(f"  line {number} skipped: {reason}", file=sys.stderr)
    if any(not r.gpu_uuid for r in loaded.records) and not gpu_uuid:
        print(
            "  note: runs without a GPU UUID are kept but never used as a baseline; pass "
            "--gpu-uuid (nvidia-smi -L shows it) to attach a file's runs to its GPU",
            file=sys.stderr,
        )
    return EXIT_OK if not loaded.bad_lines else EXIT_FAILED


def _identity(record: BenchmarkRecord) -> Sequence[object]:
    return (record.time_utc, record.gpu_index, record.median_seconds)
