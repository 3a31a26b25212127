"""The Xid counters exist whenever a source of Xids runs, exactly once per GPU and code.

`gpuwarden_xid_errors_total` (what GpuwardenCriticalXid reads) and
`gpuwarden_xid_confirmed_total` count the shared correlator's Xids, which the kernel log and
the NVML event thread both feed. The class under test: whichever of the two sources runs (the
kernel_log collector enabled, disabled, not buildable, its reads failing, added or removed by
a reload), an Xid NVML reports is in the runtime's snapshot, in one series per (GPU, code),
with the GPU labels of the metrics contract; at no turn of the event loop is a series there
twice, and once there it stays (a gap would read as a new series to the rule's `unless ...
offset 10m`, a page 10 minutes later for an old Xid).
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import shutil
import subprocess
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pynvml
import pytest

from agent.contracts.collector import CollectorDeps, CollectorSpec
from agent.contracts.errors import GpuwardenError
from agent.contracts.model import GPU_LABELS, Sample
from agent.program import config_file as config
from agent.program import registry
from agent.runtime.core import Runtime
from agent.runtime.state import StateStore
from collectors._nvml import NvmlBackend
from collectors.gpu.collector import GpuSettings
from collectors.kernel_log.collector import KernelLogCollector, KernelLogSettings
from exporters.exposition import render
from tests.support.kmsg import FakeKmsg, capture_records, kernel_log_spec, write_boot_id
from tests.support.nvml import fake_gpus
from tests.support.nvml_fake import FakeNvml
from tests.support.waiting import until

GPU = GpuSettings(interval=0.2, event_thread=True, event_wait_ms=50, sysfs_root="/nonexistent")
XID_SERIES = ("gpuwarden_xid_errors_total", "gpuwarden_xid_confirmed_total")
MODES = ("enabled", "disabled", "unbuildable", "unreadable")
"""The kernel_log collector: running; `enabled = false`; its factory raising (no /dev/kmsg
in a container); built, every read refused (no CAP_SYSLOG)."""


class Kmsg(FakeKmsg):
    """The ring buffer; `refuse` makes every read fail as one without CAP_SYSLOG does."""

    refuse = False

    def read(self, fd: int, size: int) -> bytes:
        if self.refuse:
            raise PermissionError(errno.EPERM, "Operation not permitted")
        return super().read(fd, size)


def unbuildable(settings: KernelLogSettings, deps: CollectorDeps) -> KernelLogCollector:
    raise GpuwardenError("/dev/kmsg: No such file or directory")


class Agent:
    """The runtime as `gpuwarden run` builds it, on the fake NVML and a kmsg stand-in, with
    a watcher that looks at the snapshot at every turn of the event loop."""

    def __init__(self, tmp_path: Path, mode: str) -> None:
        self.kmsg = Kmsg(records=list(capture_records()))
        self.kmsg.refuse = mode == "unreadable"
        self.fake = FakeNvml(fake_gpus(2))
        self.kernel = KernelLogSettings(
            interval=0.1,
            path=Path("/dev/kmsg"),
            boot_id_path=write_boot_id(tmp_path / "boot_id", "boot-a"),
            enabled=mode != "disabled",
        )
        cfg = config.parse({"prometheus": {"enabled": False}, "state_dir": str(tmp_path / "s")})
        self.cfg = dataclasses.replace(cfg, collectors={"gpu": GPU, "kernel_log": self.kernel})
        spec = kernel_log_spec(self.kmsg)
        if mode == "unbuildable":
            spec = CollectorSpec("kernel_log", "no /dev/kmsg", KernelLogSettings, unbuildable)
        self.runtime = Runtime(
            self.cfg,
            StateStore.open(tmp_path / "s"),
            collectors={**registry.COLLECTORS, "kernel_log": spec},
            sinks=registry.SINKS,
            boot_id="boot-a",
        )
        self.runtime.shared.put(NvmlBackend, NvmlBackend(self.fake))
        self.most: Counter[tuple[str, tuple[str, ...]]] = Counter()
        """The most times each Xid series was in the snapshot at once."""
        self.gone: list[tuple[str, tuple[str, ...]]] = []
        """Series seen once and missing from a later snapshot."""
        self._seen: set[tuple[str, tuple[str, ...]]] = set()
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.runtime.start()
        await until(lambda: self.runtime.collectors["gpu"].rounds_done > 0, what="a gpu round")
        self._watch = asyncio.create_task(self._watcher())

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        await self.runtime.stop()
        self.runtime.store.close()

    async def _watcher(self) -> None:
        while True:
            self.look()
            await asyncio.sleep(0)

    def look(self) -> list[Sample]:
        samples = [s for s in self.runtime.samples() if s.family.name in XID_SERIES]
        now = Counter((s.family.name, s.label_values) for s in samples)
        for key, n in now.items():
            self.most[key] = max(self.most[key], n)
        self.gone += sorted(self._seen - now.keys())
        self._seen |= now.keys()
        return samples

    def xid(self, code: int, gpu: int = 0) -> None:
        self.fake.push_event(self.fake.gpus[gpu], pynvml.nvmlEventTypeXidCriticalError, code)

    async def series(self, code: int, count: float = 1) -> list[Sample]:
        """The snapshot's Xid error series of `code`, once it counts `count`."""

        def found() -> list[Sample]:
            return [
                s
                for s in self.look()
                if s.family.name == XID_SERIES[0]
                and s.labels["xid"] == str(code)
                and s.value >= count
            ]

        await until(lambda: bool(found()), what=f"gpuwarden_xid_errors_total xid={code}")
        return found()

    async def reload(self, kernel_log: bool) -> None:
        kernel = dataclasses.replace(self.kernel, enabled=kernel_log)
        await self.runtime.reload(
            dataclasses.replace(self.cfg, collectors={"gpu": GPU, "kernel_log": kernel})
        )

    def assert_once(self) -> None:
        assert self.gone == [], f"series went missing: {self.gone}"
        twice = {key: n for key, n in self.most.items() if n > 1}
        assert twice == {}, f"series in the snapshot more than once: {twice}"


