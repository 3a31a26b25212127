"""Judge one round of the gpu collector for `check`: identity, persistence mode, temperatures
against the GPU's own thresholds, clock slowdowns, ECC and row remapping, and the PCIe link.

Only the collector's samples and events are read (metric names are its contract): what is
degraded (a PCIe link, a hardware slowdown, a pending remap) is decided once, in the collector,
and shows here as its condition events. Lines that are OK on every GPU fold into one line.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from agent.contracts.model import GPU_LABELS, Event, RepairAction, Sample, Severity
from agent.program.diagnose.collect_once import CollectorResult
from agent.program.diagnose.findings import Finding, Status
from collectors.gpu import metrics as m
from collectors.gpu.checks import CONDITIONS

AREA = "gpu"
TEMPERATURE_MARGIN_CELSIUS = 5.0
"""WARN this close to the GPU's slowdown threshold: clocks drop at the threshold itself."""
# Clock event reasons that are not a problem: idle, an admin's clock setting, sync boost,
# display. Software power capping under load is normal too, so it is named but not judged.
BENIGN_REASONS = frozenset(
    {
        "gpu_idle",
        "applications_clocks_setting",
        "sync_boost",
        "display_clock_setting",
        "sw_power_cap",
    }
)
# Condition events of the gpu collector folded into the per-GPU lines below.
FOLDED_KINDS = {
    "hardware_slowdown": "clocks",
    "pcie_link_degraded": "pcie",
    "row_remap_pending": "ecc",
    "row_remap_failure": "ecc",
    "retired_pages_pending": "ecc",
    "gpu_lost": "identity",
    "gpu_unresponsive": "identity",
    **{name: "recovery" for name in CONDITIONS if name.startswith("recovery_action_")},
}


@dataclass
class GpuView:
    """One GPU's samples, by metric name and the labels beyond GPU_LABELS."""

    labels: dict[str, str]
    values: dict[tuple[str, tuple[str, ...]], float] = field(default_factory=dict)
    info: dict[str, str] = field(default_factory=dict)
    events: dict[str, list[Event]] = field(default_factory=lambda: defaultdict(list))

    @property
    def title(self) -> str:
        return f"GPU {self.labels['gpu']}"

    def get(self, metric: str, *extra: str) -> float | None:
        return self.values.get((metric, extra))


def gpu_views(result: CollectorResult) -> list[GpuView]:
    views: dict[str, GpuView] = {}
    for sample in result.samples:
        if sample.family.labels[: len(GPU_LABELS)] != GPU_LABELS:
            continue
        labels = dict(zip(GPU_LABELS, sample.label_values, strict=False))
        view = views.setdefault(labels["gpu"], GpuView(labels))
        extra = sample.label_values[len(GPU_LABELS) :]
        view.values[(sample.family.name, extra)] = sample.value
        if sample.family.name == m.INFO.name:
            view.info = dict(zip(sample.family.labels[len(GPU_LABELS) :], extra, strict=True))
    # The collector names a GPU by its UUID, or by its index while the UUID is unknown (a GPU
    # lost before its first read).
    by_subject = {v.labels["uuid"] or v.labels["gpu"]: v for v in views.values()}
    for event in result.events:
        owner = by_subject.get(event.subject)
        if owner is not None and event.kind in FOLDED_KINDS:
            owner.events[FOLDED_KINDS[event.kind]].append(event)
    return sorted(
        views.values(), key=lambda v: int(v.labels["gpu"]) if v.labels["gpu"].isdigit() else 0
    )


def _from_events(view: GpuView, topic: str, name: str, ok_detail: str) -> Finding:
    events = view.events.get(topic, [])
    if not events:
        return Finding(AREA, f"{view.title} {name}", Status.OK, ok_detail)
    worst = max(events, key=lambda e: e.severity)
    detail = "; ".join(e.message for e in events)
    return Finding(
        AREA,
        f"{view.title} {name}",
        Status.from_severity(worst.severity),
        detail,
        worst.action,
        worst.repair_action,
    )


