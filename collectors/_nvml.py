"""NVML behind one small interface: typed readings, and every NVML error mapped in one place.

`NvmlBackend` wraps a pynvml-shaped library: the real `pynvml` module (from nvidia-ml-py) or
`collectors.nvml_fake.FakeNvml`. Every NVML call goes through `_Funnel.get`, which turns the
error codes into the three outcomes the agent knows (docs/ARCHITECTURE.md, "value, absent or
error") plus two states of a whole GPU or of the whole library:

- not supported / not found / no data -> absent (`None`), never 0;
- GPU lost (or needing a reset) -> `GpuLost`, raised for the whole GPU;
- library or driver missing / not initialised -> `NvmlUnavailable`, raised for the whole backend,
  which then marks itself down so that `start()` can be retried (a driver can be reloaded);
- anything else -> the field is absent and its error is recorded in the reading's `errors`.

One backend per process, shared through `deps.shared.get(NvmlBackend, NvmlBackend)` so that
the gpu collector, the benchmark's idle gate and the event thread share one `nvmlInit`. NVML
itself is thread-safe; the lock here only guards init and shutdown.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

import pynvml

from agent.contracts.errors import GpuwardenError
from collectors._xid import normalize_pci_bus_id

T = TypeVar("T")

ABSENT_CODES: Final = frozenset(
    {
        pynvml.NVML_ERROR_NOT_SUPPORTED,
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,  # an older driver without this entry point
        pynvml.NVML_ERROR_NOT_FOUND,
        pynvml.NVML_ERROR_NO_DATA,
        pynvml.NVML_ERROR_DEPRECATED,
    }
)
LOST_CODES: Final = frozenset(
    {
        pynvml.NVML_ERROR_GPU_IS_LOST,
        pynvml.NVML_ERROR_RESET_REQUIRED,
        pynvml.NVML_ERROR_GPU_NOT_FOUND,
    }
)
UNAVAILABLE_CODES: Final = frozenset(
    {
        pynvml.NVML_ERROR_UNINITIALIZED,
        pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
        pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
        pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
    }
)

# Bits of nvmlDeviceGetCurrentClocksEventReasons (nvml.h, "Clocks Event Reasons"): the reason
# names are the metric's label values.
CLOCK_EVENT_REASONS: Final[Mapping[str, int]] = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
}

EVENT_XID: Final = int(pynvml.nvmlEventTypeXidCriticalError)
EVENT_SINGLE_BIT_ECC: Final = int(pynvml.nvmlEventTypeSingleBitEccError)
EVENT_DOUBLE_BIT_ECC: Final = int(pynvml.nvmlEventTypeDoubleBitEccError)

# NVML counts NVLinks 0..NVML_NVLINK_MAX_LINKS-1; a GPU without NVLink answers not supported
# on link 0 (the lent H200 does), so the loop stops at the first absent link.
_NVLINK_ERROR_COUNTERS: Final = {
    "replay": pynvml.NVML_NVLINK_ERROR_DL_REPLAY,
    "recovery": pynvml.NVML_NVLINK_ERROR_DL_RECOVERY,
    "crc_flit": pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT,
    "crc_data": pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA,
}


# The numbers below are nvml.h's, written out rather than read from pynvml: nvidia-ml-py
# releases older than the driver lack the newest names (13.610 has no
# NVML_GPU_RECOVERY_ACTION_BUS_RESET), and a missing name must cost one reading, never the
# import of the whole agent. tests/test_nvml_constants.py holds them to pynvml's where it has them.

FIELD_GPU_RECOVERY_ACTION: Final = 230
"""NVML_FI_DEV_GET_GPU_RECOVERY_ACTION."""
GPM_METRICS_GET_VERSION: Final = 1
"""NVML_GPM_METRICS_GET_VERSION."""
_HAS_GPM_API: Final = all(
    hasattr(pynvml, name)
    for name in ("c_nvmlGpmMetricsGet_t", "nvmlGpmQueryDeviceSupport", "nvmlGpmSampleAlloc")
)
"""The nvidia-ml-py in use knows GPM (older releases do not: then GPM reads are absent)."""

# NVML_FI_DEV_GET_GPU_RECOVERY_ACTION values (nvml.h, nvmlDeviceGpuRecoveryAction_t): what the
# driver says to do with the GPU. Names are the metric's label values.
RECOVERY_ACTIONS: Final[Mapping[int, str]] = {
    0: "none",
    1: "gpu_reset",
    2: "node_reboot",
    3: "drain_p2p",
    4: "drain_and_reset",
    # Added by drivers after R570 (nvml.h of 580): the IMEX domain, a bus reset, a full
    # system (power) reboot rather than a warm one.
    5: "recover_imex_domain",
    6: "bus_reset",
    7: "system_reboot",
}

# nvmlGpuFabricState_t; NOT_SUPPORTED (0) reads as absent.
FABRIC_STATES: Final[Mapping[int, str]] = {
    1: "not_started",
    2: "in_progress",
    3: "completed",
}

# GPM metrics read (nvml.h, "GPM Metric Identifiers"): name -> id. Ratios are NVML percentages
# (0-100) divided by 100; throughputs NVML MiB/s times 2**20.
GPM_RATIOS: Final[Mapping[str, int]] = {
    "graphics_active": 1,
    "sm_active": 2,
    "sm_occupancy": 3,
    "tensor_active": 5,
    "dram_active": 10,
}
GPM_THROUGHPUTS: Final[Mapping[tuple[str, str], int]] = {
    ("pcie", "tx"): 20,
    ("pcie", "rx"): 21,
    ("nvlink", "tx"): 61,
    ("nvlink", "rx"): 60,
}
_GPM_IDS: Final = (*GPM_RATIOS.values(), *GPM_THROUGHPUTS.values())
_MIB: Final = float(2**20)
DEVICE_PREFIX: Final = "/dev/nvidia"
"""The NVIDIA device files (nvidiactl, nvidia0.., nvidia-uvm, nvidia-caps/...) NVML opens."""

INSTANCE_ID_NONE: Final = 0xFFFFFFFF
"""NVML_GPU_INSTANCE_ID_ANY / NVML_COMPUTE_INSTANCE_ID_ANY: what nvmlEventData_t's
gpuInstanceId and computeInstanceId hold for an event no MIG instance is named in."""
_MIG_NAME: Final = re.compile(r"\bMIG\s+(?P<profile>\S+)\s*$")
"""A MIG device's nvmlDeviceGetName: `NVIDIA H200 MIG 1g.18gb`, `... MIG 1c.2g.35gb` (a compute
instance smaller than its GPU instance), the profile as `nvidia-smi -L` shows it."""
_CI_PREFIX: Final = re.compile(r"^\d+c\.")


class NvmlError(GpuwardenError):
    """Base of the errors this module raises."""


class NvmlUnavailable(NvmlError):
    """The NVML library or the NVIDIA driver is missing, or NVML is not initialised."""

    def __init__(self, reason: str, code: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code


class NvmlPaused(NvmlUnavailable):
    """NVML is held shut on purpose (`gpuwarden pause`): no call and no nvmlInit until the
    hold is released. A subclass of NvmlUnavailable, so that a user of the backend that does
    not know of pauses reads it as "no driver" and leaves the GPUs alone."""


class GpuLost(NvmlError):
    """The GPU stopped answering NVML (fallen off the bus, needs a reset)."""

    def __init__(self, index: int, reason: str, code: int | None = None) -> None:
        super().__init__(f"GPU {index}: {reason}")
        self.index = index
        self.reason = reason
        self.code = code


def error_code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def decode_clock_event_reasons(mask: int) -> dict[str, bool]:
    """A reasons bit mask -> {reason: active} for every known reason."""
    return {name: bool(mask & bit) for name, bit in CLOCK_EVENT_REASONS.items()}


@dataclass(frozen=True, slots=True)
class GpuIdentity:
    index: int
    uuid: str
    name: str
    pci_bus_id: str
    """Linux form, `0000:3b:00.0` (normalize_pci_bus_id), as the kernel log and sysfs write it."""

    def labels(self) -> dict[str, str]:
        """The GPU_LABELS of every per-GPU series."""
        return {
            "gpu": str(self.index),
            "uuid": self.uuid,
            "pci_bus_id": self.pci_bus_id,
            "model": self.name,
        }


@dataclass(frozen=True, slots=True)
class GpuStatic:
    """Facts that change only with a driver, a firmware or an admin command: read rarely."""

    identity: GpuIdentity
    driver_version: str | None = None
    serial: str | None = None
    vbios_version: str | None = None
    persistence_mode: bool | None = None
    mig_mode: bool | None = None
    ecc_mode: bool | None = None
    compute_capability: str | None = None
    temperature_slowdown_celsius: float | None = None
    temperature_shutdown_celsius: float | None = None
    temperature_gpu_max_celsius: float | None = None
    temperature_memory_max_celsius: float | None = None
    sm_clock_max_hertz: float | None = None
    memory_clock_max_hertz: float | None = None
    pcie_generation_max: int | None = None
    pcie_width_max: int | None = None
    supported_event_types: int | None = None
    errors: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """A compute process on a GPU, as NVML lists it."""

    pid: int
    used_memory_bytes: float | None
    """None where NVML cannot tell (NVML_VALUE_NOT_AVAILABLE)."""


@dataclass(frozen=True, slots=True)
class GpmReading:
    """GPM metrics between this GPU's last two samples; empty after the first sample."""

    ratios: Mapping[str, float] = field(default_factory=dict)
    throughputs: Mapping[tuple[str, str], float] = field(default_factory=dict)
    """(bus, direction) -> bytes per second."""
    errors: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class MigDevice:
    """One MIG device: a compute instance inside a GPU instance, as NVML lists it under its GPU."""

    gpu_instance: int
    compute_instance: int
    uuid: str
    profile: str
    """As `nvidia-smi -L` shows it: `1g.18gb`, or `1c.2g.35gb` for a compute instance smaller
    than its GPU instance; "" where the name does not say."""


