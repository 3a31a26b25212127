"""The gpu collector's metric families, and readings turned into samples (absent -> no sample)."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Final

from agent.contracts.model import GPU_LABELS, MetricFamily, MetricType, Sample
from collectors._nvml import (
    FABRIC_STATES,
    RECOVERY_ACTIONS,
    GpmReading,
    GpuReading,
    GpuSlowReading,
    GpuStatic,
    MigInstance,
    decode_clock_event_reasons,
)

G = MetricType.GAUGE
C = MetricType.COUNTER
L = GPU_LABELS

NVML_UP = MetricFamily(
    "gpuwarden_nvml_up", G, "1 when the NVML library and the NVIDIA driver answer, 0 when not"
)
GPU_COUNT = MetricFamily("gpuwarden_gpus_visible", G, "GPUs visible to NVML")
GPU_EXPECTED = MetricFamily(
    "gpuwarden_gpus_expected", G, "GPUs this host should have (setting expected_gpus)"
)
GPU_EVENT_THREAD_UP = MetricFamily(
    "gpuwarden_gpu_event_thread_up", G, "1 while the NVML event thread (Xid, ECC events) runs"
)
INFO = MetricFamily(
    "gpuwarden_gpu_info",
    G,
    "Static facts of a GPU, always 1",
    (
        *L,
        "driver_version",
        "vbios_version",
        "serial",
        "persistence_mode",
        "mig_mode",
        "ecc_mode",
        "compute_capability",
        "nvml_pci_bus_id",
    ),
)
UP = MetricFamily(
    "gpuwarden_gpu_up", G, "1 when the GPU answered NVML this round, 0 when lost or unresponsive", L
)
ERROR = MetricFamily(
    "gpuwarden_gpu_error",
    G,
    "1 while the GPU is in this error state (lost, unresponsive, error)",
    (*L, "reason"),
)
FIELD_ERROR = MetricFamily(
    "gpuwarden_gpu_field_error",
    G,
    "1 while reading this NVML field fails with an unexpected error",
    (*L, "field"),
)
TEMPERATURE = MetricFamily(
    "gpuwarden_gpu_temperature_celsius",
    G,
    "Temperature of the GPU die or its memory",
    (*L, "sensor"),
    "celsius",
)
TEMPERATURE_THRESHOLD = MetricFamily(
    "gpuwarden_gpu_temperature_threshold_celsius",
    G,
    "NVML temperature thresholds: slowdown, shutdown, gpu_max, memory_max",
    (*L, "threshold"),
    "celsius",
)
POWER = MetricFamily("gpuwarden_gpu_power_watts", G, "Power draw", L, "watts")
POWER_LIMIT = MetricFamily("gpuwarden_gpu_power_limit_watts", G, "Enforced power limit", L, "watts")
ENERGY = MetricFamily(
    "gpuwarden_gpu_energy_joules_total",
    C,
    "Energy used since the driver loaded (read every energy_interval)",
    L,
    "joules",
)
CLOCK = MetricFamily("gpuwarden_gpu_clock_hertz", G, "Current clock", (*L, "clock"), "hertz")
CLOCK_MAX = MetricFamily(
    "gpuwarden_gpu_clock_max_hertz", G, "Maximum clock", (*L, "clock"), "hertz"
)
CLOCK_EVENT = MetricFamily(
    "gpuwarden_gpu_clock_event_active",
    G,
    "1 while this clock event (throttle) reason holds the clocks down, else 0",
    (*L, "reason"),
)
UTILIZATION = MetricFamily(
    "gpuwarden_gpu_utilization_ratio",
    G,
    "Busy share of the last sample period, 0 to 1",
    (*L, "resource"),
    "ratio",
)
MEMORY_TOTAL = MetricFamily(
    "gpuwarden_gpu_memory_total_bytes", G, "GPU memory (framebuffer) size", L, "bytes"
)
MEMORY_USED = MetricFamily("gpuwarden_gpu_memory_used_bytes", G, "GPU memory in use", L, "bytes")
MEMORY_RESERVED = MetricFamily(
    "gpuwarden_gpu_memory_reserved_bytes",
    G,
    "GPU memory reserved by the driver and firmware",
    L,
    "bytes",
)
PCIE_GENERATION = MetricFamily(
    "gpuwarden_gpu_pcie_link_generation", G, "PCIe link generation, current and max", (*L, "which")
)
PCIE_WIDTH = MetricFamily(
    "gpuwarden_gpu_pcie_link_width_lanes",
    G,
    "PCIe link width in lanes, current and max",
    (*L, "which"),
)
PROCESSES = MetricFamily(
    "gpuwarden_gpu_compute_processes", G, "Compute processes running on the GPU", L
)
ECC = MetricFamily(
    "gpuwarden_gpu_ecc_errors_total",
    C,
    "ECC errors; volatile since the driver loaded, aggregate over the GPU's life",
    (*L, "type", "counter"),
)
REMAPPED_ROWS = MetricFamily(
    "gpuwarden_gpu_remapped_rows_total",
    C,
    "Memory rows remapped, by the error that caused it",
    (*L, "cause"),
)
REMAP_PENDING = MetricFamily(
    "gpuwarden_gpu_row_remap_pending", G, "1 when a row remap waits for a GPU reset", L
)
REMAP_FAILURE = MetricFamily(
    "gpuwarden_gpu_row_remap_failure", G, "1 when a row remap failed (the GPU needs service)", L
)
RETIRED_PAGES = MetricFamily(
    "gpuwarden_gpu_retired_pages_total",
    C,
    "Memory pages retired (GPUs before Hopper)",
    (*L, "cause"),
)
RETIRED_PENDING = MetricFamily(
    "gpuwarden_gpu_retired_pages_pending", G, "1 when a page retirement waits for a GPU reset", L
)
PCIE_REPLAYS = MetricFamily(
    "gpuwarden_gpu_pcie_replays_total", C, "PCIe replays (link-level retransmissions)", L
)
NVLINK_UP = MetricFamily("gpuwarden_gpu_nvlink_up", G, "1 when the NVLink is active", (*L, "link"))
NVLINK_ERRORS = MetricFamily(
    "gpuwarden_gpu_nvlink_errors_total", C, "NVLink data-link errors by type", (*L, "link", "type")
)
PROCESS_LABELS: Final = ("pid", "process", "user", "unit", "container_id", "pod_uid")
PROCESS_MEMORY = MetricFamily(
    "gpuwarden_gpu_process_memory_used_bytes",
    G,
    "GPU memory of a compute process, with its owner from /proc/<pid>/cgroup "
    "(the top_processes largest per GPU)",
    (*L, *PROCESS_LABELS),
    "bytes",
)
GPUS_PCI = MetricFamily(
    "gpuwarden_gpus_pci",
    G,
    "NVIDIA GPU functions on the PCI bus (sysfs), passed-through ones apart",
)
GPUS_PCI_PASSTHROUGH = MetricFamily(
    "gpuwarden_gpus_pci_passthrough",
    G,
    "NVIDIA GPU functions bound to vfio-pci or pci-stub (held for a virtual machine)",
)
NVSWITCHES_PCI = MetricFamily(
    "gpuwarden_nvswitches_pci", G, "NVIDIA NVSwitch functions on the PCI bus (sysfs)"
)
PCI_NOT_VISIBLE = MetricFamily(
    "gpuwarden_gpu_pci_not_visible",
    G,
    "1 for a GPU on the PCI bus that NVML does not see (it never enumerated)",
    ("pci_bus_id", "driver"),
)
RECOVERY_ACTION = MetricFamily(
    "gpuwarden_gpu_recovery_action",
    G,
    "1 for the recovery action the driver asks for (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION), "
    "0 for the others",
    (*L, "action"),
)
RECOVERY_ACTION_CODE = MetricFamily(
    "gpuwarden_gpu_recovery_action_code",
    G,
    "The raw NVML recovery action value (0: none), for values newer than this agent",
    L,
)
FABRIC_STATE = MetricFamily(
    "gpuwarden_gpu_fabric_state",
    G,
    "1 for the GPU's NVLink fabric registration state (nvmlDeviceGetGpuFabricInfo), 0 for others",
    (*L, "state"),
)
FABRIC_STATUS = MetricFamily(
    "gpuwarden_gpu_fabric_status_code",
    G,
    "NVML return code of the fabric registration (0: success)",
    L,
)
ACTIVITY = MetricFamily(
    "gpuwarden_gpu_activity_ratio",
    G,
    "GPM activity over the last gpm_interval, 0 to 1: graphics_active, sm_active, sm_occupancy, "
    "tensor_active, dram_active",
    (*L, "metric"),
    "ratio",
)
THROUGHPUT = MetricFamily(
    "gpuwarden_gpu_throughput_bytes_per_second",
    G,
    "GPM PCIe and NVLink throughput over the last gpm_interval",
    (*L, "bus", "direction"),
)
MIG_LABELS: Final = (*L, "gpu_instance", "profile")
"""A MIG GPU instance's series: its GPU's labels, its id and its profile (`1g.18gb`)."""
MIG_INFO = MetricFamily(
    "gpuwarden_gpu_mig_device_info",
    G,
    "1 for each MIG device (a compute instance of a GPU instance) of a GPU in MIG mode",
    (*L, "gpu_instance", "compute_instance", "profile", "mig_uuid"),
)
MIG_MEMORY_TOTAL = MetricFamily(
    "gpuwarden_gpu_mig_memory_total_bytes",
    G,
    "Memory of a MIG GPU instance (shared by its compute instances)",
    MIG_LABELS,
    "bytes",
)
MIG_MEMORY_USED = MetricFamily(
    "gpuwarden_gpu_mig_memory_used_bytes",
    G,
    "Memory in use in a MIG GPU instance",
    MIG_LABELS,
    "bytes",
)
MIG_MEMORY_FREE = MetricFamily(
    "gpuwarden_gpu_mig_memory_free_bytes",
    G,
    "Memory free in a MIG GPU instance",
    MIG_LABELS,
    "bytes",
)
MIG_ACTIVITY = MetricFamily(
    "gpuwarden_gpu_mig_activity_ratio",
    G,
    "GPM activity of a MIG GPU instance over the last gpm_interval, 0 to 1 (the metrics of "
    "gpuwarden_gpu_activity_ratio)",
    (*MIG_LABELS, "metric"),
    "ratio",
)
MIG_THROUGHPUT = MetricFamily(
    "gpuwarden_gpu_mig_throughput_bytes_per_second",
    G,
    "GPM PCIe and NVLink throughput of a MIG GPU instance over the last gpm_interval",
    (*MIG_LABELS, "bus", "direction"),
)

FAMILIES: Final[Sequence[MetricFamily]] = (
    NVML_UP,
    GPU_COUNT,
    GPU_EXPECTED,
    GPU_EVENT_THREAD_UP,
    INFO,
    UP,
    ERROR,
    FIELD_ERROR,
    TEMPERATURE,
    TEMPERATURE_THRESHOLD,
    POWER,
    POWER_LIMIT,
    ENERGY,
    CLOCK,
    CLOCK_MAX,
    CLOCK_EVENT,
    UTILIZATION,
    MEMORY_TOTAL,
    MEMORY_USED,
    MEMORY_RESERVED,
    PCIE_GENERATION,
    PCIE_WIDTH,
    PROCESSES,
    ECC,
    REMAPPED_ROWS,
    REMAP_PENDING,
    REMAP_FAILURE,
    RETIRED_PAGES,
    RETIRED_PENDING,
    PCIE_REPLAYS,
    NVLINK_UP,
    NVLINK_ERRORS,
    PROCESS_MEMORY,
    GPUS_PCI,
    GPUS_PCI_PASSTHROUGH,
    NVSWITCHES_PCI,
    PCI_NOT_VISIBLE,
    RECOVERY_ACTION,
    RECOVERY_ACTION_CODE,
    FABRIC_STATE,
    FABRIC_STATUS,
    ACTIVITY,
    THROUGHPUT,
    MIG_INFO,
    MIG_MEMORY_TOTAL,
    MIG_MEMORY_USED,
    MIG_MEMORY_FREE,
    MIG_ACTIVITY,
    MIG_THROUGHPUT,
)


def _flag(value: bool | None) -> str:
    return "" if value is None else ("enabled" if value else "disabled")


class SampleMemo:
    """One GPU's samples of the last round, by series. A value that did not change gives the
    same Sample again: most values of a steady round do not change, and finding a sample costs
    less than making one (bench/gpu_round.py). Emptied when the GPU's labels change, so it
    holds at most one round's series."""

    __slots__ = ("base", "series")

    def __init__(self) -> None:
        self.base: tuple[str, ...] = ()
        self.series: dict[tuple[str, tuple[str, ...]], Sample] = {}


