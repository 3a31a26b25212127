"""What the benchmark needs to know of the GPUs: who they are and whether they are busy.

`GpuActivity` is deliberately narrow (four blocking calls). `NvmlActivity` provides it from the
shared NVML backend (collectors/_nvml.py), so the benchmark's idle gate and the gpu collector
share one `nvmlInit`; tests use a fake (tests/support/bench.py). The collector calls these
through `ctx.call`.
"""

from __future__ import annotations

from typing import Protocol

from agent.contracts.errors import GpuwardenError
from collectors._nvml import GpuIdentity, GpuLost, NvmlBackend, NvmlError, NvmlUnavailable

__all__ = ["GpuActivity", "GpuBackendUnavailable", "GpuIdentity", "NvmlActivity"]


class GpuBackendUnavailable(GpuwardenError):
    """No GPU backend on this host (no driver, no NVML library): the benchmark has nothing to do."""


class GpuActivity(Protocol):
    def gpus(self) -> list[GpuIdentity]:
        """Every GPU of the host; raises GpuBackendUnavailable when there is no backend."""
        ...

    def compute_process_count(self, index: int) -> int | None:
        """Compute processes on the GPU now; None if the driver cannot say (MIG, vGPU, lost)."""
        ...

    def utilization_percent(self, index: int) -> float | None:
        """GPU utilization over the driver's last sample period; None if not supported."""
        ...

    def driver_version(self) -> str | None: ...

    def hold(self, timeout: float) -> bool:
        """Let go of the GPU backend until `release` (a pause); False when a call in flight
        did not end within `timeout` seconds (then it is not shut under that call)."""
        ...

    def release(self) -> None: ...


class NvmlActivity:
    """GpuActivity from the shared `NvmlBackend`. A lost GPU reads as unknown activity (never
    idle, so never tested); a missing driver as no backend."""

    def __init__(self, backend: NvmlBackend) -> None:
        self.backend = backend

    def gpus(self) -> list[GpuIdentity]:
        try:
            self.backend.ensure_started()
            return self.backend.gpus()
        except NvmlUnavailable as exc:
            raise GpuBackendUnavailable(f"NVML: {exc.reason}") from exc

    def compute_process_count(self, index: int) -> int | None:
        try:
            return self.backend.compute_process_count(index)
        except GpuLost:
            return None
        except NvmlUnavailable as exc:
            raise GpuBackendUnavailable(f"NVML: {exc.reason}") from exc

    def utilization_percent(self, index: int) -> float | None:
        try:
            rates = self.backend.utilization(index)
        except GpuLost:
            return None
        except NvmlUnavailable as exc:
            raise GpuBackendUnavailable(f"NVML: {exc.reason}") from exc
        return None if rates is None else rates[0] * 100.0

    def driver_version(self) -> str | None:
        try:
            return self.backend.driver_version()
        except NvmlError:
            return None

    def hold(self, timeout: float) -> bool:
        return self.backend.hold("gpuwarden pause", timeout)

    def release(self) -> None:
        self.backend.release()