def identity(view: GpuView) -> Finding:
    labels, info = view.labels, view.info
    parts = [labels["model"], labels["pci_bus_id"], labels["uuid"]]
    if info.get("driver_version"):
        parts.append(f"driver {info['driver_version']}")
    if info.get("vbios_version"):
        parts.append(f"VBIOS {info['vbios_version']}")
    if info.get("compute_capability"):
        parts.append(f"compute capability {info['compute_capability']}")
    if info.get("mig_mode") == "enabled":
        parts.append("MIG enabled" + _mig_instances(view))
    if view.get(m.UP.name) == 0:
        finding = _from_events(view, "identity", "identity", "")
        if finding.status is Status.OK:  # down, but its event was not in this round
            return Finding(
                AREA,
                finding.name,
                Status.FAIL,
                "the GPU does not answer NVML",
                "look for Xid errors in the kernel log; reset the GPU or reboot",
            )
        return finding
    return Finding(AREA, f"{view.title} identity", Status.OK, ", ".join(p for p in parts if p))


def _mig_instances(view: GpuView) -> str:
    """`: GPU instance 1 1g.18gb (3.0 of 18.0 GiB used), ...` from the instance series."""
    total = {e: v for (n, e), v in view.values.items() if n == m.MIG_MEMORY_TOTAL.name}
    if not total:
        return ", no GPU instance with memory read"
    gib = float(2**30)
    parts = []
    for gi, profile in sorted(total, key=lambda e: int(e[0]) if e[0].isdigit() else 0):
        used = view.get(m.MIG_MEMORY_USED.name, gi, profile)
        memory = f"{total[gi, profile] / gib:.1f} GiB"
        if used is not None:
            memory = f"{used / gib:.1f} of {memory} used"
        parts.append(f"GPU instance {gi} {profile} ({memory})")
    return ": " + ", ".join(parts)


def persistence(view: GpuView) -> Finding:
    mode = view.info.get("persistence_mode", "")
    name = f"{view.title} persistence mode"
    if mode == "enabled":
        return Finding(AREA, name, Status.OK, "enabled")
    if mode == "disabled":
        return Finding(
            AREA,
            name,
            Status.WARN,
            "disabled: the driver unloads between jobs, so each job start pays the GPU "
            "initialisation and the clocks and ECC state are re-read",
            "enable nvidia-persistenced (or nvidia-smi -pm 1)",
        )
    return Finding(AREA, name, Status.NA, "not reported by this GPU")


def temperature(view: GpuView) -> Finding:
    name = f"{view.title} temperature"
    # The GPU's own limits: its maximum operating temperature (below slowdown on an H200) when
    # reported, else the slowdown threshold; the memory's maximum for the memory sensor.
    checks = [("gpu", ("gpu_max", "slowdown")), ("memory", ("memory_max",))]
    texts, status, action = [], Status.OK, ""
    for sensor, threshold_names in checks:
        value = view.get(m.TEMPERATURE.name, sensor)
        if value is None:
            continue
        threshold_name, threshold = next(
            (
                (n, t)
                for n in threshold_names
                if (t := view.get(m.TEMPERATURE_THRESHOLD.name, n)) is not None
            ),
            (threshold_names[0], None),
        )
        text = f"{sensor} {value:.0f} °C"
        if threshold is not None:
            text += f" ({threshold_name.replace('_', ' ')} at {threshold:.0f} °C)"
            if value >= threshold:
                status, action = (
                    Status.FAIL,
                    "at or over its temperature limit, the GPU slows down: check cooling (inlet air, fans, airflow) now",
                )
            elif value >= threshold - TEMPERATURE_MARGIN_CELSIUS and status is Status.OK:
                status, action = Status.WARN, "close to its temperature limit: check cooling"
        texts.append(text)
    if not texts:
        return Finding(AREA, name, Status.NA, "no temperature reported")
    return Finding(AREA, name, status, ", ".join(texts), action)


def clocks(view: GpuView) -> Finding:
    active = sorted(
        reason
        for (metric, extra), value in view.values.items()
        if metric == m.CLOCK_EVENT.name and value == 1
        for reason in extra
    )
    if not any(metric == m.CLOCK_EVENT.name for metric, _ in view.values):
        return Finding(
            AREA, f"{view.title} throttling", Status.NA, "clock event reasons not reported"
        )
    concerning = [r for r in active if r not in BENIGN_REASONS]
    detail = "active reasons: " + (", ".join(active) if active else "none")
    finding = _from_events(view, "clocks", "throttling", detail)
    if finding.status is Status.OK and concerning:  # sw_thermal_slowdown: not a condition there
        return Finding(AREA, finding.name, Status.WARN, detail, "check cooling and power limits")
    return finding


