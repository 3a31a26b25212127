"""The kernel log in check and diag: the kernel_log side's own reader and matchers on saved
records and on a /dev/kmsg stand-in, judged per finding; raw NVIDIA lines in the bundle."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

from agent.program.diagnose.check import CheckOptions, run_check
from agent.program.diagnose.diag import DiagOptions, build_bundle
from agent.program.diagnose.findings import Status
from agent.program.diagnose.kernel_findings import classify_kernel_log, scan_kernel_log
from collectors._xid_catalog import catalog_version
from collectors.kernel_log.collector import KernelLogSettings
from tests.support.diag import load, make_proc_tree, write_config
from tests.support.kmsg import FIXTURES, FakeKmsg, capture_records, write_boot_id

SAVED = FIXTURES / "kmsg.txt"
ROOT = Path(__file__).resolve().parent.parent


def boot_id(tmp_path: Path) -> Path:
    return write_boot_id(tmp_path / "boot_id", "5d1c0e6a-7b2f-4e08-9a3c-1f2e3d4c5b6a")


class TestSavedLog:
    """A file of saved records: every finding, grouped, worst severity wins."""

    def test_findings_grouped(self) -> None:
        scan = scan_kernel_log(KernelLogSettings(path=SAVED))
        assert scan.error == ""
        lines = {f.name: f for f in classify_kernel_log(scan)}
        xid79 = lines["Xid 79 0000:3b:00.0"]
        assert xid79.status is Status.FAIL
        assert "fallen off the bus" in xid79.detail
        assert xid79.action
        assert lines["io error sdb"].status is Status.FAIL
        assert any(name.startswith("Xid 13") for name in lines)

    async def test_exit_code_of_check(self, tmp_path: Path) -> None:
        extra = f'[collectors.kernel_log]\npath = "{SAVED}"\n'
        cfg = load(write_config(tmp_path, proc_root=make_proc_tree(tmp_path / "proc"), extra=extra))
        report = await run_check(cfg, CheckOptions(torch=False, expect_gpus=0, process_gap=0.05))
        kernel = [f for f in report.findings if f.area == "kernel"]
        assert {f.status for f in kernel} >= {Status.FAIL, Status.WARN}
        assert report.exit_code == 2

    def test_check_names_the_catalog_version(self, tmp_path: Path) -> None:
        """`gpuwarden check` says which Xid catalog judged the kernel log, as text and JSON."""
        extra = f'[collectors.kernel_log]\npath = "{SAVED}"\n'
        cfg = write_config(tmp_path, proc_root=make_proc_tree(tmp_path / "proc"), extra=extra)
        base = [sys.executable, "-m", "agent", "check", "--config", str(cfg)]
        base += ["--expect-gpus", "0", "--no-torch"]
        runs = {
            form: subprocess.run(
                base + flags, capture_output=True, text=True, timeout=120, check=False, cwd=ROOT
            )
            for form, flags in (("text", []), ("json", ["--json"]))
        }
        assert f"Xid catalog {catalog_version()}" in runs["text"].stdout, runs["text"].stderr
        data = json.loads(runs["json"].stdout)
        assert data["xid_catalog"]["version"] == catalog_version()
        assert "nvidia-xid-catalog" in data["xid_catalog"]["sources"]

    def test_unreadable(self, tmp_path: Path) -> None:
        scan = scan_kernel_log(KernelLogSettings(path=tmp_path / "missing.log"))
        [line] = classify_kernel_log(scan)
        assert line.status is Status.WARN
        assert "cannot read it" in line.detail


class TestLiveRingBuffer:
    """/dev/kmsg semantics (the stand-in): the whole buffer of this boot is read once."""

    def test_h200_capture_is_clean(self, tmp_path: Path) -> None:
        kmsg = FakeKmsg.with_records(capture_records())
        settings = KernelLogSettings(boot_id_path=boot_id(tmp_path))
        scan = scan_kernel_log(settings, io=kmsg)
        [line] = classify_kernel_log(scan)
        assert line.status is Status.OK
        assert f"in {len(kmsg.records)} records" in line.detail
        assert any(
            "NVRM: loading NVIDIA UNIX Open Kernel Module" in raw for raw in scan.raw_lines()
        )
        assert kmsg.fds == {}  # the descriptor was closed

    def test_forged_user_space_xid_is_not_a_finding(self, tmp_path: Path) -> None:
        kmsg = FakeKmsg.with_records(capture_records())
        kmsg.write(
            "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus.", facility=1
        )
        scan = scan_kernel_log(KernelLogSettings(boot_id_path=boot_id(tmp_path)), io=kmsg)
        [line] = classify_kernel_log(scan)
        assert line.status is Status.OK
        assert "1 look-alike line(s) from user space ignored" in line.detail
        assert scan.raw_lines()[-1].endswith("<written from user space, facility 1>")

    def test_xid_in_buffer(self, tmp_path: Path) -> None:
        kmsg = FakeKmsg.with_records(capture_records())
        for _ in range(3):
            kmsg.write(
                "NVRM: Xid (PCI:0000:18:00): 48, pid='<unknown>', name=<unknown>, "
                "An uncorrectable double bit error (DBE) has been detected on GPU"
            )
        scan = scan_kernel_log(KernelLogSettings(boot_id_path=boot_id(tmp_path)), io=kmsg)
        [line] = classify_kernel_log(scan)
        assert line.name == "Xid 48 0000:18:00.0"
        assert line.status is Status.FAIL
        assert "(3 times)" in line.detail


class TestBundle:
    """The findings and the raw NVIDIA and I/O lines go into the bundle, redacted but intact."""

    async def test_kernel_members(self, tmp_path: Path) -> None:
        extra = f'[collectors.kernel_log]\npath = "{SAVED}"\n'
        cfg = load(
            write_config(
                tmp_path / "conf", proc_root=make_proc_tree(tmp_path / "proc"), extra=extra
            )
        )
        out = tmp_path / "b.tar.gz"
        await build_bundle(cfg, DiagOptions(output=out, run_torch_probe=False, process_gap=0.05))
        with tarfile.open(out) as tar:
            members = {
                m.name.split("/", 1)[1]: tar.extractfile(m).read().decode()  # type: ignore[union-attr]
                for m in tar.getmembers()
            }
        findings = json.loads(members["kernel-log/findings.json"])
        assert findings["records_read"] >= 20  # records, not lines: some carry continuation lines
        assert {f["kind"] for f in findings["findings"]} >= {"xid", "sxid", "io_error", "fs_error"}
        raw = members["kernel-log/nvidia-and-io-lines.txt"]
        assert (
            "NVRM: Xid (PCI:0000:3b:00): 79, pid=2314, name=python3, GPU has fallen off the bus."
            in raw
        )
        assert "nvme nvme0: 16/0/0 default/read/poll queues" in raw
