"""The shipped dashboard and alert rules against a real Prometheus scraping a real agent runtime
on the fake NVML: every query of the GPU rows returns series, and the GPU rules fire on what the
agent really exports (names, labels, joins), not on series written by hand.

The agent runs in this process (the Prometheus sink on a free loopback port) so that its NVML
can be the scripted fake; Prometheus is the real server, scraping every second, with the rules'
`for:` shortened to 1 s. About 20 s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.program import config_file, registry
from agent.runtime.core import Runtime
from agent.runtime.state import StateStore
from collectors._nvml import CLOCK_EVENT_REASONS, NvmlBackend
from collectors.gpu.collector import GpuSettings
from collectors.kernel_log.collector import KernelLogSettings
from tests.support.nvml_fake import FakeGpu, FakeNvml, FakeUtilization
from tests.support.ports import free_port
from tests.support.prometheus_server import PrometheusServer
from tests.support.rules import RULES, dashboard_targets
from tests.test_actions_slurm import KernelLog
from tests.test_gpu_pci import TREES
from tests.test_gpu_promtool import everything_gpu

pytestmark = pytest.mark.slow

EXPECTED_GPUS = 8  # the HGX tree has 8 GPUs on its bus; the fake NVML sees 3
GPU_ROWS = ("GPUs", "GPU health")
"""Rows whose every query must return series from a fake-NVML agent (the others need a
watcher, a benchmark on a real GPU, checkpoints or MQTT: tests/test_watch_e2e.py has those)."""


def fake_node() -> FakeNvml:
    """Three GPUs, each showing something a panel or a rule is there for."""
    hot = everything_gpu(0)  # NVLink, a process, GPM, fabric
    hot.temperature = 86  # 3 C under its slowdown threshold (89)
    hot.clock_event_reasons = CLOCK_EVENT_REASONS["hw_thermal_slowdown"]
    hot.utilization = FakeUtilization(90, 40)
    hot.nvlink_states = [1, 0]  # one link down beside one up
    narrow = FakeGpu.h200(1, pcie_width=(8, 16), recovery_action=1)  # lanes lost; gpu_reset
    narrow.gpm = dict(hot.gpm or {})
    return FakeNvml([hot, narrow, FakeGpu.h200(2)])


def xid(pci: str, code: int) -> str:
    return f"NVRM: Xid (PCI:{pci}): {code}, pid=2314, name=python3, the test's Xid."


@dataclasses.dataclass
class Node:
    fake: FakeNvml
    runtime: Runtime
    log: KernelLog
    port: int


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    fake = fake_node()
    log = KernelLog(tmp_path / "kern.log")
    boot = tmp_path / "boot_id"
    boot.write_text("11111111-2222-3333-4444-555555555555\n")
    port = free_port()
    cfg = dataclasses.replace(
        config_file.parse({"prometheus": {"listen": f"127.0.0.1:{port}"}}),
        collectors={
            "gpu": GpuSettings(
                interval=0.5,
                slow_interval=0.5,
                gpm_interval=0.5,
                event_thread=False,
                expected_gpus=EXPECTED_GPUS,
                sysfs_root=str(TREES / "hgx-h200-8gpu"),
            ),
            "kernel_log": KernelLogSettings(path=log.path, boot_id_path=boot, interval=0.2),
        },
    )
    runtime = Runtime(
        cfg, StateStore.in_memory(), collectors=registry.COLLECTORS, sinks=registry.SINKS
    )
    backend = NvmlBackend(fake)
    runtime.shared.put(NvmlBackend, backend)
    await runtime.start()
    try:
        yield Node(fake, runtime, log, port)
    finally:
        await runtime.stop()
        backend.stop()


@pytest.fixture
def prometheus(tmp_path: Path, node: Node) -> Any:
    workdir = tmp_path / "prometheus"
    workdir.mkdir()
    (workdir / "rules.yml").write_text(re.sub(r"for: \d+[mh]", "for: 1s", RULES.read_text()))
    server = PrometheusServer(
        workdir,
        "global: {scrape_interval: 1s, evaluation_interval: 1s, scrape_timeout: 1s}\n"
        "rule_files: [rules.yml]\nscrape_configs:\n"
        f"  - job_name: gpuwarden\n    static_configs: [{{targets: ['127.0.0.1:{node.port}']}}]\n",
    )
    server.start()
    yield server
    server.stop()


def substituted(expr: str) -> str:
    return expr.replace("$instance", ".*").replace("$gpu", ".*")


async def empty_queries(prom: PrometheusServer) -> list[str]:
    targets = [
        (title, expr) for row, title, expr in dashboard_targets() if row.startswith(GPU_ROWS)
    ]
    assert len(targets) >= 20
    empty = []
    for title, expr in targets:
        if not await asyncio.to_thread(prom.query, substituted(expr)):
            empty.append(f"{title}: {expr}")
    return empty


async def firing(prom: PrometheusServer) -> set[str]:
    alerts = await asyncio.to_thread(prom.alerts)
    return {a["labels"]["alertname"] for a in alerts if a["state"] == "firing"}


async def test_gpu_panels_have_series_and_gpu_rules_fire(
    node: Node, prometheus: PrometheusServer
) -> None:
    prom = prometheus

    async def has(expr: str) -> bool:
        return bool(await asyncio.to_thread(prom.query, expr))

    await wait_for(lambda: has('gpuwarden_gpu_up{job="gpuwarden"}'), 30, lambda: "no scrapes")
    # Counters whose panels show increases: a first Xid makes the series, a second one and
    # new NVLink errors raise them while Prometheus watches.
    pci = node.fake.gpus[1].pci_bus_id.removeprefix("0000")[:-2].lower()  # 0000:28:00
    node.log.append(xid(pci, 79))
    await wait_for(lambda: has("gpuwarden_xid_errors_total"), 30, lambda: "no Xid series")
    node.log.append(xid(pci, 79))
    node.fake.gpus[0].nvlink_errors[(0, 0)] += 5
    missing: list[str] = []

    async def all_present() -> bool:
        missing[:] = await empty_queries(prom)
        return not missing

    await wait_for(all_present, 45, lambda: f"dashboard queries with no series: {missing}")

    wanted = {
        "GpuwardenGpuMissing",  # 3 of 8 expected and on the bus
        "GpuwardenRecoveryActionRequired",  # GPU 1: gpu_reset
        "GpuwardenRepairRequired",  # ...which the agent holds as reset_gpu, critical
        "GpuwardenPcieLinkDegraded",  # GPU 1: x8 of x16
        "GpuwardenGpuTemperatureNearSlowdown",  # GPU 0: 86 C, slowdown at 89
        "GpuwardenThermalThrottling",
        "GpuwardenNvlinkDown",  # GPU 0: link 1 down beside link 0
        "GpuwardenNvlinkErrors",
        "GpuwardenCriticalXid",
    }
    seen: set[str] = set()

    async def all_firing() -> bool:
        seen.clear()
        seen.update(await firing(prom))
        return wanted <= seen

    await wait_for(all_firing, 45, lambda: f"not firing: {sorted(wanted - seen)}")
    quiet = {
        "GpuwardenNvmlDown",
        "GpuwardenGpuLost",
        "GpuwardenFabricNotReady",
        "GpuwardenGpuTemperatureNearShutdown",
        "GpuwardenRowRemapFailure",
    }
    assert not quiet & seen


async def wait_for(check: Any, timeout: float, why: Any) -> None:
    """Poll an async predicate; fail with `why()` after `timeout` seconds (a bound)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await check():
        if loop.time() > deadline:
            raise AssertionError(why())
        await asyncio.sleep(0.5)
