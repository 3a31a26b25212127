"""The real agent process on a fake NVML: `gpuwarden run` with FakeNvml GPUs in place of the
driver, for end-to-end tests of what Prometheus and dashboards see from a GPU host.

Used as an AgentProcess `prefix` (the agent runs in this very process, so the pid is the
agent's):

    python -m tests.support.fake_gpu_agent --gpus 2 -- python -m agent run --config X

`scripted_gpus` is the fleet it runs: every reading the dcgm-exporter compatibility rules use
is supported, with values that differ per GPU and survive unit conversion exactly (the tests
compare what Prometheus records against them).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import pynvml

from agent.program import cli
from agent.program.commands import run
from agent.runtime.core import Runtime
from collectors._nvml import NvmlBackend
from tests.support.nvml_fake import FakeGpu, FakeMemory, FakeNvml, FakeUtilization

MIB = 2**20
MEMORY_TOTAL = 143771 * MIB
MEMORY_RESERVED = 616 * MIB
GPM_METRICS = {
    # NVML percentages exact in binary once divided by 100, and MiB/s.
    pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL: (50.0, 75.0),
    pynvml.NVML_GPM_METRIC_SM_UTIL: (25.0, 62.5),
    pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: (12.5, 37.5),
    pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: (6.25, 50.0),
    pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: (3.125, 25.0),
    pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC: (100.0, 1000.0),
    pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC: (200.0, 2000.0),
    pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC: (300.0, 3000.0),
    pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: (400.0, 4000.0),
}


def scripted_gpu(index: int) -> FakeGpu:
    """GPU `index` (0 or 1 have distinct GPM figures; more repeat GPU 1's)."""
    i = index
    gpu = FakeGpu.h200(
        i,
        temperature=40 + i,
        memory_temperature=50 + i,
        power_mw=120_500 + 1_000 * i,
        energy_mj=5_000_000 + 1_000 * i,
        clocks_mhz={pynvml.NVML_CLOCK_SM: 1980 - 100 * i, pynvml.NVML_CLOCK_MEM: 3201 - i},
        utilization=FakeUtilization(75 - 25 * i, 25 + 75 * i),
        # 123 bytes over whole MiB: DCGM's MiB are whole, so the rules round down.
        memory=FakeMemory(MEMORY_TOTAL, (1000 + i) * MIB + 123, MEMORY_RESERVED),
        remapped_rows=(3 + i, 1 + i, 0, 0),
        retired_pages={
            pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS: [0x1000] * (2 + i),
            pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR: [0x2000] * i,
        },
        retired_pending=0,
        pcie_replays=7 + i,
        nvlink_states=[1, 1],
        gpm={metric: values[min(i, 1)] for metric, values in GPM_METRICS.items()},
    )
    gpu.ecc = {
        (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC): 1 + i,
        (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC): i,
        (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_AGGREGATE_ECC): 10 + i,
        (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_AGGREGATE_ECC): 2 + i,
    }
    for link in range(2):
        for counter in range(4):  # replay, recovery, crc_flit, crc_data
            gpu.nvlink_errors[(link, counter)] = 10 * (counter + 1) + link + i
    return gpu


def scripted_gpus(count: int) -> list[FakeGpu]:
    return [scripted_gpu(i) for i in range(count)]


MIG_GPM_METRICS = {
    # Per GPU instance (1 and 2), distinct from each other and from the GPUs' own.
    pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL: (87.5, 43.75),
    pynvml.NVML_GPM_METRIC_SM_UTIL: (81.25, 40.625),
    pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: (68.75, 34.375),
    pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: (56.25, 28.125),
    pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: (18.75, 9.375),
    pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC: (10.0, 20.0),
    pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC: (30.0, 40.0),
    pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC: (50.0, 60.0),
    pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: (70.0, 80.0),
}
MIG_INSTANCES = ((1, "3g.71gb", 1), (2, "2g.35gb", 2))
"""The last GPU's GPU instances in scripted_mig_gpus: (id, profile, compute instances)."""


def scripted_mig_gpus(count: int) -> list[FakeGpu]:
    """scripted_gpus with the last GPU in MIG mode: GPU instance 1 (3g.71gb, one compute
    instance) and 2 (2g.35gb, two compute instances: one GPU instance still). NVML gives
    no utilization on a GPU in MIG mode; its GPU-wide GPM stays (the rules must not use it
    for a GPU that has GPU instances)."""
    gpus = scripted_gpus(count)
    mig = gpus[-1]
    mig.mig_mode = (1, 1)
    mig.utilization = None
    for n, (gi, profile, computes) in enumerate(MIG_INSTANCES):
        gpm = {metric: values[n] for metric, values in MIG_GPM_METRICS.items()}
        for ci in range(computes):
            name = profile if computes == 1 else f"1c.{profile}"
            # 77 bytes over whole MiB: the rules round an instance's MiB down too.
            mig.add_mig(gi, name, ci, memory_used=(2000 + n) * MIB + 77, gpm=gpm)
    return gpus


def fake_runtime(fake: FakeNvml) -> type[Runtime]:
    """The program's Runtime with `fake` as the process's NVML backend."""

    class FakeNvmlRuntime(Runtime):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.shared.put(NvmlBackend, NvmlBackend(fake))

    return FakeNvmlRuntime


def main(argv: Sequence[str]) -> int:
    if "--" not in argv:
        raise SystemExit("usage: fake_gpu_agent --gpus N -- PYTHON -m agent ARGS...")
    split = list(argv).index("--")
    parser = argparse.ArgumentParser(prog="fake_gpu_agent")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--mig", action="store_true", help="the last GPU in MIG mode")
    args = parser.parse_args(argv[:split])
    command = list(argv[split + 1 :])
    if command[1:3] != ["-m", "agent"]:
        raise SystemExit(f"fake_gpu_agent runs `PYTHON -m agent ...`, not {command}")
    # The run command builds its Runtime by this name; the fake backend rides in with it.
    gpus = scripted_mig_gpus(args.gpus) if args.mig else scripted_gpus(args.gpus)
    run.Runtime = fake_runtime(FakeNvml(gpus))  # type: ignore[attr-defined]
    return cli.main(command[3:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