class _Out:
    """Samples of one GPU: `add` leaves absent values out."""

    def __init__(self, labels: Mapping[str, str], memo: SampleMemo | None = None) -> None:
        self.base = tuple(labels[name] for name in GPU_LABELS)
        self.samples: list[Sample] = []
        self._memo: dict[tuple[str, tuple[str, ...]], Sample] | None = None
        if memo is not None:
            if memo.base != self.base:
                memo.base = self.base
                memo.series.clear()
            self._memo = memo.series

    def add(self, family: MetricFamily, value: float | bool | None, *extra: str) -> None:
        if value is None:
            return
        value = float(value)
        memo = self._memo
        if memo is None:
            self.samples.append(Sample(family, (*self.base, *extra), value))
            return
        key = (family.name, extra)
        sample = memo.get(key)
        # NaN never equals itself, so it is made (and refused) again; 0.0 and -0.0 are equal
        # but print apart, so a zero's sign is compared too.
        if (
            sample is None
            or sample.value != value
            or (value == 0.0 and math.copysign(1.0, sample.value) != math.copysign(1.0, value))
        ):
            sample = memo[key] = Sample(family, (*self.base, *extra), value)
        self.samples.append(sample)


def nvml_pci_bus_id(linux_form: str) -> str:
    """`0000:3b:00.0` -> `00000000:3B:00.0`, NVML's own busId form (which DCGM and nvidia-smi
    print); "" for an unknown address. On the info series because PromQL cannot upper-case a
    label, so rules that rebuild dcgm-exporter's series (configs/prometheus) join on it."""
    if not linux_form:
        return ""
    domain, rest = linux_form.split(":", 1)
    return f"{int(domain, 16):08X}:{rest.upper()}"