@dataclass(frozen=True, slots=True)
class MigInstance:
    """One GPU instance: its memory (its compute instances share it) and its GPM activity."""

    gpu_instance: int
    profile: str
    """The GPU instance's profile (`2g.35gb`: its compute instances' names without `Nc.`)."""
    compute_instances: tuple[MigDevice, ...]
    memory_total_bytes: float | None = None
    memory_used_bytes: float | None = None
    memory_free_bytes: float | None = None
    gpm: GpmReading | None = None
    """When GPM was asked for and this instance gives it (nvmlGpmMigSampleGet)."""


@dataclass(frozen=True, slots=True)
class MigReading:
    """The MIG instances of a GPU in MIG mode, by GPU instance id."""

    instances: tuple[MigInstance, ...] = ()
    errors: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class GpuReading:
    """Fast readings (a few µs each on an H200, docs/MEASUREMENTS.md): every round."""

    temperature_gpu_celsius: float | None = None
    temperature_memory_celsius: float | None = None
    power_draw_watts: float | None = None
    power_limit_watts: float | None = None
    sm_clock_hertz: float | None = None
    memory_clock_hertz: float | None = None
    clock_event_reasons: int | None = None
    utilization_gpu_ratio: float | None = None
    utilization_memory_ratio: float | None = None
    memory_total_bytes: float | None = None
    memory_used_bytes: float | None = None
    memory_reserved_bytes: float | None = None
    pcie_generation: int | None = None
    pcie_width: int | None = None
    compute_processes: int | None = None
    processes: tuple[GpuProcess, ...] | None = None
    recovery_action: int | None = None
    """NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (RECOVERY_ACTIONS); read with the memory temperature
    in one field-values call, so it costs no call of its own."""
    energy_joules: float | None = None
    """Only when asked for (about 3.3 ms per call on the H200): since the driver loaded."""
    ecc_corrected_volatile: int | None = None
    ecc_uncorrected_volatile: int | None = None
    ecc_corrected_aggregate: int | None = None
    ecc_uncorrected_aggregate: int | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    errors: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class NvLinkReading:
    link: int
    up: bool
    errors: Mapping[str, int] = field(default_factory=dict)
    """Counter name (replay, recovery, crc_flit, crc_data) -> count; unsupported ones left out."""