def ecc(view: GpuView) -> Finding:
    name = f"{view.title} ECC and row remapping"
    mode = view.info.get("ecc_mode", "")
    counts = {
        key: view.get(m.ECC.name, *key)
        for key in (
            ("uncorrected", "volatile"),
            ("uncorrected", "aggregate"),
            ("corrected", "volatile"),
        )
    }
    rows = {
        cause: view.get(m.REMAPPED_ROWS.name, cause) for cause in ("correctable", "uncorrectable")
    }
    parts = [f"ECC {mode}" if mode else "ECC mode not reported"]
    parts += [
        f"{kind} {counter} {value:.0f}"
        for (kind, counter), value in counts.items()
        if value is not None
    ]
    parts += [
        f"rows remapped ({cause}) {value:.0f}" for cause, value in rows.items() if value is not None
    ]
    detail = ", ".join(parts)
    finding = _from_events(view, "ecc", "ECC and row remapping", detail)
    if finding.status is not Status.OK:
        return finding
    if mode == "disabled":
        return Finding(
            AREA,
            name,
            Status.WARN,
            detail,
            "enable ECC (nvidia-smi -e 1, then reset the GPU): without it memory errors go unnoticed",
        )
    if (counts[("uncorrected", "volatile")] or 0) > 0:
        return Finding(
            AREA,
            name,
            Status.WARN,
            detail + " (uncorrectable errors since the driver loaded)",
            "restart the jobs that ran on this GPU; reset the GPU when idle; watch for Xid 48/94/95",
        )
    if not mode and all(v is None for v in counts.values()):
        return Finding(AREA, name, Status.NA, "ECC is not reported by this GPU")
    return finding


def pcie(view: GpuView) -> Finding:
    generation = view.get(m.PCIE_GENERATION.name, "current")
    generation_max = view.get(m.PCIE_GENERATION.name, "max")
    width = view.get(m.PCIE_WIDTH.name, "current")
    width_max = view.get(m.PCIE_WIDTH.name, "max")
    if generation is None and width is None:
        return Finding(AREA, f"{view.title} PCIe link", Status.NA, "link state not reported")

    def show(value: float | None) -> str:
        return "?" if value is None else f"{value:.0f}"

    detail = (
        f"gen {show(generation)} of {show(generation_max)}, x{show(width)} of x{show(width_max)}"
    )
    if generation is not None and generation_max is not None and generation < generation_max:
        detail += " (an idle GPU lowers its link generation to save power: normal)"
    return _from_events(view, "pcie", "PCIe link", detail)


def recovery(view: GpuView) -> Finding:
    """What the driver says to do with the GPU (NVML's recovery action field)."""
    name = f"{view.title} recovery action"
    actions = [
        extra[0]
        for (metric, extra), value in view.values.items()
        if metric == m.RECOVERY_ACTION.name and value == 1
    ]
    code = view.get(m.RECOVERY_ACTION_CODE.name)
    if code is None:
        return Finding(AREA, name, Status.NA, "not reported by this driver")
    if actions == ["none"]:
        return Finding(AREA, name, Status.OK, "none")
    spec = CONDITIONS[f"recovery_action_{actions[0]}" if actions else "recovery_action_unknown"]
    detail = f"{spec.message} ({actions[0] if actions else f'code {int(code)}'})"
    return Finding(AREA, name, Status.from_severity(spec.severity), detail, spec.action)


def _gib(value: float) -> str:
    return f"{value / 2**30:.1f} GiB"


