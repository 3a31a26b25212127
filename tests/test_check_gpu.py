"""check on the fake NVML: the gpu collector's own round, judged line by line, per status and
exit code; and the host collectors' rounds on fixture trees and scripted statvfs answers."""

from __future__ import annotations

import os
from pathlib import Path

import pynvml
import pytest

from agent.contracts.collector import SharedServices
from agent.program.diagnose.check import CheckOptions, run_check
from agent.program.diagnose.collect_once import CollectorResult, OneShotCollectors
from agent.program.diagnose.findings import Finding, Status
from agent.program.diagnose.gpu_findings import index_ranges
from agent.program.diagnose.host_findings import classify_disk, classify_processes
from collectors._nvml import CLOCK_EVENT_REASONS, NvmlBackend
from collectors.disk.collector import DiskCollector, DiskSettings
from tests.support.diag import load, make_proc_tree, write_config
from tests.support.host import (
    GIB,
    ProcTree,
    ScriptedStatvfs,
    fake_statvfs_result,
    make_deps,
    pooled_caller,
    run_round,
)
from tests.support.nvml_fake import FakeGpu, FakeNvml

OPTIONS = CheckOptions(torch=False, process_gap=0.05)
H200_PROC = (
    "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  "
    "(dvs-builder@U22-I3-AE18-23-3)  Mon Jun 30 2025\n"
)


async def check_with(
    tmp_path: Path, fake: FakeNvml, options: CheckOptions = OPTIONS, proc_version: bool = True
) -> tuple[list[Finding], int]:
    cfg = load(write_config(tmp_path, proc_root=make_proc_tree(tmp_path / "proc")))
    version = tmp_path / "nvidia-version"
    if proc_version:
        version.write_text(H200_PROC)
    shared = SharedServices()
    shared.put(NvmlBackend, NvmlBackend(fake))
    options = CheckOptions(**{**options.__dict__, "nvidia_proc_version": version})
    report = await run_check(cfg, options, shared=shared)
    return [f for f in report.findings if f.area == "gpu"], report.exit_code


def line(findings: list[Finding], fragment: str) -> Finding:
    matches = [f for f in findings if fragment in f.name]
    assert len(matches) == 1, [(f.name, f.status) for f in findings]
    return matches[0]


class TestHealthyGpus:
    """Healthy GPUs: every line OK, OK lines folded across GPUs, exit code 0."""

    async def test_one_h200(self, tmp_path: Path) -> None:
        findings, code = await check_with(tmp_path, FakeNvml([FakeGpu.h200(0)]))
        assert code == 0, [(f.name, f.status, f.detail) for f in findings]
        assert {f.status for f in findings} == {Status.OK}
        assert "580.159.04" in line(findings, "NVIDIA driver").detail
        identity = line(findings, "identity").detail
        assert "NVIDIA H200" in identity and "0000:18:00.0" in identity
        assert "compute capability 9.0" in identity
        assert "gpu 33 °C (gpu max at 87 °C)" in line(findings, "temperature").detail
        assert line(findings, "GPU count").detail == "1 visible"

    async def test_mig_instances_in_the_identity(self, tmp_path: Path) -> None:
        gpu = FakeGpu.h200(0, mig_mode=(1, 1))
        gpu.add_mig(1, "1g.18gb", memory_used=3 * GIB)
        gpu.add_mig(2, "1c.2g.35gb")
        gpu.add_mig(2, "1c.2g.35gb", compute_instance=1)
        findings, code = await check_with(tmp_path, FakeNvml([gpu, FakeGpu.h200(1)]))
        assert code == 0, [(f.name, f.status, f.detail) for f in findings]
        mig, plain = line(findings, "identity").detail.split("; 1: ")
        assert mig.endswith(
            "MIG enabled: GPU instance 1 1g.18gb (3.0 of 18.0 GiB used), "
            "GPU instance 2 2g.35gb (0.0 of 35.0 GiB used)"
        )
        assert "MIG" not in plain

    async def test_lines_fold_across_gpus(self, tmp_path: Path) -> None:
        fake = FakeNvml([FakeGpu.h200(i) for i in range(4)])
        findings, code = await check_with(tmp_path, fake)
        assert code == 0
        assert line(findings, "persistence").name == "GPU 0-3 persistence mode"
        assert line(findings, "PCIe").detail == "gen 5 of 5, x16 of x16"