def static_samples(labels: Mapping[str, str], static: GpuStatic) -> list[Sample]:
    out = _Out(labels)
    out.add(
        INFO,
        1,
        static.driver_version or "",
        static.vbios_version or "",
        static.serial or "",
        _flag(static.persistence_mode),
        _flag(static.mig_mode),
        _flag(static.ecc_mode),
        static.compute_capability or "",
        nvml_pci_bus_id(labels["pci_bus_id"]),
    )
    for name, value in (
        ("slowdown", static.temperature_slowdown_celsius),
        ("shutdown", static.temperature_shutdown_celsius),
        ("gpu_max", static.temperature_gpu_max_celsius),
        ("memory_max", static.temperature_memory_max_celsius),
    ):
        out.add(TEMPERATURE_THRESHOLD, value, name)
    out.add(CLOCK_MAX, static.sm_clock_max_hertz, "sm")
    out.add(CLOCK_MAX, static.memory_clock_max_hertz, "memory")
    out.add(PCIE_GENERATION, static.pcie_generation_max, "max")
    out.add(PCIE_WIDTH, static.pcie_width_max, "max")
    return out.samples


@functools.lru_cache(maxsize=64)
def _clock_event_reasons(mask: int) -> tuple[tuple[str, bool], ...]:
    """The decoded mask, once per mask: it is the same round after round."""
    return tuple(decode_clock_event_reasons(mask).items())


