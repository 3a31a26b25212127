"""MIG against a real NVIDIA GPU, read only: the lent H200 is not in MIG mode, and its mode is
never changed here (no test may change it).

Run on the GPU machine: `python -m pytest -q -m gpu tests/test_gpu_mig_real.py`. Without NVML
every test skips. Synchronous on purpose (the GPU machine may lack pytest-asyncio).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pynvml
import pytest

from agent.contracts.model import Collection
from collectors._nvml import NvmlBackend, NvmlUnavailable
from tests.support.nvml import find
from tests.test_gpu_real import one_round

pytestmark = [pytest.mark.gpu]

MIG_SERIES = (
    "gpuwarden_gpu_mig_device_info",
    "gpuwarden_gpu_mig_memory_total_bytes",
    "gpuwarden_gpu_mig_memory_used_bytes",
    "gpuwarden_gpu_mig_memory_free_bytes",
    "gpuwarden_gpu_mig_activity_ratio",
    "gpuwarden_gpu_mig_throughput_bytes_per_second",
)


class CountingNvml:
    """The real pynvml, counting the MIG calls made through it (names with `Mig` or
    `InstanceId`); nothing that could change a mode is ever called by the agent."""

    def __init__(self) -> None:
        self.mig_calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        function = getattr(pynvml, name)
        if ("Mig" not in name and "InstanceId" not in name) or name == "nvmlDeviceGetMigMode":
            return function

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.mig_calls[name] += 1
            return function(*args, **kwargs)

        return counted


@pytest.fixture(scope="module")
def counting() -> Iterator[tuple[NvmlBackend, CountingNvml]]:
    lib = CountingNvml()
    backend = NvmlBackend(lib)
    try:
        backend.start()
    except NvmlUnavailable as exc:
        pytest.skip(f"no NVML here: {exc}")
    yield backend, lib
    backend.stop()


def mig_modes(backend: NvmlBackend) -> dict[str, bool | None]:
    """GPU index -> its current MIG mode, read as the collector reads it."""
    out: dict[str, bool | None] = {}
    for index in range(backend.device_count()):
        static = backend.read_gpu(index, static=True).static
        assert static is not None
        out[str(index)] = static.mig_mode
    return out


def test_gpus_not_in_mig_mode_have_no_instance_series_and_make_no_mig_call(
    counting: tuple[NvmlBackend, CountingNvml],
) -> None:
    backend, lib = counting
    modes = mig_modes(backend)
    plain = [gpu for gpu, mode in modes.items() if mode is not True]
    if not plain:
        pytest.skip(f"every GPU here is in MIG mode: {modes}")
    lib.mig_calls.clear()
    collection: Collection = asyncio.run(one_round(backend))
    for gpu in plain:
        assert [s for n in MIG_SERIES for s in find(collection, n, gpu=gpu)] == []
        [up] = find(collection, "gpuwarden_gpu_up", gpu=gpu)
        assert up.value == 1, f"GPU {gpu}: the round failed"
        errors = [s.labels["field"] for s in find(collection, "gpuwarden_gpu_field_error", gpu=gpu)]
        assert not [e for e in errors if e.startswith("mig")], errors
    if len(plain) == len(modes):
        assert lib.mig_calls == Counter(), "a GPU not in MIG mode paid for MIG calls"


def test_gpus_in_mig_mode_have_their_instances(
    counting: tuple[NvmlBackend, CountingNvml],
) -> None:
    """Only where a host is in MIG mode already (the lent H200 is not: this skips there)."""
    backend, _ = counting
    modes = mig_modes(backend)
    on = [gpu for gpu, mode in modes.items() if mode is True]
    if not on:
        pytest.skip(f"no GPU here is in MIG mode (never changed by a test): {modes}")
    collection = asyncio.run(one_round(backend))
    for gpu in on:
        devices = find(collection, "gpuwarden_gpu_mig_device_info", gpu=gpu)
        totals = find(collection, "gpuwarden_gpu_mig_memory_total_bytes", gpu=gpu)
        # A GPU in MIG mode may have no instance made yet: then neither has a series.
        assert bool(devices) == bool(totals)
        for sample in totals:
            assert sample.value > 0
            assert sample.labels["profile"], sample.labels