def processes(view: GpuView) -> Finding:
    """The compute processes on the GPU, largest first, with their owners (information)."""
    name = f"{view.title} processes"
    count = view.get(m.PROCESSES.name)
    if count is None:
        return Finding(AREA, name, Status.NA, "NVML does not list processes on this GPU")
    shown = sorted(
        (
            (value, extra)
            for (metric, extra), value in view.values.items()
            if metric == m.PROCESS_MEMORY.name
        ),
        key=lambda item: -item[0],
    )
    if not count:
        return Finding(AREA, name, Status.OK, "none")
    parts = []
    for value, extra in shown:
        owner = dict(zip(m.PROCESS_LABELS, extra, strict=True))
        who = [f"{k} {owner[k]}" for k in ("user", "unit", "pod_uid", "container_id") if owner[k]]
        parts.append(
            f"pid {owner['pid']} {owner['process'] or '?'} {_gib(value)}"
            + (f" ({', '.join(who)})" if who else "")
        )
    more = int(count) - len(shown)
    if more > 0:
        parts.append(f"{more} more")
    return Finding(AREA, name, Status.OK, f"{int(count)} processes: " + "; ".join(parts))


PER_GPU = (identity, persistence, temperature, clocks, ecc, pcie, recovery)


def index_ranges(indices: list[str]) -> str:
    """['0', '1', '2', '5'] -> '0-2,5'."""
    numbers = sorted(int(i) for i in indices if i.isdigit())
    parts: list[str] = []
    start = previous = None
    for n in numbers:
        if previous is not None and n == previous + 1:
            previous = n
            continue
        if start is not None:
            parts.append(str(start) if start == previous else f"{start}-{previous}")
        start = previous = n
    if start is not None:
        parts.append(str(start) if start == previous else f"{start}-{previous}")
    return ",".join(parts + [i for i in indices if not i.isdigit()])


def per_gpu(check: Callable[[GpuView], Finding], view: GpuView) -> Finding:
    """One GPU's line with its stable id (`gpu_` and the check's name) and the GPU as data."""
    index = view.labels["gpu"]
    return dataclasses.replace(
        check(view),
        check=f"gpu_{check.__name__}",
        subject=view.title,
        data={"gpus": [int(index) if index.isdigit() else index]},
    )


def fold(findings: list[Finding]) -> list[Finding]:
    """OK (or N/A) lines of the same check on several GPUs become one line."""
    if len(findings) < 2:
        return findings
    out = [f for f in findings if f.status not in (Status.OK, Status.NA)]
    for status in (Status.OK, Status.NA):
        same = [f for f in findings if f.status is status]
        if not same:
            continue
        label = same[0].name.removeprefix(same[0].subject).strip()
        indices = [str(g) for f in same for g in f.data.get("gpus", ())]
        gpus = index_ranges(indices)
        details = list(dict.fromkeys(f.detail for f in same))
        detail = (
            details[0]
            if len(details) == 1
            else "; ".join(f"{index}: {f.detail}" for index, f in zip(indices, same, strict=True))
        )
        out.append(
            Finding(
                AREA,
                f"GPU {gpus} {label}",
                status,
                detail,
                check=same[0].check,
                subject=f"GPU {gpus}",
                data={"gpus": [g for f in same for g in f.data.get("gpus", ())]},
            )
        )
    return out


NO_DRIVER_ACTION = (
    "install or load the NVIDIA driver (nvidia-smi must list the GPUs); if this "
    "host has no GPU on purpose, run check with --expect-gpus 0"
)


def driver_line(
    result: CollectorResult, kernel_module: str | None, versions: dict[str, str]
) -> Finding:
    """`kernel_module`: the first line of /proc/driver/nvidia/version, None when absent."""
    nvml_up = result.values(m.NVML_UP.name)
    if nvml_up and nvml_up[0].value == 1:
        parts = [versions.get("driver_version", "version not reported")]
        if "cuda_driver_version" in versions:
            parts.append(f"CUDA {versions['cuda_driver_version']} supported")
        if "nvml_version" in versions:
            parts.append(f"NVML {versions['nvml_version']}")
        return Finding(AREA, "NVIDIA driver", Status.OK, ", ".join(parts))
    down = [e for e in result.events if e.kind == "nvml_unavailable"]
    reason = (
        str(down[0].attributes.get("reason", "")) if down else result.error or "NVML did not start"
    )
    if kernel_module is None:
        return Finding(
            AREA,
            "NVIDIA driver",
            Status.FAIL,
            "no NVIDIA driver is present: the kernel module is not loaded "
            f"(/proc/driver/nvidia/version is missing) and NVML cannot start ({reason})",
            NO_DRIVER_ACTION,
        )
    return Finding(
        AREA,
        "NVIDIA driver",
        Status.FAIL,
        f"the NVIDIA kernel module is loaded ({kernel_module}) but NVML does not answer: {reason}",
        "a driver and library of different versions (after an upgrade "
        "without a reboot) is the usual cause: reboot, or reinstall the driver",
    )