def reading_samples(
    labels: Mapping[str, str],
    r: GpuReading,
    energy_joules: float | None = None,
    memo: SampleMemo | None = None,
) -> list[Sample]:
    """`energy_joules`: the last energy reading (it is read on its own, slower interval).
    `memo`: the GPU's samples of its last round, to reuse where a value did not change."""
    out = _Out(labels, memo)
    out.add(ENERGY, energy_joules)
    out.add(TEMPERATURE, r.temperature_gpu_celsius, "gpu")
    out.add(TEMPERATURE, r.temperature_memory_celsius, "memory")
    out.add(POWER, r.power_draw_watts)
    out.add(POWER_LIMIT, r.power_limit_watts)
    out.add(CLOCK, r.sm_clock_hertz, "sm")
    out.add(CLOCK, r.memory_clock_hertz, "memory")
    if r.clock_event_reasons is not None:
        for reason, active in _clock_event_reasons(r.clock_event_reasons):
            out.add(CLOCK_EVENT, active, reason)
    out.add(UTILIZATION, r.utilization_gpu_ratio, "gpu")
    out.add(UTILIZATION, r.utilization_memory_ratio, "memory")
    out.add(MEMORY_TOTAL, r.memory_total_bytes)
    out.add(MEMORY_USED, r.memory_used_bytes)
    out.add(MEMORY_RESERVED, r.memory_reserved_bytes)
    out.add(PCIE_GENERATION, r.pcie_generation, "current")
    out.add(PCIE_WIDTH, r.pcie_width, "current")
    out.add(PROCESSES, r.compute_processes)
    out.add(ECC, r.ecc_corrected_volatile, "corrected", "volatile")
    out.add(ECC, r.ecc_uncorrected_volatile, "uncorrected", "volatile")
    out.add(ECC, r.ecc_corrected_aggregate, "corrected", "aggregate")
    out.add(ECC, r.ecc_uncorrected_aggregate, "uncorrected", "aggregate")
    out.add(REMAPPED_ROWS, r.remapped_rows_correctable, "correctable")
    out.add(REMAPPED_ROWS, r.remapped_rows_uncorrectable, "uncorrectable")
    out.add(REMAP_PENDING, r.remap_pending)
    out.add(REMAP_FAILURE, r.remap_failure)
    return out.samples


