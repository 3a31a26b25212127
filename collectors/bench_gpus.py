"""What the benchmark needs to know of the GPUs: who they are and whether they are busy.

`GpuActivity` is deliberately narrow (four blocking calls), so the shared NVML backend
(collectors/nvml.py, written in parallel) can provide it with a thin adapter. Until that is
wired, `PynvmlActivity` reads the same four facts straight from pynvml. Both are blocking: the
collector calls them through `ctx.call`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Protocol

from collectors.xid import normalize_pci_bus_id


class GpuBackendUnavailable(Exception):
    """No GPU backend on this host (no driver, no NVML library): the benchmark has nothing to do."""


@dataclass(frozen=True, slots=True)
class GpuIdentity:
    index: int
    """NVML index (not CUDA's: the child is pinned by UUID through CUDA_VISIBLE_DEVICES)."""
    uuid: str
    name: str
    pci_bus_id: str
    """Normalised like collectors.xid.normalize_pci_bus_id: `0000:3b:00.0`."""

    def labels(self) -> dict[str, str]:
        """The GPU_LABELS of agent.model."""
        return {"gpu": str(self.index), "uuid": self.uuid, "pci_bus_id": self.pci_bus_id,
                "model": self.name}


class GpuActivity(Protocol):
    def gpus(self) -> list[GpuIdentity]:
        """Every GPU of the host; raises GpuBackendUnavailable when there is no backend."""
        ...

    def compute_process_count(self, index: int) -> int | None:
        """Compute processes on the GPU now; None if the driver cannot say (MIG, vGPU)."""
        ...

    def utilization_percent(self, index: int) -> float | None:
        """GPU utilization over the driver's last sample period; None if not supported."""
        ...

    def driver_version(self) -> str | None:
        ...


class PynvmlActivity:
    """GpuActivity straight from pynvml (nvidia-ml-py). Initialises NVML on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._nvml: Any = None
        self._handles: dict[int, Any] = {}

    def _init(self) -> Any:
        with self._lock:
            if self._nvml is None:
                import pynvml  # noqa: PLC0415 - loads libnvidia-ml only when used

                try:
                    pynvml.nvmlInit()
                except pynvml.NVMLError as exc:
                    raise GpuBackendUnavailable(f"NVML: {exc}") from exc
                self._nvml = pynvml
            return self._nvml

    def _handle(self, index: int) -> Any:
        nvml = self._init()
        handle = self._handles.get(index)
        if handle is None:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            self._handles[index] = handle
        return handle

    def gpus(self) -> list[GpuIdentity]:
        nvml = self._init()
        out: list[GpuIdentity] = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = self._handle(index)
            pci = nvml.nvmlDeviceGetPciInfo(handle).busId
            out.append(GpuIdentity(
                index=index,
                uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                name=_text(nvml.nvmlDeviceGetName(handle)),
                pci_bus_id=normalize_pci_bus_id(_text(pci)),
            ))
        return out

    def compute_process_count(self, index: int) -> int | None:
        nvml = self._init()
        try:
            return len(nvml.nvmlDeviceGetComputeRunningProcesses(self._handle(index)))
        except nvml.NVMLError_NotSupported:
            return None

    def utilization_percent(self, index: int) -> float | None:
        nvml = self._init()
        try:
            return float(nvml.nvmlDeviceGetUtilizationRates(self._handle(index)).gpu)
        except nvml.NVMLError_NotSupported:
            return None

    def driver_version(self) -> str | None:
        nvml = self._init()
        try:
            return _text(nvml.nvmlSystemGetDriverVersion())
        except nvml.NVMLError:
            return None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