@dataclass(frozen=True, slots=True)
class GpuSlowReading:
    """Costly readings (PCIe replays about 400 µs, retired pages about 120 µs): a slower interval."""

    pcie_replays: int | None = None
    retired_pages_single_bit: int | None = None
    retired_pages_double_bit: int | None = None
    retired_pages_pending: bool | None = None
    nvlinks: tuple[NvLinkReading, ...] = ()
    fabric_state: int | None = None
    """nvmlDeviceGetGpuFabricInfo's state (FABRIC_STATES); None where there is no fabric."""
    fabric_status: int | None = None
    """The NVML return code of the fabric registration (0: success)."""
    errors: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class GpuRound:
    """What one per-GPU call returns: static and slow parts only when asked for."""

    index: int
    reading: GpuReading
    static: GpuStatic | None = None
    slow: GpuSlowReading | None = None
    energy_read: bool = False
    """True when the energy counter was asked for (its value may still be absent)."""
    gpm: GpmReading | None = None
    """When GPM was asked for and the GPU supports it."""
    gpm_read: bool = False
    """True when GPM was asked for (`gpm` is None on a GPU without GPM)."""
    mig: MigReading | None = None
    """The GPU's MIG instances when it is in MIG mode; None when it is not (or not asked)."""


@dataclass(frozen=True, slots=True)
class NvmlEventRecord:
    pci_bus_id: str
    event_type: int
    data: int
    """For an Xid event, the Xid code."""
    gpu_instance: int | None = None
    """The MIG GPU instance the driver attributed the event to; None: none named."""
    compute_instance: int | None = None