class TestGpuProblems:
    """Each problem the fake can script shows on its own GPU's line with the right status."""

    @pytest.mark.parametrize(
        ("changes", "fragment", "status", "code"),
        [
            ({"persistence_mode": 0}, "persistence", Status.WARN, 1),
            ({"temperature": 84}, "temperature", Status.WARN, 1),
            ({"temperature": 88}, "temperature", Status.FAIL, 2),
            (
                {"clock_event_reasons": CLOCK_EVENT_REASONS["hw_thermal_slowdown"]},
                "throttling",
                Status.WARN,
                1,
            ),
            (
                {"clock_event_reasons": CLOCK_EVENT_REASONS["sw_thermal_slowdown"]},
                "throttling",
                Status.WARN,
                1,
            ),
            ({"pcie_width": (8, 16)}, "PCIe", Status.WARN, 1),
            ({"remapped_rows": (0, 1, 1, 0)}, "ECC", Status.WARN, 1),
            ({"remapped_rows": (0, 3, 0, 1)}, "ECC", Status.FAIL, 2),
            ({"ecc_mode": (0, 0)}, "ECC", Status.WARN, 1),
            ({"lost": True}, "identity", Status.FAIL, 2),
        ],
    )
    async def test_problem_on_gpu_1(
        self, tmp_path: Path, changes: dict[str, object], fragment: str, status: Status, code: int
    ) -> None:
        fake = FakeNvml([FakeGpu.h200(0), FakeGpu.h200(1, **changes)])
        findings, exit_code = await check_with(tmp_path, fake)
        bad = [f for f in findings if f.status is status and fragment in f.name]
        assert len(bad) == 1, [(f.name, f.status) for f in findings]
        assert bad[0].name.startswith("GPU 1 ")
        assert bad[0].action
        assert exit_code == code

    async def test_uncorrectable_ecc_since_driver_load(self, tmp_path: Path) -> None:
        gpu = FakeGpu.h200(0)
        gpu.ecc[(pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)] = 2
        findings, code = await check_with(tmp_path, FakeNvml([gpu]))
        ecc = line(findings, "ECC")
        assert ecc.status is Status.WARN
        assert "uncorrected volatile 2" in ecc.detail
        assert code == 1

    async def test_idle_link_generation_is_normal(self, tmp_path: Path) -> None:
        findings, code = await check_with(
            tmp_path, FakeNvml([FakeGpu.h200(0, pcie_generation=(1, 5))])
        )
        pcie = line(findings, "PCIe")
        assert pcie.status is Status.OK
        assert "idle GPU lowers its link generation" in pcie.detail
        assert code == 0

    async def test_unsupported_readings_are_na(self, tmp_path: Path) -> None:
        gpu = FakeGpu.h200(0, persistence_mode=None, temperature=None, memory_temperature=None)
        findings, code = await check_with(tmp_path, FakeNvml([gpu]))
        assert line(findings, "persistence").status is Status.NA
        assert line(findings, "temperature").status is Status.NA
        assert code == 0


class TestGpuCount:
    """Fewer GPUs than expected fails; NVML that sees none fails."""

    async def test_fewer_than_expected(self, tmp_path: Path) -> None:
        options = CheckOptions(torch=False, process_gap=0.05, expect_gpus=8)
        findings, code = await check_with(tmp_path, FakeNvml([FakeGpu.h200(0)]), options)
        count = line(findings, "GPU count")
        assert (count.status, count.detail) == (Status.FAIL, "1 visible, 8 expected")
        assert code == 2

    async def test_none_visible(self, tmp_path: Path) -> None:
        findings, code = await check_with(tmp_path, FakeNvml([]))
        assert line(findings, "GPU count").status is Status.FAIL
        assert code == 2


