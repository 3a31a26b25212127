"""Health checks on GPU readings: counters that increase and conditions that start or end.

Hardware counters are cumulative: a non-zero ECC count is history, not news. An event fires on
an increase against the last value seen, with the delta; the last values persist in the state
store, so a restart neither re-alerts nor forgets. A value lower than the last one is a reset
(the driver was reloaded: volatile counters restart at 0): one info event, a new baseline, never
a negative increase; for a volatile counter the new value itself counts since the reset, so it
is also an increase of that much when above 0 (two uncorrectable errors after a reboot are news).
A volatile counter is stored with the boot id, so that a reboot is a reset even when the new
value is not lower (2 before, 7 since the reboot: 7 new, not 5). Conditions (a pending row remap, a degraded PCIe link) raise one event when
they start and one when they end, also persisted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

from agent.contracts.collector import JSONValue, KeyValueStore
from agent.contracts.model import AttributeValue, Event, RepairAction, Severity
from collectors._nvml import (
    CLOCK_EVENT_REASONS,
    RECOVERY_ACTIONS,
    GpuReading,
    GpuSlowReading,
    GpuStatic,
)

SOURCE: Final = "gpu"
COUNTERS_NAMESPACE: Final = "gpu.counters"
CONDITIONS_NAMESPACE: Final = "gpu.conditions"


@dataclass(frozen=True, slots=True)
class CounterSpec:
    name: str
    """The attribute of GpuReading / GpuSlowReading, and part of the state key."""
    what: str
    severity: Severity
    action: str
    volatile: bool = True
    repair: RepairAction = RepairAction.NONE
    """Restarts at 0 with the driver: after a reset its whole value is new. False for counts
    kept in the InfoROM (remapped rows, retired pages), where a lower value says nothing new."""


RESET_GPU_IF_REPEATS = "if it repeats, drain the node and reset the GPU (or reboot)"

FAST_COUNTERS: Final = (
    CounterSpec(
        "ecc_corrected_volatile",
        "corrected ECC errors",
        Severity.INFO,
        "none needed for single events; watch the rate (Xid 92 flags a high rate)",
    ),
    CounterSpec(
        "ecc_uncorrected_volatile",
        "uncorrectable ECC errors",
        Severity.CRITICAL,
        "restart the job that used this GPU; "
        + RESET_GPU_IF_REPEATS
        + "; check for a pending row remap",
        repair=RepairAction.RESTART_APPLICATION,
    ),
    CounterSpec(
        "remapped_rows_correctable",
        "rows remapped after correctable errors",
        Severity.INFO,
        "none needed; the remap applies at the next GPU reset",
        volatile=False,
    ),
    CounterSpec(
        "remapped_rows_uncorrectable",
        "rows remapped after uncorrectable errors",
        Severity.WARNING,
        "reset the GPU when it is idle so that the remap takes effect; "
        "repeated remaps: have the GPU inspected",
        volatile=False,
        repair=RepairAction.RESET_GPU,
    ),
)
SLOW_COUNTERS: Final = (
    CounterSpec(
        "pcie_replays",
        "PCIe replays",
        Severity.WARNING,
        "check the PCIe link (riser, slot, cable) if the count keeps rising",
        repair=RepairAction.INVESTIGATE,
    ),
    CounterSpec(
        "retired_pages_single_bit",
        "pages retired after repeated single-bit ECC errors",
        Severity.WARNING,
        "reset the GPU to apply the retirement; repeated: inspect hardware",
        volatile=False,
        repair=RepairAction.RESET_GPU,
    ),
    CounterSpec(
        "retired_pages_double_bit",
        "pages retired after double-bit ECC errors",
        Severity.CRITICAL,
        "reset the GPU to apply the retirement; repeated: inspect hardware",
        volatile=False,
        repair=RepairAction.RESET_GPU,
    ),
)

Change = tuple[Literal["increase", "reset"], int, int]
"""(what, previous value, new value)."""


class CounterTracker:
    """Last values of cumulative counters, persisted under `gpu.counters/<uuid>/<counter>`:
    the value, or [value, boot id] for a volatile counter when the boot id is known."""

    def __init__(self, store: KeyValueStore, boot_id: str | None = None) -> None:
        self._store = store
        self._boot_id = boot_id
        self._last: dict[str, tuple[int, str | None]] = {}
        self._loaded = False

    def _load(self) -> None:
        if not self._loaded:
            for key, value in self._store.items(COUNTERS_NAMESPACE).items():
                if isinstance(value, int):
                    self._last[key] = (value, None)
                elif (
                    isinstance(value, list)
                    and len(value) == 2
                    and isinstance(value[0], int)
                    and isinstance(value[1], str)
                ):
                    self._last[key] = (value[0], value[1])
            self._loaded = True

    def update(self, key: str, value: int, volatile: bool = False) -> Change | None:
        """Record `value`; the change against the last value seen, or None (first or same).
        A volatile counter last seen in another boot restarted at 0 since: a reset."""
        self._load()
        boot = self._boot_id if volatile else None
        last = self._last.get(key)
        if last == (value, boot):
            return None
        stored: JSONValue = value if boot is None else [value, boot]
        # Never raises (the runtime keeps what a full disk refuses and writes it after this
        # round's events), so the round, and every GPU's series in it, stands.
        self._store.put(COUNTERS_NAMESPACE, key, stored)
        self._last[key] = (value, boot)
        if last is None:
            return None  # a baseline: history, not news
        previous, previous_boot = last
        rebooted = boot is not None and previous_boot is not None and previous_boot != boot
        if value < previous or (rebooted and value > 0):
            return ("reset", previous, value)
        if value > previous:
            return ("increase", previous, value)
        return None  # the same value, now stored with the boot id


class ConditionTracker:
    """Which conditions hold per subject (a GPU UUID or `host`), persisted as a sorted list."""

    def __init__(self, store: KeyValueStore) -> None:
        self._store = store
        self._active: dict[str, set[str]] = {}

    def _get(self, subject: str) -> set[str]:
        if subject not in self._active:
            stored = self._store.get(CONDITIONS_NAMESPACE, subject)
            self._active[subject] = {str(v) for v in stored} if isinstance(stored, list) else set()
        return self._active[subject]

    def update(self, subject: str, name: str, holds: bool | None) -> bool | None:
        """True when the condition starts, False when it ends, None when nothing changed
        (or its input is absent)."""
        if holds is None:
            return None
        active = self._get(subject)
        if holds == (name in active):
            return None
        changed = active | {name} if holds else active - {name}
        self._store.put(CONDITIONS_NAMESPACE, subject, sorted(changed))  # never raises
        self._active[subject] = changed
        return holds

    def active(self, subject: str) -> frozenset[str]:
        return frozenset(self._get(subject))


def where(labels: Mapping[str, str]) -> str:
    """'GPU 3 (NVIDIA H200, 0000:3b:00.0, GPU-...)' for messages; a GPU whose identity was
    never read (it hung at its first call) says so instead of three empty fields."""
    if not labels.get("uuid"):
        return f"GPU {labels.get('gpu', '?')} (not identified: its UUID was never read)"
    return (
        f"GPU {labels.get('gpu', '?')} ({labels.get('model', '')}, "
        f"{labels.get('pci_bus_id', '')}, {labels.get('uuid', '')})"
    )


def counter_events(
    tracker: CounterTracker,
    labels: Mapping[str, str],
    reading: GpuReading | GpuSlowReading,
    specs: tuple[CounterSpec, ...],
) -> list[Event]:
    uuid = labels["uuid"]
    values: dict[str, tuple[CounterSpec, int]] = {}
    for spec in specs:
        value = getattr(reading, spec.name, None)
        if isinstance(value, int):
            values[spec.name] = (spec, value)
    if isinstance(reading, GpuSlowReading):
        for link in reading.nvlinks:
            for name, count in link.errors.items():
                spec = CounterSpec(
                    f"nvlink{link.link}_{name}",
                    f"NVLink {link.link} {name} errors",
                    Severity.WARNING,
                    "check the NVLink (Xid 74 in the kernel log); " + RESET_GPU_IF_REPEATS,
                )
                values[spec.name] = (spec, count)
    events: list[Event] = []
    for name, (spec, value) in values.items():
        change = tracker.update(f"{uuid}/{name}", value, spec.volatile)
        if change is None:
            continue
        what, previous, new = change
        attributes: dict[str, AttributeValue] = {
            **labels,
            "counter": name,
            "previous": previous,
            "value": new,
        }
        if what == "reset":
            events.append(
                Event(
                    source=SOURCE,
                    kind="counter_reset",
                    severity=Severity.INFO,
                    repair_action=RepairAction.NONE,
                    subject=uuid,
                    message=f"{where(labels)}: counter {name} restarted (was {previous}, now {new}); "
                    "the host rebooted, the driver was reloaded or the GPU reset. "
                    "New baseline.",
                    attributes=attributes,
                )
            )
        # A volatile counter restarted at 0, so all of its new value came since the reset.
        delta = new - previous if what == "increase" else new if spec.volatile else 0
        if delta > 0:
            events.append(
                Event(
                    source=SOURCE,
                    kind=f"{name}_increase",
                    severity=spec.severity,
                    repair_action=spec.repair,
                    subject=uuid,
                    message=f"{where(labels)}: {delta} new {spec.what} (now {new}"
                    + (", since the counter reset)" if what == "reset" else ")"),
                    action=spec.action,
                    attributes={**attributes, "delta": delta},
                )
            )
    return events


@dataclass(frozen=True, slots=True)
class ConditionSpec:
    name: str
    severity: Severity
    message: str
    action: str
    repair: RepairAction


HW_SLOWDOWN_MASK: Final = (
    CLOCK_EVENT_REASONS["hw_slowdown"]
    | CLOCK_EVENT_REASONS["hw_thermal_slowdown"]
    | CLOCK_EVENT_REASONS["hw_power_brake_slowdown"]
)

CONDITIONS: Final = {
    c.name: c
    for c in (
        ConditionSpec(
            "row_remap_pending",
            Severity.WARNING,
            "a memory row remap is pending; it takes effect at the next GPU reset",
            "drain the GPU and reset it (or reboot) when convenient",
            RepairAction.RESET_GPU,
        ),
        ConditionSpec(
            "row_remap_failure",
            Severity.CRITICAL,
            "a memory row remap failed: the bank has no spare rows left",
            "drain the node and have the GPU inspected or replaced",
            RepairAction.HARDWARE_INSPECTION,
        ),
        ConditionSpec(
            "retired_pages_pending",
            Severity.WARNING,
            "a page retirement is pending; it takes effect at the next GPU reset",
            "drain the GPU and reset it (or reboot) when convenient",
            RepairAction.RESET_GPU,
        ),
        ConditionSpec(
            "pcie_link_degraded",
            Severity.WARNING,
            "the PCIe link runs below its maximum generation or width",
            "reseat the GPU or its riser, check the slot and BIOS PCIe settings; "
            "compare with the other GPUs of the host",
            RepairAction.HARDWARE_INSPECTION,
        ),
        # What the driver says to do (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION): one condition per
        # action, so that a change from one action to another is news too.
        ConditionSpec(
            "recovery_action_gpu_reset",
            Severity.CRITICAL,
            "the driver asks for a GPU reset",
            "drain the GPU, then reset it (nvidia-smi -r -i <gpu>) or reboot the node",
            RepairAction.RESET_GPU,
        ),
        ConditionSpec(
            "recovery_action_node_reboot",
            Severity.CRITICAL,
            "the driver asks for a node reboot",
            "drain the node and reboot it",
            RepairAction.REBOOT_NODE,
        ),
        ConditionSpec(
            "recovery_action_drain_p2p",
            Severity.WARNING,
            "the driver asks to drain peer-to-peer traffic (NVLink/P2P is unusable)",
            "let no new multi-GPU job start on this node; reset the GPU when its jobs end",
            RepairAction.DRAIN_P2P,
        ),
        ConditionSpec(
            "recovery_action_drain_and_reset",
            Severity.CRITICAL,
            "the driver asks to drain the GPU and reset it",
            "let running jobs end or move them, then reset the GPU (nvidia-smi -r) or reboot",
            RepairAction.DRAIN_AND_RESET,
        ),
        ConditionSpec(
            "recovery_action_recover_imex_domain",
            Severity.CRITICAL,
            "the driver asks to recover the IMEX domain",
            "restart the IMEX daemon of the NVLink domain (nvidia-imex) as NVIDIA documents",
            RepairAction.RECOVER_IMEX,
        ),
        ConditionSpec(
            "recovery_action_bus_reset",
            Severity.CRITICAL,
            "the driver asks for a PCIe bus reset of the GPU",
            "drain the node; reset the GPU's bus or reboot the node",
            RepairAction.RESET_GPU,
        ),
        ConditionSpec(
            "recovery_action_system_reboot",
            Severity.CRITICAL,
            "the driver asks for a full system reboot (power cycle)",
            "drain the node and power-cycle it (a warm reboot is not enough)",
            RepairAction.REBOOT_NODE,
        ),
        ConditionSpec(
            "recovery_action_unknown",
            Severity.CRITICAL,
            "the driver asks for a recovery action this gpuwarden does not know",
            "read gpuwarden_gpu_recovery_action_code and NVIDIA's nvml.h for the driver in use; "
            "drain the node",
            RepairAction.REBOOT_NODE,
        ),
        ConditionSpec(
            "hardware_slowdown",
            Severity.WARNING,
            "the hardware is holding the clocks down (thermal, power brake or HW slowdown)",
            "check cooling (inlet temperature, fans) and power supplies",
            RepairAction.CHECK_COOLING,
        ),
    )
}


def pcie_degraded(static: GpuStatic | None, reading: GpuReading) -> bool | None:
    if static is None:
        return None
    width, width_max = reading.pcie_width, static.pcie_width_max
    generation, generation_max = reading.pcie_generation, static.pcie_generation_max
    narrow = None if width is None or width_max is None else width < width_max
    # GPUs lower the link generation to save power when idle, so a slow link only counts while
    # the GPU is busy; a narrower link (fewer lanes) is a fault whatever the load.
    busy = bool(reading.utilization_gpu_ratio) and not (
        (reading.clock_event_reasons or 0) & CLOCK_EVENT_REASONS["gpu_idle"]
    )
    slow = (
        None
        if generation is None or generation_max is None
        else busy and generation < generation_max
    )
    if narrow is None and slow is None:
        return None
    return bool(narrow) or bool(slow)


def condition_inputs(
    static: GpuStatic | None,
    reading: GpuReading,
    slow: GpuSlowReading | None,
    recovery: bool = True,
) -> dict[str, bool | None]:
    """`recovery`: False leaves the recovery-action conditions out (the action did not change
    since they were last judged)."""
    reasons = reading.clock_event_reasons
    return {
        "row_remap_pending": reading.remap_pending,
        "row_remap_failure": reading.remap_failure,
        "retired_pages_pending": None if slow is None else slow.retired_pages_pending,
        "pcie_link_degraded": pcie_degraded(static, reading),
        "hardware_slowdown": None if reasons is None else bool(reasons & HW_SLOWDOWN_MASK),
        **(recovery_inputs(reading.recovery_action) if recovery else {}),
    }


def recovery_inputs(action: int | None) -> dict[str, bool | None]:
    """One condition per action other than none; absent when the driver does not say."""
    inputs: dict[str, bool | None] = {
        f"recovery_action_{name}": None if action is None else action == code
        for code, name in RECOVERY_ACTIONS.items()
        if code != 0
    }
    inputs["recovery_action_unknown"] = None if action is None else action not in RECOVERY_ACTIONS
    return inputs


def condition_events(
    tracker: ConditionTracker,
    labels: Mapping[str, str],
    inputs: Mapping[str, bool | None],
    details: Mapping[str, str] | None = None,
) -> list[Event]:
    uuid = labels["uuid"]
    events: list[Event] = []
    for name, holds in inputs.items():
        started = tracker.update(uuid, name, holds)
        if started is None:
            continue
        spec = CONDITIONS[name]
        detail = (details or {}).get(name, "")
        if started:
            events.append(
                Event(
                    source=SOURCE,
                    kind=name,
                    severity=spec.severity,
                    repair_action=spec.repair,
                    subject=uuid,
                    message=f"{where(labels)}: {spec.message}{detail}",
                    action=spec.action,
                    attributes=dict(labels),
                )
            )
        else:
            events.append(
                Event(
                    source=SOURCE,
                    kind=f"{name}_cleared",
                    severity=Severity.INFO,
                    repair_action=RepairAction.NONE,
                    clears=(name,),
                    subject=uuid,
                    message=f"{where(labels)}: no longer {name.replace('_', ' ')}",
                    attributes=dict(labels),
                )
            )
    return events