class _Funnel:
    """The one place NVML errors are mapped. One funnel per GPU read collects field errors."""

    def __init__(self, index: int | None = None) -> None:
        self.index = index
        self.errors: dict[str, str] = {}

    def get(self, name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        try:
            return fn(*args, **kwargs)
        except pynvml.NVMLError as exc:
            code = error_code(exc)
            if code in ABSENT_CODES:
                return None
            if code in LOST_CODES:
                raise GpuLost(
                    self.index if self.index is not None else -1, str(exc), code
                ) from None
            if code in UNAVAILABLE_CODES:
                raise NvmlUnavailable(str(exc), code) from None
            self.errors[name] = str(exc)
            return None


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else float(value) * factor


def _milli(value: float | None) -> float | None:
    """mW -> W, mJ -> J (a division keeps 78820 mW at 78.82 W, not 78.82000000000001)."""
    return None if value is None else float(value) / 1000.0


class NvmlBackend:
    """NVML for the whole process. Methods taking an index raise `GpuLost` or `NvmlUnavailable`.

    `lib` is the pynvml module or a `FakeNvml`; it is typed loosely because pynvml ships no types.
    """

    def __init__(self, lib: Any = None) -> None:
        self.lib: Any = pynvml if lib is None else lib
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        """Notified when a call ends: hold() waits for the calls in flight."""
        self._in_flight = 0
        self._started = False
        self._gpm: dict[int, _GpmState] = {}
        """GPU index -> its GPM support and samples; reset by stop() (indexes may change)."""
        self._mig_gpm: dict[int, dict[int, _GpmState]] = {}
        """GPU index -> GPU instance id -> that instance's GPM samples (MIG mode only)."""
        self._mig_devices: dict[int, dict[str, MigDevice]] = {}
        """GPU index -> MIG device UUID -> the device (ids and profile), read once each."""
        self._handles: dict[int, Any] = {}
        self._count: int | None = None
        """The GPU count NVML gave last; when it changes, the handles are looked up again."""
        """GPU index -> its NVML handle, looked up once per nvmlInit: NVML numbers the GPUs at
        init, and the lookup is a driver call (about 40 us once a second on an H200) that every
        read of the GPU would otherwise repeat. Forgotten by stop(), when the GPU is lost and
        when the count changes."""
        self._link_widths: dict[int, tuple[int | None, str | None]] = {}
        """GPU index -> (current PCIe link width, the read's error), read with the slow reads:
        the width changes only when the link trains again, and its read is the costliest of a
        round (33 us back to back, 93 us once a second on an H200, where the other fast reads
        take 2-12 us). The generation, which the GPU lowers when idle, is read every round."""
        self._held = ""
        """Why NVML is held shut (a pause); "" when it is not."""
        self.device_prefix = DEVICE_PREFIX
        """Where this library's device files are (tests point it at a fake's)."""

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def up(self) -> bool:
        return self._started

    @property
    def held(self) -> bool:
        return bool(self._held)

    def hold(self, reason: str, timeout: float) -> bool:
        """Shut NVML and keep it shut: until `release`, `start` and every call raise
        NvmlPaused, whoever in the process asks (the benchmark's idle gate too). New calls
        are refused at once; the calls in flight are waited for, up to `timeout` seconds,
        because nvmlShutdown under a call is not safe. False when some still run then (a call
        that hangs in the driver): NVML stays initialised, and held."""
        with self._idle:
            self._held = reason or "paused"
            if not self._idle.wait_for(lambda: self._in_flight == 0, timeout):
                return False
        self.stop()
        return True

    def release(self) -> None:
        """Lift the hold; the next `start` initialises NVML again."""
        with self._lock:
            self._held = ""

    def start(self) -> None:
        """nvmlInit, once; raises NvmlUnavailable (retry later: the driver may be loaded then)."""
        with self._lock:
            if self._held:
                raise NvmlPaused(f"NVML is released on request ({self._held})")
            if self._started:
                return
            try:
                self.lib.nvmlInit()
            except pynvml.NVMLError as exc:
                raise NvmlUnavailable(str(exc), error_code(exc)) from None
            except OSError as exc:  # a broken libnvidia-ml.so that the loader rejects
                raise NvmlUnavailable(f"NVML library failed to load: {exc}") from None
            self._started = True

    def stop(self) -> None:
        with self._lock:
            if not self._started:
                return
            self._started = False
            self._handles, self._link_widths, self._count = {}, {}, None
            gpm, self._gpm = self._gpm, {}
            mig, self._mig_gpm = self._mig_gpm, {}
            self._mig_devices = {}
            with contextlib.suppress(pynvml.NVMLError):  # the driver went away: nothing to release
                for state in (*gpm.values(), *(s for g in mig.values() for s in g.values())):
                    state.free(self.lib)
                self.lib.nvmlShutdown()

    def _guard(self, fn: Callable[[], T]) -> T:
        """Run `fn`; on NvmlUnavailable mark the backend down so the next start() re-inits."""
        with self._lock:
            if self._held:
                raise NvmlPaused(f"NVML is released on request ({self._held})")
            if not self._started:
                raise NvmlUnavailable("NVML is not initialised")
            self._in_flight += 1
        try:
            return fn()
        except NvmlUnavailable:
            self.stop()
            raise
        except GpuLost as exc:  # the next read looks the GPU up again
            self._handles.pop(exc.index, None)
            self._link_widths.pop(exc.index, None)
            raise
        finally:
            with self._idle:
                self._in_flight -= 1
                self._idle.notify_all()

    def ensure_started(self) -> None:
        """For users other than the gpu collector (the benchmark): start if not up."""
        self.start()

    # -- system -------------------------------------------------------------------------------

    def device_count(self) -> int:
        def read() -> int:
            funnel = _Funnel()
            count = funnel.get("device_count", self.lib.nvmlDeviceGetCount)
            if count is None:
                # Never 0: a failed count read as "no GPUs" raised a false gpu_count_dropped and
                # dropped every GPU's state. The collector's round fails instead.
                raise NvmlError(
                    "nvmlDeviceGetCount failed: " + funnel.errors.get("device_count", "no answer")
                )
            if int(count) != self._count:  # numbered anew: an index may name another GPU
                self._count, self._handles, self._link_widths = int(count), {}, {}
            return int(count)

        return self._guard(read)

    def driver_version(self) -> str | None:
        def read() -> str | None:
            value = _Funnel().get("driver_version", self.lib.nvmlSystemGetDriverVersion)
            return None if value is None else _text(value)

        return self._guard(read)

    def _handle(self, index: int, funnel: _Funnel) -> Any:
        handle = self._handles.get(index)
        if handle is not None:
            return handle
        handle = funnel.get("handle", self.lib.nvmlDeviceGetHandleByIndex, index)
        if handle is None:
            raise GpuLost(index, funnel.errors.get("handle", "no handle for this index"))
        self._handles[index] = handle
        return handle

    def identity(self, index: int) -> GpuIdentity:
        return self._guard(lambda: self._identity(index, _Funnel(index)))

    def _identity(self, index: int, funnel: _Funnel, handle: Any = None) -> GpuIdentity:
        if handle is None:
            handle = self._handle(index, funnel)
        uuid = funnel.get("uuid", self.lib.nvmlDeviceGetUUID, handle)
        name = funnel.get("name", self.lib.nvmlDeviceGetName, handle)
        pci = funnel.get("pci_info", self.lib.nvmlDeviceGetPciInfo, handle)
        pci_bus_id = ""
        if pci is not None:
            try:
                pci_bus_id = normalize_pci_bus_id(_text(pci.busId))
            except ValueError:
                funnel.errors["pci_info"] = f"unexpected PCI bus id {pci.busId!r}"
        return GpuIdentity(
            index,
            "" if uuid is None else _text(uuid),
            "" if name is None else _text(name),
            pci_bus_id,
        )

    def gpus(self) -> list[GpuIdentity]:
        """Every visible GPU (index, uuid, name, pci_bus_id); a lost one is left out."""
        out: list[GpuIdentity] = []
        for index in range(self.device_count()):
            try:
                out.append(self.identity(index))
            except GpuLost:
                continue
        return out

    # -- per GPU ------------------------------------------------------------------------------

    def compute_process_count(self, index: int) -> int | None:
        def read() -> int | None:
            funnel = _Funnel(index)
            procs = funnel.get(
                "compute_processes",
                self.lib.nvmlDeviceGetComputeRunningProcesses,
                self._handle(index, funnel),
            )
            return None if procs is None else len(procs)

        return self._guard(read)

    def utilization(self, index: int) -> tuple[float, float] | None:
        """(gpu, memory) busy ratios 0..1 over NVML's last sample period, or None."""

        def read() -> tuple[float, float] | None:
            funnel = _Funnel(index)
            rates = funnel.get(
                "utilization", self.lib.nvmlDeviceGetUtilizationRates, self._handle(index, funnel)
            )
            return None if rates is None else (rates.gpu / 100.0, rates.memory / 100.0)

        return self._guard(read)

    def read_gpu(
        self,
        index: int,
        static: bool = False,
        slow: bool = False,
        energy: bool = False,
        gpm: bool = False,
        *,
        mig: bool = False,
    ) -> GpuRound:
        """One GPU's round in one call (the unit the collector times out and marks hung).

        `mig`: the GPU was in MIG mode when its static facts were last read; static facts
        read in this call decide instead. A GPU not in MIG mode costs no MIG call."""

        def read() -> GpuRound:
            funnel = _Funnel(index)
            handle = self._handle(index, funnel)
            static_reading = self._static(index, handle, _Funnel(index)) if static else None
            mig_on = mig if static_reading is None else static_reading.mig_mode is True
            if not mig_on and index in self._mig_gpm:  # left MIG mode (after a GPU reset)
                self._mig_forget(index)
            return GpuRound(
                index=index,
                reading=self._reading(
                    handle, _Funnel(index), energy, None if slow or static else index
                ),
                static=static_reading,
                slow=self._slow(handle, _Funnel(index)) if slow else None,
                energy_read=energy,
                gpm=self._gpm_read(index, handle, _Funnel(index)) if gpm else None,
                gpm_read=gpm,
                mig=self._mig(index, handle, _Funnel(index), gpm) if mig_on else None,
            )

        try:
            return self._guard(read)
        except GpuLost:
            self._gpm_forget(index)  # a sample from before a loss says nothing of after
            self._mig_forget(index)
            raise

    # -- MIG ----------------------------------------------------------------------------------

    def _mig(self, index: int, h: Any, f: _Funnel, gpm: bool) -> MigReading:
        """Every MIG device under the GPU, grouped by GPU instance, with each instance's
        memory (and GPM when asked). NVML has at most nvmlDeviceGetMaxMigDeviceCount of them
        (0 while MIG mode is only pending); an index without a device answers not found."""
        lib = self.lib
        count = f.get("mig_device_count", lib.nvmlDeviceGetMaxMigDeviceCount, h)
        found: dict[int, list[tuple[MigDevice, Any]]] = {}
        known = self._mig_devices.get(index, {})
        seen: dict[str, MigDevice] = {}
        for slot in range(int(count or 0)):
            handle = f.get("mig_handle", lib.nvmlDeviceGetMigDeviceHandleByIndex, h, slot)
            if handle is None:
                continue
            raw_uuid = f.get("mig_uuid", lib.nvmlDeviceGetUUID, handle)
            uuid = "" if raw_uuid is None else _text(raw_uuid)
            # A MIG UUID is made with its instance: its ids and name cannot change, and are
            # read once per device.
            device = known.get(uuid) if uuid else None
            if device is None:
                device = self._mig_device(handle, uuid, f)
            if device is None:
                continue
            if uuid:
                seen[uuid] = device
            found.setdefault(device.gpu_instance, []).append((device, handle))
        self._mig_devices[index] = seen
        instances = tuple(
            self._mig_instance(index, h, gi, found[gi], f, gpm=gpm) for gi in sorted(found)
        )
        states = self._mig_gpm.get(index, {})
        for gi in [g for g in states if g not in found]:  # a destroyed instance's samples
            with contextlib.suppress(pynvml.NVMLError):
                states.pop(gi).free(lib)
        return MigReading(instances, f.errors)

    def _mig_device(self, handle: Any, uuid: str, f: _Funnel) -> MigDevice | None:
        lib = self.lib
        gi = f.get("mig_instance_id", lib.nvmlDeviceGetGpuInstanceId, handle)
        ci = f.get("mig_instance_id", lib.nvmlDeviceGetComputeInstanceId, handle)
        if gi is None or ci is None:
            return None
        name = f.get("mig_name", lib.nvmlDeviceGetName, handle)
        return MigDevice(int(gi), int(ci), uuid, mig_profile(name))

    def _mig_instance(
        self,
        index: int,
        h: Any,
        gi: int,
        devices: list[tuple[MigDevice, Any]],
        f: _Funnel,
        *,
        gpm: bool,
    ) -> MigInstance:
        # The memory of a MIG device handle is its GPU instance's, the same for each of its
        # compute instances: read once, through the first.
        memory = self._memory(devices[0][1], f, "mig_memory")
        cis = tuple(sorted((d for d, _ in devices), key=lambda d: d.compute_instance))
        return MigInstance(
            gpu_instance=gi,
            profile=_CI_PREFIX.sub("", cis[0].profile),
            compute_instances=cis,
            memory_total_bytes=None if memory is None else float(memory.total),
            memory_used_bytes=None if memory is None else float(memory.used),
            memory_free_bytes=None if memory is None else float(memory.free),
            gpm=self._gpm_mig(index, h, gi, tuple(d.uuid for d in cis), f) if gpm else None,
        )

    def _gpm_mig(
        self, index: int, h: Any, gi: int, owner: tuple[str, ...], f: _Funnel
    ) -> GpmReading | None:
        """GPM of one GPU instance (nvmlGpmMigSampleGet on the parent GPU); absent where the
        GPU has no GPM or the instance does not give it (asked once per instance). `owner`
        (its devices' UUIDs) tells a re-created instance of the same id from the old one,
        whose sample says nothing of it."""
        states = self._mig_gpm.setdefault(index, {})
        state = states.get(gi)
        if state is not None and state.owner != owner:
            with contextlib.suppress(pynvml.NVMLError):
                state.free(self.lib)
            state = None
        if state is None:
            take = getattr(self.lib, "nvmlGpmMigSampleGet", None)
            supported = take is not None and self._gpm_state(index, h, f).supported
            state = states[gi] = _GpmState(supported=supported, owner=owner)
        if not state.supported:
            return None

        absent: list[bool] = []

        def take_sample(sample: Any) -> bool:
            errors = len(f.errors)
            if f.get("mig_gpm_sample", self.lib.nvmlGpmMigSampleGet, h, gi, sample) is not None:
                return True
            if len(f.errors) == errors:  # absent, not an error: this instance has no GPM
                absent.append(True)
            return False

        reading = self._gpm_step(state, take_sample, f)
        if absent:
            state.supported = False
            state.free(self.lib)
            return None
        return reading

    def _mig_forget(self, index: int) -> None:
        self._mig_devices.pop(index, None)
        for state in self._mig_gpm.pop(index, {}).values():
            with contextlib.suppress(pynvml.NVMLError):
                state.free(self.lib)

    # -- GPM ----------------------------------------------------------------------------------

    def _gpm_state(self, index: int, h: Any, f: _Funnel) -> _GpmState:
        """The GPU's GPM state, its support asked once."""
        state = self._gpm.get(index)
        if state is None:
            if not _HAS_GPM_API:  # an nvidia-ml-py older than GPM: absent, as unsupported
                self._gpm[index] = state = _GpmState(supported=False)
                return state
            support = f.get("gpm_support", self.lib.nvmlGpmQueryDeviceSupport, h)
            state = _GpmState(supported=bool(support is not None and support.isSupportedDevice))
            self._gpm[index] = state
        return state

    def _gpm_read(self, index: int, h: Any, f: _Funnel) -> GpmReading | None:
        """Take a sample; the metrics between it and the previous one (none after the first).
        Two samples per GPU, swapped: never a sleep between two samples in one call."""
        state = self._gpm_state(index, h, f)
        if not state.supported:
            return None
        return self._gpm_step(
            state,
            lambda sample: f.get("gpm_sample", self.lib.nvmlGpmSampleGet, h, sample) is not None,
            f,
        )

    def _gpm_step(self, state: _GpmState, take: Callable[[Any], bool], f: _Funnel) -> GpmReading:
        """`take(sample)` fills a sample (False: absent or failed); the metrics against the
        sample the last step kept."""
        if state.current is None:
            state.current = f.get("gpm_sample", self.lib.nvmlGpmSampleAlloc)
            if state.current is None:
                return GpmReading(errors=f.errors)
        if not take(state.current):
            state.taken = False  # absent or failed: the next sample starts afresh
            return GpmReading(errors=f.errors)
        reading = GpmReading(errors=f.errors)
        if state.taken and state.previous is not None:
            reading = self._gpm_metrics(state, f)
        if state.previous is None:
            state.previous = f.get("gpm_sample", self.lib.nvmlGpmSampleAlloc)
        state.previous, state.current = state.current, state.previous
        state.taken = True
        return reading

    def _gpm_metrics(self, state: _GpmState, f: _Funnel) -> GpmReading:
        request = state.request
        if request is None:
            # Built once per GPU: the struct holds NVML_GPM_METRIC_MAX entries, and making it
            # was most of a GPM read's Python cost (bench/gpu_round.py).
            request = state.request = pynvml.c_nvmlGpmMetricsGet_t()
            request.version = GPM_METRICS_GET_VERSION
            request.numMetrics = len(_GPM_IDS)
            for i, metric_id in enumerate(_GPM_IDS):
                request.metrics[i].metricId = metric_id
        request.sample1, request.sample2 = state.previous, state.current
        if f.get("gpm_metrics", self.lib.nvmlGpmMetricsGet, request) is None:
            return GpmReading(errors=f.errors)
        values: dict[int, float] = {}
        for i, metric_id in enumerate(_GPM_IDS):
            metric = request.metrics[i]
            number = float(metric.value)
            # SUCCESS with a value no activity or rate can have (NaN, infinite, negative) is
            # absent: never a sample the model refuses, which would fail the GPU's round.
            if int(metric.nvmlReturn) == pynvml.NVML_SUCCESS and 0.0 <= number < math.inf:
                values[metric_id] = number
        ratios: dict[str, float] = {}
        for name, metric_id in GPM_RATIOS.items():
            percent = values.get(metric_id)
            if percent is None:
                continue
            if percent > 100.0:
                # NVML documents these as 0-100 %; the lent H200 gave 377 % and 833 % for
                # windows spanning a benchmark run: no share of the GPU's time, so no reading.
                f.errors[f"gpm_{name}"] = f"NVML gave {percent:.1f} % (more than the whole)"
                continue
            ratios[name] = percent / 100.0
        return GpmReading(
            ratios=ratios,
            throughputs={k: values[i] * _MIB for k, i in GPM_THROUGHPUTS.items() if i in values},
            errors=f.errors,
        )

    def _gpm_forget(self, index: int) -> None:
        state = self._gpm.pop(index, None)
        if state is not None:
            with contextlib.suppress(pynvml.NVMLError):
                state.free(self.lib)

    def _static(self, index: int, h: Any, f: _Funnel) -> GpuStatic:
        lib = self.lib
        identity = self._identity(index, f, h)
        driver = f.get("driver_version", lib.nvmlSystemGetDriverVersion)
        serial = f.get("serial", lib.nvmlDeviceGetSerial, h)
        vbios = f.get("vbios_version", lib.nvmlDeviceGetVbiosVersion, h)
        persistence = f.get("persistence_mode", lib.nvmlDeviceGetPersistenceMode, h)
        mig = f.get("mig_mode", lib.nvmlDeviceGetMigMode, h)
        ecc = f.get("ecc_mode", lib.nvmlDeviceGetEccMode, h)
        capability = f.get("compute_capability", lib.nvmlDeviceGetCudaComputeCapability, h)
        thresholds = {
            name: f.get(
                f"temperature_threshold_{name}", lib.nvmlDeviceGetTemperatureThreshold, h, kind
            )
            for name, kind in (
                ("slowdown", pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
                ("shutdown", pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN),
                ("gpu_max", pynvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX),
                ("mem_max", pynvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX),
            )
        }
        sm_max = f.get("sm_clock_max", lib.nvmlDeviceGetMaxClockInfo, h, pynvml.NVML_CLOCK_SM)
        mem_max = f.get("memory_clock_max", lib.nvmlDeviceGetMaxClockInfo, h, pynvml.NVML_CLOCK_MEM)
        return GpuStatic(
            identity=identity,
            driver_version=None if driver is None else _text(driver),
            serial=None if serial is None else _text(serial),
            vbios_version=None if vbios is None else _text(vbios),
            persistence_mode=None if persistence is None else bool(persistence),
            mig_mode=None if mig is None else bool(mig[0]),  # [current, pending]
            ecc_mode=None if ecc is None else bool(ecc[0]),  # [current, pending]
            compute_capability=None if capability is None else f"{capability[0]}.{capability[1]}",
            temperature_slowdown_celsius=_scaled(thresholds["slowdown"], 1.0),
            temperature_shutdown_celsius=_scaled(thresholds["shutdown"], 1.0),
            temperature_gpu_max_celsius=_scaled(thresholds["gpu_max"], 1.0),
            temperature_memory_max_celsius=_scaled(thresholds["mem_max"], 1.0),
            sm_clock_max_hertz=_scaled(sm_max, 1e6),  # NVML clocks are MHz
            memory_clock_max_hertz=_scaled(mem_max, 1e6),
            pcie_generation_max=f.get(
                "pcie_generation_max", lib.nvmlDeviceGetMaxPcieLinkGeneration, h
            ),
            pcie_width_max=f.get("pcie_width_max", lib.nvmlDeviceGetMaxPcieLinkWidth, h),
            supported_event_types=f.get(
                "supported_event_types", lib.nvmlDeviceGetSupportedEventTypes, h
            ),
            errors=f.errors,
        )

    def _field_values(self, h: Any, f: _Funnel) -> tuple[float | None, int | None]:
        """(memory temperature, recovery action) in one nvmlDeviceGetFieldValues call: only
        the field-values API exposes them, and one call costs what one field does."""
        names = ("temperature_memory", "recovery_action")
        ids = [pynvml.NVML_FI_DEV_MEMORY_TEMP, FIELD_GPU_RECOVERY_ACTION]
        values = f.get("field_values", self.lib.nvmlDeviceGetFieldValues, h, ids)
        if values is None:
            return None, None
        out: list[int | None] = []
        for name, entry in zip(names, values, strict=True):
            code = int(entry.nvmlReturn)
            if code == pynvml.NVML_SUCCESS:
                out.append(int(entry.value.uiVal))
                continue
            if code == pynvml.NVML_ERROR_INVALID_ARGUMENT:
                # A field id past this driver's NVML_FI_MAX (the recovery action on an older
                # driver): the field does not exist here, which is absent, not an error.
                out.append(None)
                continue

            def failed(code: int = code) -> None:
                raise pynvml.NVMLError(code)

            out.append(f.get(name, failed))
        temperature, action = out
        return _scaled(temperature, 1.0), action

    def _clock_event_reasons(self, h: Any, f: _Funnel) -> int | None:
        reasons = f.get("clock_event_reasons", self.lib.nvmlDeviceGetCurrentClocksEventReasons, h)
        if reasons is None:  # drivers before 535 only have the older name of the same call
            reasons = f.get(
                "clock_event_reasons", self.lib.nvmlDeviceGetCurrentClocksThrottleReasons, h
            )
        return None if reasons is None else int(reasons)

    def _memory(self, h: Any, f: _Funnel, name: str = "memory") -> Any:
        memory = f.get(name, self.lib.nvmlDeviceGetMemoryInfo, h, version=pynvml.nvmlMemory_v2)
        if memory is None:  # v2 (with `reserved`) needs driver 510 or later
            memory = f.get(name, self.lib.nvmlDeviceGetMemoryInfo, h)
        return memory

    def _link_width(self, h: Any, f: _Funnel, cached: int | None, index: int | None) -> int | None:
        """The current link width: read when `cached` is None (a slow or static round), else
        GPU `cached`'s last one (and its read's error, so the error does not come and go)."""
        if cached is not None and cached in self._link_widths:
            width, error = self._link_widths[cached]
            if error is not None:
                f.errors["pcie_width"] = error
            return width
        width = f.get("pcie_width", self.lib.nvmlDeviceGetCurrPcieLinkWidth, h)
        if index is not None:
            self._link_widths[index] = (width, f.errors.get("pcie_width"))
        return width

    def _reading(
        self, h: Any, f: _Funnel, energy: bool = False, cached_width: int | None = None
    ) -> GpuReading:
        """`cached_width`: the index of a GPU whose link width the last slow read gave is to
        be used (None: read it now, as slow and static rounds do)."""
        lib = self.lib
        # NVML energy is mJ since the driver loaded.
        energy_joules = (
            _milli(f.get("energy", lib.nvmlDeviceGetTotalEnergyConsumption, h)) if energy else None
        )
        utilization = f.get("utilization", lib.nvmlDeviceGetUtilizationRates, h)
        memory = self._memory(h, f)
        procs = f.get("compute_processes", lib.nvmlDeviceGetComputeRunningProcesses, h)
        memory_temperature, recovery_action = self._field_values(h, f)
        ecc = {
            (kind, counter): f.get(
                f"ecc_{kind}_{counter}", lib.nvmlDeviceGetTotalEccErrors, h, kind_code, counter_code
            )
            for kind, kind_code in (
                ("corrected", pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                ("uncorrected", pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
            )
            for counter, counter_code in (
                ("volatile", pynvml.NVML_VOLATILE_ECC),
                ("aggregate", pynvml.NVML_AGGREGATE_ECC),
            )
        }
        remap = f.get("remapped_rows", lib.nvmlDeviceGetRemappedRows, h)
        return GpuReading(
            temperature_gpu_celsius=_scaled(
                f.get(
                    "temperature_gpu", lib.nvmlDeviceGetTemperature, h, pynvml.NVML_TEMPERATURE_GPU
                ),
                1.0,
            ),
            temperature_memory_celsius=memory_temperature,
            power_draw_watts=_milli(f.get("power_draw", lib.nvmlDeviceGetPowerUsage, h)),
            power_limit_watts=_milli(f.get("power_limit", lib.nvmlDeviceGetEnforcedPowerLimit, h)),
            sm_clock_hertz=_scaled(
                f.get("sm_clock", lib.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_SM), 1e6
            ),
            memory_clock_hertz=_scaled(
                f.get("memory_clock", lib.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_MEM), 1e6
            ),
            clock_event_reasons=self._clock_event_reasons(h, f),
            utilization_gpu_ratio=None if utilization is None else utilization.gpu / 100.0,
            utilization_memory_ratio=None if utilization is None else utilization.memory / 100.0,
            memory_total_bytes=None if memory is None else float(memory.total),
            memory_used_bytes=None if memory is None else float(memory.used),
            memory_reserved_bytes=_scaled(getattr(memory, "reserved", None), 1.0),
            pcie_generation=f.get("pcie_generation", lib.nvmlDeviceGetCurrPcieLinkGeneration, h),
            pcie_width=self._link_width(h, f, cached_width, f.index),
            compute_processes=None if procs is None else len(procs),
            processes=None if procs is None else tuple(_process(p) for p in procs),
            recovery_action=recovery_action,
            energy_joules=energy_joules,
            ecc_corrected_volatile=ecc["corrected", "volatile"],
            ecc_uncorrected_volatile=ecc["uncorrected", "volatile"],
            ecc_corrected_aggregate=ecc["corrected", "aggregate"],
            ecc_uncorrected_aggregate=ecc["uncorrected", "aggregate"],
            remapped_rows_correctable=None if remap is None else int(remap[0]),
            remapped_rows_uncorrectable=None if remap is None else int(remap[1]),
            remap_pending=None if remap is None else bool(remap[2]),
            remap_failure=None if remap is None else bool(remap[3]),
            errors=f.errors,
        )

    def _slow(self, h: Any, f: _Funnel) -> GpuSlowReading:
        lib = self.lib
        single = f.get(
            "retired_pages_single_bit",
            lib.nvmlDeviceGetRetiredPages,
            h,
            pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
        )
        double = f.get(
            "retired_pages_double_bit",
            lib.nvmlDeviceGetRetiredPages,
            h,
            pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
        )
        pending = f.get("retired_pages_pending", lib.nvmlDeviceGetRetiredPagesPendingStatus, h)
        fabric_state, fabric_status = self._fabric(h, f)
        return GpuSlowReading(
            pcie_replays=f.get("pcie_replays", lib.nvmlDeviceGetPcieReplayCounter, h),
            retired_pages_single_bit=None if single is None else len(single),
            retired_pages_double_bit=None if double is None else len(double),
            retired_pages_pending=None if pending is None else bool(pending),
            nvlinks=self._nvlinks(h, f),
            fabric_state=fabric_state,
            fabric_status=fabric_status,
            errors=f.errors,
        )

    def _fabric(self, h: Any, f: _Funnel) -> tuple[int | None, int | None]:
        """(state, status) of the GPU's NVLink fabric registration; absent without a fabric."""
        struct = getattr(pynvml, "c_nvmlGpuFabricInfo_t", None)
        if struct is None:  # an nvidia-ml-py older than fabric info: absent
            return None, None
        info = struct()
        done = f.get("fabric", self.lib.nvmlDeviceGetGpuFabricInfo, h, ctypes.byref(info))
        state = int(info.state)
        if done is None or state not in FABRIC_STATES:  # NOT_SUPPORTED (0) included
            return None, None
        return state, int(info.status)

    def _nvlinks(self, h: Any, f: _Funnel) -> tuple[NvLinkReading, ...]:
        links: list[NvLinkReading] = []
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            state = self._nvlink_state(h, link, f)
            if state is None:
                break
            counts: dict[str, int] = {}
            for name, counter in _NVLINK_ERROR_COUNTERS.items():
                value = f.get(
                    f"nvlink{link}_{name}",
                    self.lib.nvmlDeviceGetNvLinkErrorCounter,
                    h,
                    link,
                    counter,
                )
                if value is not None:
                    counts[name] = int(value)
            links.append(NvLinkReading(link, bool(state), counts))
        return tuple(links)

    def _nvlink_state(self, h: Any, link: int, f: _Funnel) -> int | None:
        try:
            return int(self.lib.nvmlDeviceGetNvLinkState(h, link))
        except pynvml.NVMLError as exc:
            if error_code(exc) == pynvml.NVML_ERROR_INVALID_ARGUMENT:
                return None  # past the last link of this GPU
            return f.get(f"nvlink{link}_state", _reraise, exc)

    # -- events (used by the event thread) ------------------------------------------------------

    def event_set_create(self) -> Any:
        return self._guard(lambda: _Funnel().get("event_set", self.lib.nvmlEventSetCreate))

    def register_events(self, index: int, mask: int, event_set: Any) -> bool:
        """Register `mask` for a GPU; False when the GPU supports none of it."""

        def register() -> bool:
            funnel = _Funnel(index)
            handle = self._handle(index, funnel)
            done = funnel.get(
                "register_events", self.lib.nvmlDeviceRegisterEvents, handle, mask, event_set
            )
            return "register_events" not in funnel.errors and done is None and mask != 0

        return self._guard(register)

    def wait_event(self, event_set: Any, timeout_ms: int) -> NvmlEventRecord | None:
        """The next event, or None when none came within the timeout."""
        return self._guard(lambda: self._wait_event(event_set, timeout_ms))

    def _wait_event(self, event_set: Any, timeout_ms: int) -> NvmlEventRecord | None:
        try:
            data = self.lib.nvmlEventSetWait_v2(event_set, timeout_ms)
        except pynvml.NVMLError as exc:
            if error_code(exc) == pynvml.NVML_ERROR_TIMEOUT:
                return None
            _Funnel().get("event_wait", _reraise, exc)
            raise NvmlError(f"waiting for NVML events failed: {exc}") from None
        funnel = _Funnel()
        pci = funnel.get("pci_info", self.lib.nvmlDeviceGetPciInfo, data.device)
        pci_bus_id = ""
        if pci is not None:
            try:
                pci_bus_id = normalize_pci_bus_id(_text(pci.busId))
            except ValueError:
                pci_bus_id = ""
        return NvmlEventRecord(
            pci_bus_id,
            int(data.eventType),
            int(data.eventData),
            _instance_id(getattr(data, "gpuInstanceId", INSTANCE_ID_NONE)),
            _instance_id(getattr(data, "computeInstanceId", INSTANCE_ID_NONE)),
        )

    def event_set_free(self, event_set: Any) -> None:
        with contextlib.suppress(pynvml.NVMLError):  # the driver went away: nothing to release
            self.lib.nvmlEventSetFree(event_set)


def _reraise(exc: BaseException) -> Any:
    raise exc


def _instance_id(value: object) -> int | None:
    """An event's MIG instance id; None for INSTANCE_ID_NONE (no instance named)."""
    number = int(value) if isinstance(value, int) else INSTANCE_ID_NONE
    return None if number == INSTANCE_ID_NONE else number


def mig_profile(name: object) -> str:
    """The profile in a MIG device's name (`NVIDIA H200 MIG 1g.18gb` -> `1g.18gb`); ""
    where the name does not carry one."""
    if name is None:
        return ""
    match = _MIG_NAME.search(_text(name))
    return "" if match is None else match["profile"]


def _process(entry: Any) -> GpuProcess:
    used = getattr(entry, "usedGpuMemory", None)  # pynvml gives None for "not available"
    return GpuProcess(int(entry.pid), None if used is None else float(used))


@dataclass
class _GpmState:
    """One GPU's GPM samples: `previous` holds the last sample taken (when `taken`), `current`
    the buffer the next one goes into."""

    supported: bool
    previous: Any = None
    current: Any = None
    taken: bool = False
    request: Any = None
    """The c_nvmlGpmMetricsGet_t reused for every read of this GPU."""
    owner: tuple[str, ...] = ()
    """For a MIG GPU instance: the UUIDs of its devices when its first sample was taken."""

    def free(self, lib: Any) -> None:
        for sample in (self.previous, self.current):
            if sample is not None:
                lib.nvmlGpmSampleFree(sample)
        self.previous = self.current = None
        self.taken = False
