"""System-wide NVIDIA versions for `check` and `diag`: the driver (the backend's own read), the
CUDA version the driver supports and the NVML library's version (two reads the backend does not
offer, so they are made here on its library handle, once, mapped to absent on any NVML error)."""

from __future__ import annotations

from typing import Any

import pynvml

from collectors._nvml import NvmlBackend, NvmlError


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def cuda_version_text(value: int) -> str:
    """NVML encodes CUDA 12.4 as 12040 (major * 1000 + minor * 10)."""
    return f"{value // 1000}.{value % 1000 // 10}"


def read_nvml_versions(backend: NvmlBackend) -> dict[str, str]:
    """driver_version, cuda_driver_version, nvml_version: those the driver answers."""
    out: dict[str, str] = {}
    if not backend.up:
        return out
    try:
        driver = backend.driver_version()
    except NvmlError:
        return out
    if driver:
        out["driver_version"] = driver
    for key, function in (
        ("cuda_driver_version", "nvmlSystemGetCudaDriverVersion_v2"),
        ("nvml_version", "nvmlSystemGetNVMLVersion"),
    ):
        read = getattr(backend.lib, function, None)
        if read is None:  # an old pynvml, or a stand-in without it
            continue
        try:
            value = read()
        except pynvml.NVMLError:
            continue
        out[key] = cuda_version_text(value) if isinstance(value, int) else _text(value)
    return out
