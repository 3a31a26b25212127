"""The benchmark's events, written for the person on call.

A wrong answer is critical and raised for every wrong run (each one is a new observation of
possible silent data corruption). Slow-against-baseline and slow-against-peers are states: one
warning on entering, one info on leaving, remembered in the state store so a restart neither
repeats nor forgets them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from agent.contracts.collector import KeyValueStore
from agent.contracts.model import AttributeValue, Event, RepairAction, Severity
from collectors.benchmark.gpus import GpuIdentity
from collectors.benchmark.history import BaselinePolicy, BenchmarkRecord, regressed
from collectors.benchmark.runner import FAILURE_MESSAGES, ChildOutcome

SOURCE: Final = "benchmark"
KV: Final = "benchmark"
HOST_WIDE: Final = frozenset({"torch_missing", "cuda_unavailable", "driver_too_old"})

FAILURE_ACTIONS: Final[dict[str, str]] = {
    "timeout": "check the GPU for a hang (nvidia-smi, kernel log Xids); raise "
    "collectors.benchmark.child_timeout if the test is just slow",
    "crash": "read the stderr tail in this event; check the kernel log for Xids around this time",
    "out_of_memory": "another process holds GPU memory, or the size is too large: lower "
    'collectors.benchmark.size or use when = "idle"',
    "cuda_unavailable": "point collectors.benchmark.python at a Python whose torch is a CUDA "
    "build, and check that the NVIDIA driver is loaded",
    "driver_too_old": "upgrade the NVIDIA driver, or install a torch built for an older CUDA",
    "torch_missing": "install torch for the benchmark (pip install 'gpuwarden[bench]') or set "
    "collectors.benchmark.python to a Python that has it",
    "wrong_device": "check CUDA_VISIBLE_DEVICES handling on this host; do not trust this "
    "GPU's results until fixed",
}


def _where(gpu: GpuIdentity) -> str:
    return f"GPU {gpu.index} ({gpu.name}, {gpu.uuid})"


def failure_event(gpu: GpuIdentity, outcome: ChildOutcome) -> Event:
    what = FAILURE_MESSAGES.get(outcome.failure, FAILURE_MESSAGES["error"])
    detail = f": {outcome.message}" if outcome.message else ""
    host_wide = outcome.failure in HOST_WIDE
    return Event(
        source=SOURCE,
        kind="benchmark_failed",
        severity=Severity.WARNING,
        repair_action=RepairAction.INVESTIGATE,
        subject=gpu.uuid,
        message=f"{_where(gpu)}: {what}{detail}"
        + (" (this affects every GPU of the host)" if host_wide else ""),
        action=FAILURE_ACTIONS.get(
            outcome.failure,
            f"run `gpuwarden bench --device {gpu.index}` by hand and read its error",
        ),
        attributes={
            "reason": outcome.failure,
            "exit_code": outcome.exit_code,
            "stderr_tail": outcome.stderr_tail[-1000:],
            "wall_seconds": round(outcome.wall_seconds, 3),
            "gpu": gpu.index,
        },
    )


def recovered_event(gpu: GpuIdentity, previous: str) -> Event:
    return Event(
        source=SOURCE,
        kind="benchmark_recovered",
        severity=Severity.INFO,
        repair_action=RepairAction.NONE,
        clears=("benchmark_failed",),
        subject=gpu.uuid,
        message=f"{_where(gpu)}: the benchmark runs again (it had failed: {previous})",
        attributes={"previous_reason": previous, "gpu": gpu.index},
    )


def wrong_result_event(gpu: GpuIdentity, record: BenchmarkRecord) -> Event:
    error = "non-finite values" if record.max_error is None else f"error {record.max_error:.3g}"
    return Event(
        source=SOURCE,
        kind="benchmark_wrong_result",
        severity=Severity.CRITICAL,
        repair_action=RepairAction.RESET_GPU,
        subject=gpu.uuid,
        message=f"{_where(gpu)} computed a wrong matrix product ({error} against a float64 "
        f"reference, tolerance {record.tolerance:g} for {record.profile}): possible "
        "silent data corruption",
        action=f"drain the GPU of work; rerun `gpuwarden bench --device {gpu.index}`; if it "
        "repeats, run the vendor diagnostics (dcgmi diag -r 3) and have the GPU inspected",
        attributes={
            "max_error": record.max_error,
            "tolerance": record.tolerance,
            "profile": record.profile,
            "size": record.size,
            "gpu": gpu.index,
        },
    )


def _state_change(store: KeyValueStore, key: str, now_on: bool) -> bool | None:
    """True when the state just turned on, False when it just turned off, None if unchanged."""
    was_on = bool(store.get(KV, key))
    if was_on == now_on:
        return None
    if now_on:
        store.put(KV, key, True)
    else:
        store.delete(KV, key)
    return now_on


def judge_events(
    store: KeyValueStore,
    history: Sequence[BenchmarkRecord],
    record: BenchmarkRecord,
    *,
    gpu: GpuIdentity,
    gpus: Sequence[GpuIdentity],
    policy: BaselinePolicy,
) -> list[Event]:
    """Events for a run already judged (ratios filled in) and appended to `history`."""
    if record.correct is False:
        return [wrong_result_event(gpu, record)]
    events: list[Event] = []
    tflops = f"{record.estimated_tflops:.3g} TFLOP/s"
    attrs: dict[str, AttributeValue] = {
        "tflops": record.estimated_tflops,
        "profile": record.profile,
        "size": record.size,
        "gpu": gpu.index,
    }
    change = _state_change(store, f"regressed:{gpu.uuid}", regressed(history, record, policy))
    if change is True:
        events.append(
            Event(
                source=SOURCE,
                kind="benchmark_regression",
                severity=Severity.WARNING,
                repair_action=RepairAction.INVESTIGATE,
                subject=gpu.uuid,
                message=f"{_where(gpu)} is slow: {tflops}, {record.baseline_ratio:.2f} of its "
                f"baseline for {policy.regression_runs} runs in a row "
                f"({record.profile}, size {record.size})",
                action="check clocks, throttle reasons, power cap and temperature (nvidia-smi -q -d "
                "PERFORMANCE,POWER,TEMPERATURE); compare with `gpuwarden bench --history`",
                attributes={**attrs, "baseline_ratio": record.baseline_ratio},
            )
        )
    elif change is False:
        events.append(
            Event(
                source=SOURCE,
                kind="benchmark_regression_cleared",
                severity=Severity.INFO,
                repair_action=RepairAction.NONE,
                clears=("benchmark_regression",),
                subject=gpu.uuid,
                message=f"{_where(gpu)} is back at its baseline: {tflops}",
                attributes={**attrs, "baseline_ratio": record.baseline_ratio},
            )
        )
    if record.peer_ratio is not None:
        slow = record.peer_ratio < policy.peer_ratio
        change = _state_change(store, f"peer_slow:{gpu.uuid}", slow)
        peers = sum(1 for g in gpus if g.name == gpu.name and g.uuid != gpu.uuid)
        if change is True:
            events.append(
                Event(
                    source=SOURCE,
                    kind="benchmark_peer_slow",
                    severity=Severity.WARNING,
                    repair_action=RepairAction.INVESTIGATE,
                    subject=gpu.uuid,
                    message=f"{_where(gpu)} is slower than its peers: {tflops}, "
                    f"{record.peer_ratio:.2f} of the median of {peers} other {gpu.name} "
                    "GPU(s) on this node",
                    action="compare this GPU's clocks, power and PCIe link with its peers "
                    "(nvidia-smi -q); a lone slow GPU often has a throttle reason",
                    attributes={**attrs, "peer_ratio": record.peer_ratio},
                )
            )
        elif change is False:
            events.append(
                Event(
                    source=SOURCE,
                    kind="benchmark_peer_cleared",
                    severity=Severity.INFO,
                    repair_action=RepairAction.NONE,
                    clears=("benchmark_peer_slow",),
                    subject=gpu.uuid,
                    message=f"{_where(gpu)} is level with its peers again: {tflops}",
                    attributes={**attrs, "peer_ratio": record.peer_ratio},
                )
            )
    return events
