"""A scriptable stand-in for the pynvml module, for tests and for hosts without a GPU.

`FakeNvml` answers the subset of pynvml that `collectors.nvml.NvmlBackend` calls, with real
`pynvml.NVMLError` exceptions, so the backend's one error mapping is exercised unchanged. Script
it through its `FakeGpu`s (mutable on purpose: a test changes a value between rounds):

- any number of GPUs: `FakeNvml([FakeGpu.h200(0), FakeGpu.h200(1)])`;
- a field not supported: `gpu.unsupported.add("nvmlDeviceGetRetiredPages")`, or a value of None;
- any other NVML error on one call: `gpu.failures["nvmlDeviceGetPowerUsage"] = NVML_ERROR_UNKNOWN`;
- a GPU lost: `gpu.lost = True` (every call on it raises NVML_ERROR_GPU_IS_LOST);
- a call that hangs: `gpu.hang = threading.Event()` (calls block until it is set);
- counters that increase: change `gpu.ecc`, `gpu.remapped_rows`, `gpu.pcie_replays`, ...;
- the driver missing: `FakeNvml(init_error=NVML_ERROR_DRIVER_NOT_LOADED)`, changeable later;
- events: `fake.push_event(gpu, nvmlEventTypeXidCriticalError, 79)`;
- compute processes coming and going: `gpu.processes = [FakeProcess(pid, used_bytes)]` (an int
  n gives n processes with pids 1..n and no memory figure);
- the driver's recovery action: `gpu.recovery_action = NVML_GPU_RECOVERY_ACTION_GPU_RESET`
  (None: the field is not supported);
- the fabric: `gpu.fabric = FakeFabric(state=..., status=...)` (None: not supported);
- GPM: `gpu.gpm = {NVML_GPM_METRIC_SM_UTIL: 80.0, ...}`, the values any two samples of this GPU
  give (a metric left out answers NOT_SUPPORTED; None: GPM not supported on the device).
- MIG: `gpu.mig_mode = (1, 1)` and `gpu.add_mig(gpu_instance=1, profile="1g.18gb")` (one MIG
  device, a compute instance; `compute_instance=`, `memory_used=`, `gpm=` per instance, None:
  the instance gives no GPM); `gpu.remove_mig(1)` destroys a GPU instance's devices. A GPU
  with `mig_mode = None` (before Ampere) answers NOT_SUPPORTED to every MIG call; one with MIG
  off has no MIG device (nvmlDeviceGetMaxMigDeviceCount answers 0, as NVML does).
- events naming a MIG instance: `fake.push_event(gpu, type, data, gpu_instance=2,
  compute_instance=0)` (left out: NVML's 0xFFFFFFFF, none).
- device files: `FakeNvml(gpus, device_dir=path)` opens real files `nvidiactl` and `nvidia<i>`
  there at nvmlInit and closes them at nvmlShutdown, as the real library holds /dev/nvidia*;
  `fake.lib_calls` counts every pynvml function looked up (a pause must make none).

The handles it gives out are the `FakeGpu` objects themselves.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import queue
import re
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml

from collectors._nvml import CLOCK_EVENT_REASONS, INSTANCE_ID_NONE

_ECC_KEYS = tuple(
    (kind, counter)
    for kind in (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)
    for counter in (pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC)
)


def _fail(code: int) -> None:
    raise pynvml.NVMLError(code)


@dataclass
class FakeUtilization:
    gpu: int
    memory: int


@dataclass
class FakeMemory:
    total: int
    used: int
    reserved: int

    @property
    def free(self) -> int:
        return self.total - self.used - self.reserved


@dataclass
class FakePciInfo:
    busId: str


@dataclass
class FakeFieldValueUnion:
    uiVal: int


@dataclass
class FakeFieldValue:
    nvmlReturn: int
    value: FakeFieldValueUnion


@dataclass
class FakeProcess:
    """One entry of nvmlDeviceGetComputeRunningProcesses (pynvml's friendly object)."""

    pid: int
    usedGpuMemory: int | None = None
    """Bytes; None as pynvml gives it for NVML_VALUE_NOT_AVAILABLE."""
    gpuInstanceId: int = 0xFFFFFFFF
    computeInstanceId: int = 0xFFFFFFFF


@dataclass
class FakeFabric:
    state: int = pynvml.NVML_GPU_FABRIC_STATE_COMPLETED
    status: int = pynvml.NVML_SUCCESS


@dataclass
class FakeEventData:
    device: FakeGpu
    eventType: int
    eventData: int
    gpuInstanceId: int = 0xFFFFFFFF
    computeInstanceId: int = 0xFFFFFFFF


@dataclass(eq=False)
class FakeMigDevice:
    """One MIG device (a compute instance in a GPU instance); its handle is the object."""

    parent: FakeGpu
    gpu_instance: int
    compute_instance: int
    profile: str
    """The device's profile as its name ends: `1g.18gb`, `1c.2g.35gb`."""
    uuid: str
    memory: FakeMemory | None
    """The GPU instance's memory (NVML gives the same for each of its compute instances)."""
    gpm: dict[int, float] | None = None
    """The GPU instance's GPM values between two samples; None: not supported."""


@dataclass(eq=False)
class FakeGpu:
    """One fake GPU. Units are NVML's own (mW, mJ, MHz, %), as the real library answers."""

    uuid: str
    pci_bus_id: str = "00000000:3B:00.0"
    name: str = "NVIDIA H200"
    serial: str | None = "1654024029978"
    vbios_version: str | None = "96.00.A5.00.1A"
    persistence_mode: int | None = 1
    mig_mode: tuple[int, int] | None = (0, 0)
    ecc_mode: tuple[int, int] | None = (1, 1)
    compute_capability: tuple[int, int] | None = (9, 0)
    thresholds: dict[int, int] = field(
        default_factory=lambda: {
            pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: 92,
            pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: 89,
            pynvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX: 87,
            pynvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX: 95,
        }
    )
    temperature: int | None = 33
    memory_temperature: int | None = 35
    power_mw: int | None = 78_820
    power_limit_mw: int | None = 700_000
    energy_mj: int | None = 1_000_000
    clocks_mhz: dict[int, int] = field(
        default_factory=lambda: {pynvml.NVML_CLOCK_SM: 345, pynvml.NVML_CLOCK_MEM: 3201}
    )
    max_clocks_mhz: dict[int, int] = field(
        default_factory=lambda: {pynvml.NVML_CLOCK_SM: 1980, pynvml.NVML_CLOCK_MEM: 3201}
    )
    clock_event_reasons: int | None = CLOCK_EVENT_REASONS["gpu_idle"]
    utilization: FakeUtilization | None = field(default_factory=lambda: FakeUtilization(0, 0))
    memory: FakeMemory | None = field(
        default_factory=lambda: FakeMemory(143771 * 2**20, 0, 616 * 2**20)
    )
    pcie_generation: tuple[int, int] | None = (5, 5)
    """(current, max)"""
    pcie_width: tuple[int, int] | None = (16, 16)
    """(current, max)"""
    processes: int | list[FakeProcess] | None = 0
    recovery_action: int | None = pynvml.NVML_GPU_RECOVERY_ACTION_NONE
    fabric: FakeFabric | None = None
    gpm: dict[int, float] | None = None
    field_codes: dict[int, int] = field(default_factory=dict)
    """Field id -> the per-field NVML return code nvmlDeviceGetFieldValues gives for it."""
    """GPM metric id -> value between two samples; None: GPM not supported (before Hopper)."""
    ecc: dict[tuple[int, int], int] = field(default_factory=lambda: dict.fromkeys(_ECC_KEYS, 0))
    remapped_rows: tuple[int, int, int, int] | None = (0, 0, 0, 0)
    """(correctable, uncorrectable, pending, failure), as nvmlDeviceGetRemappedRows answers."""
    retired_pages: dict[int, list[int]] | None = None
    """cause -> page addresses; None: not supported (Hopper uses row remapping)."""
    retired_pending: int | None = None
    pcie_replays: int | None = 0
    nvlink_states: list[int] | None = None
    nvlink_errors: dict[tuple[int, int], int] = field(default_factory=dict)
    supported_events: int | None = 0xFF9F  # what the lent H200 answered (docs/MEASUREMENTS.md)
    unsupported: set[str] = field(default_factory=set)
    """pynvml function names that answer NVML_ERROR_NOT_SUPPORTED."""
    failures: dict[str, int] = field(default_factory=dict)
    """pynvml function name -> NVML error code it raises."""
    lost: bool = False
    hang: threading.Event | None = None
    """While set to an unset Event, every call on this GPU blocks until the Event is set."""
    calls: Counter[str] = field(default_factory=Counter)
    """pynvml function name -> calls made on this GPU (hung and failed ones included); calls
    on one of its MIG devices count as `mig.<name>`."""
    registered_events: int = 0
    max_mig_devices: int = 7
    """nvmlDeviceGetMaxMigDeviceCount while MIG mode is on (7 on an H200)."""
    mig_devices: list[FakeMigDevice | None] = field(default_factory=list)
    """MIG device index -> device; None: no device at that index (NOT_FOUND)."""

    def add_mig(
        self,
        gpu_instance: int,
        profile: str = "1g.18gb",
        compute_instance: int = 0,
        memory_used: int = 0,
        gpm: dict[int, float] | None = None,
    ) -> FakeMigDevice:
        """A MIG device in the first free index. Compute instances of one GPU instance share
        its memory (a second one added to an existing instance gets the same object)."""
        sibling = next(
            (d for d in self.mig_devices if d is not None and d.gpu_instance == gpu_instance),
            None,
        )
        if sibling is not None:
            memory = sibling.memory
        else:
            size = re.search(r"(\d+)gb", profile)
            total = int(size[1]) * 2**30 if size else 2**30
            memory = FakeMemory(total, memory_used, 0)
        device = FakeMigDevice(
            self,
            gpu_instance,
            compute_instance,
            profile,
            f"MIG-{self.uuid[4:12]}-{gpu_instance:04x}-{compute_instance:04x}-"
            f"{len(self.mig_devices):012x}",
            memory,
            gpm,
        )
        free = [i for i, d in enumerate(self.mig_devices) if d is None]
        if free:
            self.mig_devices[free[0]] = device
        else:
            self.mig_devices.append(device)
        return device

    def remove_mig(self, gpu_instance: int) -> None:
        """Destroy a GPU instance: its devices' indexes answer NOT_FOUND."""
        self.mig_devices = [
            None if d is None or d.gpu_instance == gpu_instance else d for d in self.mig_devices
        ]

    @classmethod
    def h200(cls, index: int, **changes: Any) -> FakeGpu:
        """A GPU shaped like the lent H200, with a distinct UUID and PCI address per index."""
        values: dict[str, Any] = {
            "uuid": f"GPU-0502fb4c-14ff-1753-75b7-804bfa7d45{index:02x}",
            "pci_bus_id": f"00000000:{0x18 + index * 0x10:02X}:00.0",
        }
        values.update(changes)
        return cls(**values)


class FakeNvml:
    """The pynvml functions the backend uses, answered from `FakeGpu`s."""

    def __init__(
        self,
        gpus: list[FakeGpu] | None = None,
        driver_version: str = "580.159.04",
        init_error: int | None = None,
        device_dir: Path | None = None,
    ) -> None:
        self.lib_calls: Counter[str] = Counter()
        self.device_dir = device_dir
        self._device_fds: list[int] = []
        self.gpus: list[FakeGpu] = list(gpus or [])
        self.driver_version = driver_version
        self.init_error = init_error
        """An NVML error code nvmlInit raises (DRIVER_NOT_LOADED, LIBRARY_NOT_FOUND...), or None."""
        self.initialised = 0
        self.init_calls = 0
        self.events: queue.Queue[FakeEventData] = queue.Queue()
        self.event_sets_open = 0
        self._gpm_ids = itertools.count(0x1000, 0x10)
        self._gpm_samples: dict[int, tuple[FakeGpu | FakeMigDevice, int] | None] = {}
        """Live GPM sample address -> (GPU, or the first MIG device of the GPU instance, for
        nvmlGpmMigSampleGet; sequence number of its last sample)."""
        self._gpm_sequence = itertools.count(1)

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("nvml"):  # every library call, whoever makes it
            object.__getattribute__(self, "lib_calls")[name] += 1
        return object.__getattribute__(self, name)

    @property
    def gpm_samples_live(self) -> int:
        """GPM samples allocated and not yet freed."""
        return len(self._gpm_samples)

    # -- scripting ----------------------------------------------------------------------------

    def push_event(
        self,
        gpu: FakeGpu,
        event_type: int,
        data: int = 0,
        gpu_instance: int | None = None,
        compute_instance: int | None = None,
    ) -> None:
        """Queue an event; it is delivered only if `gpu` registered for its type."""
        # The collector's own constant: the older nvidia-ml-py of the GPU machine's image
        # has no NVML_GPU_INSTANCE_ID_ANY.
        none = INSTANCE_ID_NONE
        self.events.put(
            FakeEventData(
                gpu,
                event_type,
                data,
                none if gpu_instance is None else gpu_instance,
                none if compute_instance is None else compute_instance,
            )
        )

    def _enter(self, handle: FakeGpu | FakeMigDevice, name: str) -> None:
        if not self.initialised:
            _fail(pynvml.NVML_ERROR_UNINITIALIZED)
        gpu = handle.parent if isinstance(handle, FakeMigDevice) else handle
        if isinstance(handle, FakeMigDevice):
            name = f"mig.{name}"
            if handle not in gpu.mig_devices:  # a handle of a destroyed instance
                _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu.calls[name] += 1
        if gpu.hang is not None:
            gpu.hang.wait()
        if gpu.lost:
            _fail(pynvml.NVML_ERROR_GPU_IS_LOST)
        if name in gpu.unsupported:
            _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if name in gpu.failures:
            _fail(gpu.failures[name])

    @staticmethod
    def _value(value: Any) -> Any:
        if value is None:
            _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return value

    # -- library ------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.init_error is not None:
            _fail(self.init_error)
        self.initialised += 1
        if self.device_dir is not None and self.initialised == 1:
            names = ["nvidiactl", *(f"nvidia{i}" for i in range(len(self.gpus)))]
            flags = os.O_RDWR | os.O_CREAT
            self._device_fds = [os.open(self.device_dir / n, flags, 0o600) for n in names]

    def nvmlShutdown(self) -> None:
        if not self.initialised:
            _fail(pynvml.NVML_ERROR_UNINITIALIZED)
        self.initialised -= 1
        if not self.initialised:
            fds, self._device_fds = self._device_fds, []
            for fd in fds:
                os.close(fd)

    def nvmlSystemGetDriverVersion(self) -> str:
        if not self.initialised:
            _fail(pynvml.NVML_ERROR_UNINITIALIZED)
        return self.driver_version

    def nvmlDeviceGetCount(self) -> int:
        if not self.initialised:
            _fail(pynvml.NVML_ERROR_UNINITIALIZED)
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        if not self.initialised:
            _fail(pynvml.NVML_ERROR_UNINITIALIZED)
        if not 0 <= index < len(self.gpus):
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.gpus[index]
        self._enter(gpu, "nvmlDeviceGetHandleByIndex")
        return gpu

    # -- identity and static facts -------------------------------------------------------------

    def nvmlDeviceGetUUID(self, gpu: FakeGpu | FakeMigDevice) -> str:
        self._enter(gpu, "nvmlDeviceGetUUID")
        return gpu.uuid

    def nvmlDeviceGetName(self, gpu: FakeGpu | FakeMigDevice) -> str:
        self._enter(gpu, "nvmlDeviceGetName")
        if isinstance(gpu, FakeMigDevice):
            return f"{gpu.parent.name} MIG {gpu.profile}"
        return gpu.name

    def nvmlDeviceGetPciInfo(self, gpu: FakeGpu) -> FakePciInfo:
        self._enter(gpu, "nvmlDeviceGetPciInfo")
        return FakePciInfo(gpu.pci_bus_id)

    def nvmlDeviceGetSerial(self, gpu: FakeGpu) -> str:
        self._enter(gpu, "nvmlDeviceGetSerial")
        return str(self._value(gpu.serial))

    def nvmlDeviceGetVbiosVersion(self, gpu: FakeGpu) -> str:
        self._enter(gpu, "nvmlDeviceGetVbiosVersion")
        return str(self._value(gpu.vbios_version))

    def nvmlDeviceGetPersistenceMode(self, gpu: FakeGpu) -> int:
        self._enter(gpu, "nvmlDeviceGetPersistenceMode")
        return int(self._value(gpu.persistence_mode))

    def nvmlDeviceGetMigMode(self, gpu: FakeGpu) -> list[int]:
        self._enter(gpu, "nvmlDeviceGetMigMode")
        return list(self._value(gpu.mig_mode))

    def nvmlDeviceGetEccMode(self, gpu: FakeGpu) -> list[int]:
        self._enter(gpu, "nvmlDeviceGetEccMode")
        return list(self._value(gpu.ecc_mode))

    def nvmlDeviceGetCudaComputeCapability(self, gpu: FakeGpu) -> tuple[int, int]:
        self._enter(gpu, "nvmlDeviceGetCudaComputeCapability")
        return tuple(self._value(gpu.compute_capability))

    def nvmlDeviceGetTemperatureThreshold(self, gpu: FakeGpu, kind: int) -> int:
        self._enter(gpu, "nvmlDeviceGetTemperatureThreshold")
        return int(self._value(gpu.thresholds.get(kind)))

    def nvmlDeviceGetMaxClockInfo(self, gpu: FakeGpu, clock: int) -> int:
        self._enter(gpu, "nvmlDeviceGetMaxClockInfo")
        return int(self._value(gpu.max_clocks_mhz.get(clock)))

    def nvmlDeviceGetMaxPcieLinkGeneration(self, gpu: FakeGpu) -> int:
        self._enter(gpu, "nvmlDeviceGetMaxPcieLinkGeneration")
        return int(self._value(gpu.pcie_generation)[1])

    def nvmlDeviceGetMaxPcieLinkWidth(self, gpu: FakeGpu) -> int:
        self._enter(gpu, "nvmlDeviceGetMaxPcieLinkWidth")
        return int(self._value(gpu.pcie_width)[1])

    def nvmlDeviceGetSupportedEventTypes(self, gpu: FakeGpu) -> int:
        self._enter(gpu, "nvmlDeviceGetSupportedEventTypes")
        return int(self._value(gpu.supported_events))

    # -- fast readings -------------------------------------------------------------------------

    def nvmlDeviceGetTemperature(self, gpu: FakeGpu, sensor: int) -> int:
        self._enter(gpu, "nvmlDeviceGetTemperature")
        return int(self._value(gpu.temperature))

    def nvmlDeviceGetFieldValues(self, gpu: FakeGpu, ids: list[int]) -> list[FakeFieldValue]:
        self._enter(gpu, "nvmlDeviceGetFieldValues")
        out = []
        for field_id in ids:
            value = {
                pynvml.NVML_FI_DEV_MEMORY_TEMP: gpu.memory_temperature,
                pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: gpu.recovery_action,
            }.get(field_id)
            code = pynvml.NVML_SUCCESS if value is not None else pynvml.NVML_ERROR_NOT_SUPPORTED
            code = gpu.field_codes.get(field_id, code)
            out.append(FakeFieldValue(code, FakeFieldValueUnion(value or 0)))
        return out

    def nvmlDeviceGetPowerUsage(self, gpu: FakeGpu) -> int:
        self._enter(gpu, "nvmlDeviceGetPowerUsage")
        return int(self._value(gpu.power_mw))

    def nvmlDeviceGetEnforcedPowerLimit(self, gpu: FakeGpu) -> int:
        self._enter(gpu, "nvmlDeviceGetEnforcedPowerLimit")
        return int(self._value(gpu.power_limit_mw))

    def nvmlDeviceGetClockInfo(self, gpu: FakeGpu, clock: int) -> int:
        self._enter(gpu, "nvmlDeviceGetClockInfo")
        return int(self._value(gpu.clocks_mhz.get(clock)))

    def nvmlDeviceGetCurrentClocksEventReasons(self, gpu: FakeGpu) -> int:
        self._enter(gpu, "nvmlDeviceGetCurrentClocksEventReasons")
        return int(self._value(gpu.clock_event_reasons))

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, gpu: FakeGpu) -> int:
        self._enter(gpu, "nvmlDeviceGetCurrentClocksThrottleReasons")
        return int(self._value(gpu.clock_event_reasons))

    def nvmlDeviceGetUtilizationRates(self, gpu: FakeGpu) -> FakeUtilization:
        self._enter(gpu, "nvmlDeviceGetUtilizationRates")
        return FakeUtilization(**vars(self._value(gpu.utilization)))

    def nvmlDeviceGetMemoryInfo(
        self, gpu: FakeGpu | FakeMigDevice, version: int | None = None
    ) -> FakeMemory:
        self._enter(gpu, "nvmlDeviceGetMemoryInfo")
        return FakeMemory(**vars(self._value(gpu.memory)))

    # -- MIG -----------------------------------------------------------------------------------

    def _mig_capable(self, gpu: FakeGpu, name: str) -> None:
        self._enter(gpu, name)
        if gpu.mig_mode is None:
            _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetMaxMigDeviceCount(self, gpu: FakeGpu) -> int:
        self._mig_capable(gpu, "nvmlDeviceGetMaxMigDeviceCount")
        assert gpu.mig_mode is not None
        return gpu.max_mig_devices if gpu.mig_mode[0] else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, gpu: FakeGpu, index: int) -> FakeMigDevice:
        self._mig_capable(gpu, "nvmlDeviceGetMigDeviceHandleByIndex")
        assert gpu.mig_mode is not None
        if not gpu.mig_mode[0] or not 0 <= index < gpu.max_mig_devices:
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        device = gpu.mig_devices[index] if index < len(gpu.mig_devices) else None
        if device is None:
            _fail(pynvml.NVML_ERROR_NOT_FOUND)
        assert device is not None
        return device

    def _mig_device(self, handle: FakeGpu | FakeMigDevice, name: str) -> FakeMigDevice:
        self._enter(handle, name)
        if not isinstance(handle, FakeMigDevice):  # NVML: not a MIG device handle
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        assert isinstance(handle, FakeMigDevice)
        return handle

    def nvmlDeviceGetGpuInstanceId(self, handle: FakeGpu | FakeMigDevice) -> int:
        return self._mig_device(handle, "nvmlDeviceGetGpuInstanceId").gpu_instance

    def nvmlDeviceGetComputeInstanceId(self, handle: FakeGpu | FakeMigDevice) -> int:
        return self._mig_device(handle, "nvmlDeviceGetComputeInstanceId").compute_instance

    def nvmlDeviceGetCurrPcieLinkGeneration(self, gpu: FakeGpu) -> int:
        self._enter(gpu, "nvmlDeviceGetCurrPcieLinkGeneration")
        return int(self._value(gpu.pcie_generation)[0])

    def nvmlDeviceGetCurrPcieLinkWidth(self, gpu: FakeGpu) -> int:
        self._enter(gpu, "nvmlDeviceGetCurrPcieLinkWidth")
        return int(self._value(gpu.pcie_width)[0])

    def nvmlDeviceGetComputeRunningProcesses(self, gpu: FakeGpu) -> list[FakeProcess]:
        self._enter(gpu, "nvmlDeviceGetComputeRunningProcesses")
        processes = self._value(gpu.processes)
        if isinstance(processes, int):
            return [FakeProcess(pid) for pid in range(1, processes + 1)]
        return [FakeProcess(**vars(p)) for p in processes]

    def nvmlDeviceGetTotalEccErrors(self, gpu: FakeGpu, kind: int, counter: int) -> int:
        self._enter(gpu, "nvmlDeviceGetTotalEccErrors")
        return int(self._value(gpu.ecc.get((kind, counter))))

    def nvmlDeviceGetRemappedRows(self, gpu: FakeGpu) -> tuple[int, int, int, int]:
        self._enter(gpu, "nvmlDeviceGetRemappedRows")
        return tuple(self._value(gpu.remapped_rows))

    # -- slow readings -------------------------------------------------------------------------

    def nvmlDeviceGetTotalEnergyConsumption(self, gpu: FakeGpu) -> int:
        self._enter(gpu, "nvmlDeviceGetTotalEnergyConsumption")
        return int(self._value(gpu.energy_mj))

    def nvmlDeviceGetPcieReplayCounter(self, gpu: FakeGpu) -> int:
        self._enter(gpu, "nvmlDeviceGetPcieReplayCounter")
        return int(self._value(gpu.pcie_replays))

    def nvmlDeviceGetRetiredPages(self, gpu: FakeGpu, cause: int) -> list[int]:
        self._enter(gpu, "nvmlDeviceGetRetiredPages")
        return list(self._value(self._value(gpu.retired_pages).get(cause)))

    def nvmlDeviceGetRetiredPagesPendingStatus(self, gpu: FakeGpu) -> int:
        self._enter(gpu, "nvmlDeviceGetRetiredPagesPendingStatus")
        return int(self._value(gpu.retired_pending))

    def nvmlDeviceGetNvLinkState(self, gpu: FakeGpu, link: int) -> int:
        self._enter(gpu, "nvmlDeviceGetNvLinkState")
        states = self._value(gpu.nvlink_states)
        if link >= len(states):
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return int(states[link])

    def nvmlDeviceGetNvLinkErrorCounter(self, gpu: FakeGpu, link: int, counter: int) -> int:
        self._enter(gpu, "nvmlDeviceGetNvLinkErrorCounter")
        return int(self._value(gpu.nvlink_errors.get((link, counter))))

    def nvmlDeviceGetGpuFabricInfo(self, gpu: FakeGpu, ref: Any) -> int:
        self._enter(gpu, "nvmlDeviceGetGpuFabricInfo")
        fabric = self._value(gpu.fabric)
        info = getattr(ref, "_obj", ref)  # ctypes.byref(struct), as the real call takes
        info.state = fabric.state
        info.status = fabric.status
        return int(pynvml.NVML_SUCCESS)

    # -- GPM -----------------------------------------------------------------------------------

    def nvmlGpmQueryDeviceSupport(self, gpu: FakeGpu) -> pynvml.c_nvmlGpmSupport_t:
        self._enter(gpu, "nvmlGpmQueryDeviceSupport")
        support = pynvml.c_nvmlGpmSupport_t()
        support.version = pynvml.NVML_GPM_SUPPORT_VERSION
        support.isSupportedDevice = 0 if gpu.gpm is None else 1
        return support

    def nvmlGpmSampleAlloc(self) -> Any:
        if not self.initialised:
            _fail(pynvml.NVML_ERROR_UNINITIALIZED)
        address = next(self._gpm_ids)
        self._gpm_samples[address] = None
        # A real c_nvmlGpmSample_t (the metrics struct only takes that type) that is never
        # dereferenced: its address is the fake's key.
        return ctypes.cast(ctypes.c_void_p(address), pynvml.c_nvmlGpmSample_t)

    @staticmethod
    def _address(sample: Any) -> int:
        return int(ctypes.cast(sample, ctypes.c_void_p).value or 0)

    def nvmlGpmSampleFree(self, sample: Any) -> None:
        address = self._address(sample)
        if address not in self._gpm_samples:
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        del self._gpm_samples[address]

    def nvmlGpmSampleGet(self, gpu: FakeGpu, sample: Any) -> Any:
        self._enter(gpu, "nvmlGpmSampleGet")
        if gpu.gpm is None:
            _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        address = self._address(sample)
        if address not in self._gpm_samples:
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._gpm_samples[address] = (gpu, next(self._gpm_sequence))
        return sample

    def nvmlGpmMigSampleGet(self, gpu: FakeGpu, gpu_instance: int, sample: Any) -> Any:
        self._mig_capable(gpu, "nvmlGpmMigSampleGet")
        owner = next(
            (d for d in gpu.mig_devices if d is not None and d.gpu_instance == gpu_instance),
            None,
        )
        if owner is None:
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        assert owner is not None
        if gpu.gpm is None or owner.gpm is None:
            _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        address = self._address(sample)
        if address not in self._gpm_samples:
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._gpm_samples[address] = (owner, next(self._gpm_sequence))
        return sample

    def nvmlGpmMetricsGet(self, request: Any) -> Any:
        """Like NVML: both samples of one GPU, sample2 taken after sample1."""
        first = self._gpm_samples.get(self._address(request.sample1))
        second = self._gpm_samples.get(self._address(request.sample2))
        if request.version != pynvml.NVML_GPM_METRICS_GET_VERSION:
            _fail(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        if first is None or second is None or first[0] is not second[0] or first[1] >= second[1]:
            _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            raise AssertionError  # unreachable: _fail raises
        gpu = second[0]
        self._enter(gpu, "nvmlGpmMetricsGet")
        values = gpu.gpm or {}
        for i in range(request.numMetrics):
            metric = request.metrics[i]
            if metric.metricId in values:
                metric.nvmlReturn = pynvml.NVML_SUCCESS
                metric.value = values[metric.metricId]
            else:
                metric.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return request

    # -- events --------------------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> object:
        if not self.initialised:
            _fail(pynvml.NVML_ERROR_UNINITIALIZED)
        self.event_sets_open += 1
        return object()

    def nvmlEventSetFree(self, event_set: object) -> None:
        self.event_sets_open -= 1

    def nvmlDeviceRegisterEvents(self, gpu: FakeGpu, mask: int, event_set: object) -> None:
        self._enter(gpu, "nvmlDeviceRegisterEvents")
        supported = self._value(gpu.supported_events)
        if mask & ~supported:
            _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
        gpu.registered_events |= mask

    def nvmlEventSetWait_v2(self, event_set: object, timeout_ms: int) -> FakeEventData:
        while True:
            try:
                event = self.events.get(timeout=timeout_ms / 1000.0)
            except queue.Empty:
                _fail(pynvml.NVML_ERROR_TIMEOUT)
                raise  # unreachable: _fail raises
            if event.device.registered_events & event.eventType:
                return event