@pytest.fixture(params=MODES)
async def agent(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Agent]:
    running = Agent(tmp_path, request.param)
    await running.start()
    yield running
    await running.stop()


class TestWhicheverSourceRuns:
    async def test_an_nvml_xid_is_one_series_with_the_gpu_labels(self, agent: Agent) -> None:
        agent.xid(79)
        (series,) = await agent.series(79)
        gpu = agent.fake.gpus[0]
        assert series.labels["gpu"] == "0" and series.labels["uuid"] == gpu.uuid
        assert series.labels["model"] and series.labels["pci_bus_id"]
        assert tuple(series.labels) == (*GPU_LABELS, "xid")
        agent.xid(48, gpu=1)
        await agent.series(48)
        for _ in range(5):  # rounds of both collectors after it
            await asyncio.sleep(0.2)
            assert len([s for s in agent.look() if s.family.name == XID_SERIES[0]]) == 2
        agent.assert_once()

    @pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
    async def test_the_exposition_passes_promtool(self, agent: Agent) -> None:
        agent.xid(79)
        await agent.series(79)
        text = render(agent.runtime.families(), agent.runtime.samples()).decode()
        checked = subprocess.run(
            ["promtool", "check", "metrics"], input=text.encode(), capture_output=True, check=False
        )
        assert checked.returncode == 0, checked.stdout.decode() + checked.stderr.decode()
        assert text.count('gpuwarden_xid_errors_total{gpu="0"') == 1


class TestKernelLogComesAndGoes:
    """A reload that adds or removes the kernel_log collector, its reads failing and coming
    back: the series stays, once, and its count goes on."""

    @pytest.mark.parametrize("steps", [(False, True), (True, False, True), (False,)])
    async def test_a_reload_toggling_kernel_log(
        self, tmp_path: Path, steps: tuple[bool, ...]
    ) -> None:
        agent = Agent(tmp_path, "enabled" if not steps[0] else "disabled")
        await agent.start()
        try:
            agent.xid(79)
            await agent.series(79)
            for n, on in enumerate(steps, start=2):
                await agent.reload(on)
                assert ("kernel_log" in agent.runtime.collectors) is on
                await asyncio.sleep(0.3)  # rounds of both after the reload
                agent.xid(79)
                await agent.series(79, count=n)
                await asyncio.sleep(0.3)
            agent.assert_once()
        finally:
            await agent.stop()

    async def test_reads_failing_and_back(self, tmp_path: Path) -> None:
        agent = Agent(tmp_path, "enabled")
        await agent.start()
        try:
            agent.xid(79)
            await agent.series(79)
            kernel = agent.runtime.collectors["kernel_log"]
            agent.kmsg.refuse = True
            await until(lambda: kernel.failures >= 3, what="failed kernel-log rounds")
            agent.xid(79)
            await agent.series(79, count=2)
            agent.kmsg.refuse = False
            failures = kernel.failures
            await until(lambda: kernel.success is True, what="a kernel-log round again")
            await asyncio.sleep(0.3)
            assert kernel.failures == failures
            agent.xid(79)
            await agent.series(79, count=3)
            agent.assert_once()
        finally:
            await agent.stop()