class TestNoDriver:
    """No driver: said plainly, with the kernel module as the second opinion."""

    async def test_nothing_loaded(self, tmp_path: Path) -> None:
        fake = FakeNvml(init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        findings, code = await check_with(tmp_path, fake, proc_version=False)
        [driver] = findings
        assert driver.name == "NVIDIA driver"
        assert driver.status is Status.FAIL
        assert driver.detail.startswith("no NVIDIA driver is present")
        assert "--expect-gpus 0" in driver.action
        assert code == 2

    async def test_module_loaded_but_nvml_fails(self, tmp_path: Path) -> None:
        fake = FakeNvml(init_error=pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH)
        findings, _ = await check_with(tmp_path, fake, proc_version=True)
        assert "kernel module is loaded (NVIDIA UNIX Open Kernel Module" in findings[0].detail
        assert "reboot" in findings[0].action

    async def test_no_gpu_expected(self, tmp_path: Path) -> None:
        options = CheckOptions(torch=False, process_gap=0.05, expect_gpus=0)
        fake = FakeNvml(init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        findings, code = await check_with(tmp_path, fake, options, proc_version=False)
        assert [(f.name, f.status) for f in findings] == [("GPUs", Status.NA)]
        assert fake.init_calls == 0  # not even asked
        assert code == 0


class TestDisk:
    """The disk collector's own round on scripted statvfs answers, judged by its levels."""

    async def _disk_findings(
        self, tmp_path: Path, available: int, inodes_free: int = 500
    ) -> list[Finding]:
        tree = ProcTree(tmp_path / "proc")
        tree.set_mountinfo("28 27 259:3 / /data rw,relatime shared:2 - xfs /dev/nvme1n1 rw\n")
        statvfs = ScriptedStatvfs(
            {
                str(tmp_path / "root" / "data"): fake_statvfs_result(
                    size=100 * GIB, available=available, inodes=1000, inodes_free=inodes_free
                ),
            }
        )
        settings = DiskSettings(proc_root=tree.root, rootfs=tmp_path / "root")
        collector = DiskCollector(settings, make_deps(), statvfs=statvfs)
        with pooled_caller() as caller:
            collection = await run_round(collector, caller)
        return classify_disk(
            CollectorResult("disk", tuple(collection.samples), tuple(collection.events))
        )

    @pytest.mark.parametrize(
        ("available_gib", "inodes_free", "status"),
        [
            (40, 500, Status.OK),
            (7, 500, Status.WARN),
            (2, 500, Status.FAIL),
            (40, 20, Status.FAIL),
        ],
    )
    async def test_levels(
        self, tmp_path: Path, available_gib: int, inodes_free: int, status: Status
    ) -> None:
        findings = await self._disk_findings(tmp_path, available_gib * GIB, inodes_free)
        data = line(findings, "disk /data")
        assert data.status is status, data
        assert f"{available_gib:.1f} GiB available" in data.detail
        assert "(xfs)" in data.detail


class TestProcesses:
    """Two looks at a fixture process table: D state in both is a warning, zombies counted."""

    async def test_d_state_and_zombies(self, tmp_path: Path) -> None:
        tree = ProcTree(tmp_path / "proc")
        tree.add_process(1, "systemd", "S", ppid=0)
        tree.add_process(300, "python", "D", wchan="nfs_wait_on_request")
        tree.add_process(301, "trainer", "S")
        for pid in range(400, 403):
            tree.add_process(pid, "defunct", "Z", ppid=301)
        cfg = load(write_config(tmp_path, proc_root=make_proc_tree(tmp_path / "unused")))
        settings = cfg.collectors["processes"].replace(proc_root=tree.root)
        async with OneShotCollectors("n", {"processes": settings}) as runner:
            result = await runner.run("processes", rounds=2, gap=0.1)
        findings = classify_processes(result, 0.1)
        stuck = line(findings, "D-state")
        assert stuck.status is Status.WARN
        assert "python (pid 300, in nfs_wait_on_request)" in stuck.detail
        zombies = line(findings, "zombie")
        assert (zombies.status, zombies.detail) == (Status.OK, "3 (most under trainer, pid 301)")

    async def test_quiet_table(self, tmp_path: Path) -> None:
        tree = ProcTree(tmp_path / "proc")
        tree.add_process(1, "systemd", "S", ppid=0)
        settings = load(write_config(tmp_path)).collectors["processes"].replace(proc_root=tree.root)
        async with OneShotCollectors("n", {"processes": settings}) as runner:
            result = await runner.run("processes", rounds=2, gap=0.05)
        assert {f.status for f in classify_processes(result, 0.05)} == {Status.OK}


class TestIoProbe:
    """--io-test runs the io_probe collector's own write probe once."""

    async def test_probe_in_tmp(self, tmp_path: Path) -> None:
        cfg = load(write_config(tmp_path, proc_root=make_proc_tree(tmp_path / "proc")))
        (tmp_path / "probe").mkdir()
        options = CheckOptions(
            torch=False, process_gap=0.05, expect_gpus=0, io_test_dir=tmp_path / "probe"
        )
        report = await run_check(cfg, options)
        probe = line(report.findings, "write probe")
        free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
        if free > 2 * GIB:
            assert probe.status is Status.OK, probe
            assert "64 MiB written and fdatasynced" in probe.detail
        else:
            assert probe.status is Status.WARN
        assert list((tmp_path / "probe").iterdir()) == []


class TestFolding:
    """GPU indices in a folded line are written as ranges."""

    @pytest.mark.parametrize(
        ("indices", "text"),
        [
            (["0", "1", "2", "3"], "0-3"),
            (["0", "2", "3", "7"], "0,2-3,7"),
            (["5"], "5"),
            ([], ""),
        ],
    )
    def test_ranges(self, indices: list[str], text: str) -> None:
        assert index_ranges(indices) == text


class TestBench:
    """--bench runs the benchmark collector's own test per GPU; the host's history is not touched."""

    async def test_no_gpu_to_test(self, tmp_path: Path) -> None:
        fake = FakeNvml(init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        cfg = load(write_config(tmp_path, proc_root=make_proc_tree(tmp_path / "proc")))
        shared = SharedServices()
        shared.put(NvmlBackend, NvmlBackend(fake))
        options = CheckOptions(torch=False, process_gap=0.05, expect_gpus=0, bench=True)
        report = await run_check(cfg, options, shared=shared)
        bench = line(report.findings, "matmul benchmark")
        assert bench.status is Status.SKIP
        assert "no GPU to test" in bench.detail

    async def test_child_that_cannot_use_the_gpu_fails(self, tmp_path: Path) -> None:
        # The fake GPU exists only for NVML: the real benchmark child finds no CUDA device here
        # (a CPU-only torch), which is exactly a run that gives no result.
        cfg = load(write_config(tmp_path, proc_root=make_proc_tree(tmp_path / "proc")))
        cfg.state_dir.mkdir(parents=True)
        history = cfg.state_dir / "benchmark-history.jsonl"
        history.write_text("")
        shared = SharedServices()
        shared.put(NvmlBackend, NvmlBackend(FakeNvml([FakeGpu.h200(0)])))
        options = CheckOptions(torch=False, process_gap=0.05, bench=True)
        report = await run_check(cfg, options, shared=shared)
        bench = line(report.findings, "GPU 0 benchmark")
        assert bench.status is Status.FAIL
        assert "the test gave no result" in bench.detail
        assert report.exit_code == 2
        assert history.read_text() == ""