def classify_gpus(
    result: CollectorResult,
    expected: int | None,
    kernel_module: str | None = None,
    versions: dict[str, str] | None = None,
) -> list[Finding]:
    """`expected`: None for at least one, N for exactly N (0 is handled by the caller)."""
    if result.error:
        return [
            Finding(
                AREA,
                "GPU collector",
                Status.FAIL,
                f"one round failed: {result.error}",
                "run nvidia-smi; if it hangs too, look for Xids in the kernel log",
            )
        ]
    driver = driver_line(result, kernel_module, versions or {})
    if driver.status is not Status.OK:
        return [driver]
    findings = [
        driver,
        gpu_count(result.values(m.GPU_COUNT.name), expected, result.values(m.GPUS_PCI.name)),
    ]
    views = gpu_views(result)
    answering = [v for v in views if v.get(m.UP.name) != 0]
    findings.extend(per_gpu(identity, v) for v in views if v.get(m.UP.name) == 0)
    findings.extend(fold([per_gpu(identity, v) for v in answering]))
    for check in PER_GPU[1:]:  # a GPU that does not answer has nothing more to judge
        findings.extend(fold([per_gpu(check, view) for view in answering]))
    # GPUs with processes each have their line (they differ); idle ones fold into one.
    lines = [per_gpu(processes, view) for view in answering]
    findings.extend(f for f in lines if f.detail not in ("none",) and f.status is Status.OK)
    findings.extend(fold([f for f in lines if f.detail == "none" or f.status is not Status.OK]))
    folded_uuids = {v.labels["uuid"] or v.labels["gpu"] for v in views}
    findings.extend(
        Finding(
            AREA,
            event.subject or event.kind,
            Status.from_severity(event.severity),
            event.message,
            event.action,
            event.repair_action,
            check=event.kind,
            subject=event.subject,
        )
        for event in result.events
        if event.severity >= Severity.WARNING
        and not (event.kind in FOLDED_KINDS and event.subject in folded_uuids)
        and event.kind != "nvml_unavailable"
    )
    return findings


def gpu_count(
    samples: Iterable[Sample], expected: int | None, pci: Iterable[Sample] = ()
) -> Finding:
    visible = next((int(s.value) for s in samples), 0)
    on_bus = next((int(s.value) for s in pci), None)
    if on_bus is not None and on_bus > visible:
        # The gpu_not_enumerated finding names the addresses.
        return Finding(
            AREA,
            "GPU count",
            Status.FAIL,
            f"{visible} visible to NVML, {on_bus} NVIDIA GPUs on the PCI bus",
            "a GPU did not come up: look for NVRM errors in the kernel log (RmInitAdapter "
            "failed); reboot; if still missing, have the GPU and its slot inspected",
        )
    if expected is None:
        if visible == 0:
            return Finding(
                AREA,
                "GPU count",
                Status.FAIL,
                "NVML answers but sees no GPU",
                "check lspci for NVIDIA devices and the kernel log for NVRM errors",
                RepairAction.REBOOT_NODE,
            )
        return Finding(AREA, "GPU count", Status.OK, f"{visible} visible")
    if visible < expected:
        return Finding(
            AREA,
            "GPU count",
            Status.FAIL,
            f"{visible} visible, {expected} expected",
            "look for Xid 79 / 'fallen off the bus' in the kernel log and GPUs missing "
            "from lspci; reboot; if still missing, have the hardware inspected",
            RepairAction.REBOOT_NODE,
        )
    if visible > expected:
        return Finding(
            AREA,
            "GPU count",
            Status.WARN,
            f"{visible} visible, only {expected} expected",
            "update expected_gpus ([collectors.gpu]) or --expect-gpus",
        )
    return Finding(AREA, "GPU count", Status.OK, f"{visible} visible, as expected")