def recovery_samples(labels: Mapping[str, str], action: int | None) -> list[Sample]:
    out = _Out(labels)
    if action is not None:
        out.add(RECOVERY_ACTION_CODE, action)
        for code, name in RECOVERY_ACTIONS.items():
            out.add(RECOVERY_ACTION, code == action, name)
    return out.samples


def gpm_samples(labels: Mapping[str, str], g: GpmReading) -> list[Sample]:
    out = _Out(labels)
    for name, ratio in g.ratios.items():
        out.add(ACTIVITY, ratio, name)
    for (bus, direction), rate in g.throughputs.items():
        out.add(THROUGHPUT, rate, bus, direction)
    return out.samples


def mig_samples(labels: Mapping[str, str], instances: Sequence[MigInstance]) -> list[Sample]:
    """Series of a GPU's MIG instances: one set per GPU instance, one info per device. Memory
    is the GPU instance's, never repeated per compute instance (a sum over a GPU's instances
    would count it twice)."""
    out = _Out(labels)
    for gi in instances:
        instance = (str(gi.gpu_instance), gi.profile)
        for device in gi.compute_instances:
            out.add(
                MIG_INFO,
                1,
                str(gi.gpu_instance),
                str(device.compute_instance),
                device.profile,
                device.uuid,
            )
        out.add(MIG_MEMORY_TOTAL, gi.memory_total_bytes, *instance)
        out.add(MIG_MEMORY_USED, gi.memory_used_bytes, *instance)
        out.add(MIG_MEMORY_FREE, gi.memory_free_bytes, *instance)
        if gi.gpm is not None:
            for name, ratio in gi.gpm.ratios.items():
                out.add(MIG_ACTIVITY, ratio, *instance, name)
            for (bus, direction), rate in gi.gpm.throughputs.items():
                out.add(MIG_THROUGHPUT, rate, *instance, bus, direction)
    return out.samples


def process_sample(labels: Mapping[str, str], used_bytes: float, *owner: str) -> Sample:
    """`owner`: the PROCESS_LABELS values."""
    return Sample(PROCESS_MEMORY, (*(labels[n] for n in GPU_LABELS), *owner), used_bytes)


def slow_samples(labels: Mapping[str, str], s: GpuSlowReading) -> list[Sample]:
    out = _Out(labels)
    out.add(PCIE_REPLAYS, s.pcie_replays)
    out.add(RETIRED_PAGES, s.retired_pages_single_bit, "single_bit")
    out.add(RETIRED_PAGES, s.retired_pages_double_bit, "double_bit")
    out.add(RETIRED_PENDING, s.retired_pages_pending)
    for link in s.nvlinks:
        out.add(NVLINK_UP, link.up, str(link.link))
        for name, count in link.errors.items():
            out.add(NVLINK_ERRORS, count, str(link.link), name)
    if s.fabric_state is not None:
        for code, name in FABRIC_STATES.items():
            out.add(FABRIC_STATE, code == s.fabric_state, name)
        out.add(FABRIC_STATUS, s.fabric_status)
    return out.samples


def error_samples(labels: Mapping[str, str], errors: Mapping[str, str]) -> list[Sample]:
    out = _Out(labels)
    for name in sorted(errors):
        out.add(FIELD_ERROR, 1, name)
    return out.samples


def state_samples(
    labels: Mapping[str, str], error_reason: str | None, memo: SampleMemo | None = None
) -> list[Sample]:
    out = _Out(labels, memo)
    out.add(UP, error_reason is None)
    if error_reason is not None:
        out.add(ERROR, 1, error_reason)
    return out.samples
