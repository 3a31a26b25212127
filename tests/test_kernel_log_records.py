"""Kernel-log findings in the words other kernels and drivers use (issue 12, classes 1, 5, 6, 7):
MIG-attributed Xids, records the driver writes over several lines, OOM kills in older and
newer kernels' words, and the host faults a GPU host dies of. Each line's format is quoted
from the source that prints it (named beside it); the values in it are made up.

Every test goes through `MatcherSet`, the daemon's and `scan`'s entry point, and most also
through `scan_lines`, so the prefilter in front of the matchers is tested with them.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.contracts.model import Severity
from agent.program.cli import main as cli_main
from agent.program.commands.scan import scan_lines
from collectors._xid import XidCorrelator
from collectors.kernel_log.matchers import KINDS, Finding, MatcherSet
from collectors.kernel_log.parse import LogRecord, ParseStats, parse_lines
from tests.support.klog_shapes import SHAPES, Record, render
from tests.support.kmsg import FakeKmsg, capture_records
from tests.test_kmsg_collector import IDENTITY, PCI, Harness


def records(*messages: str) -> list[LogRecord]:
    return [LogRecord(message=m, line=i) for i, m in enumerate(messages, 1)]


def scan(*messages: str) -> list[Finding]:
    """Findings of records fed one by one, as the daemon feeds them."""
    return list(MatcherSet().scan(records(*messages)))


def scan_dmesg(*messages: str) -> list[Finding]:
    """Findings of the same messages saved as `dmesg` lines, through `gpuwarden scan`'s path."""
    lines = [f"[{i:5d}.000000] {m}\n" for i, m in enumerate(messages, 1)]
    return scan_lines(lines, ParseStats())


@pytest.fixture
def pool() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    executor = concurrent.futures.ThreadPoolExecutor(2)
    yield executor
    executor.shutdown(wait=True)


BOTH = pytest.mark.parametrize("way", [scan, scan_dmesg], ids=["records", "dmesg"])


# --- class 1: MIG-attributed Xids -----------------------------------------------------------
# open-gpu-kernel-modules src/nvidia/src/kernel/gpu/rc/kernel_rc.c, XID_PRINT_WITH_ATTR:
#   "NVRM: Xid (PCI:%04x:%02x:%02x GPU-I:%02u GPU-CI:%02u): %d, pid=%s, name=%s, %s%s"
#   "NVRM: Xid (PCI:%04x:%02x:%02x GPU-I:%02u): %d, %s%s"            (no process known)
# and the example in kern_gpu_error_cont_ga100.c's comment:
#   "NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94, pid=7194, Contained: CE User Channel (0x9). ..."
MIG_LINES = [
    (
        "NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94, pid=7194, name=python3, Contained: CE User "
        "Channel (0x9). RST: No, D-RST: No",
        ("0000:01:00.0", 94, 5, None, 7194, "python3"),
    ),
    (
        "NVRM: Xid (PCI:0000:3b:00 GPU-I:02 GPU-CI:01): 13, pid=4411, name=train.py, Graphics "
        "SM Warp Exception on (GPC 1, TPC 0, SM 1): Out Of Range Address",
        ("0000:3b:00.0", 13, 2, 1, 4411, "train.py"),
    ),
    (
        "NVRM: Xid (PCI:0000:C1:00 GPU-I:14 GPU-CI:07): 31, Ch 00000008, intr 00000000. MMU "
        "Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f12_34560000.",
        ("0000:c1:00.0", 31, 14, 7, None, ""),
    ),
]


class TestMigXid:
    """An Xid the driver attributes to a MIG instance is an Xid, with its instances."""

    @BOTH
    @pytest.mark.parametrize(("line", "want"), MIG_LINES)
    def test_parsed_with_instances(
        self,
        way: object,
        line: str,
        want: tuple[str, int, int, int | None, int | None, str],
    ) -> None:
        assert callable(way)
        [finding] = way(line)
        got = (
            finding.pci_bus_id,
            finding.code,
            finding.attributes.get("gpu_instance"),
            finding.attributes.get("compute_instance"),
            finding.pid,
            finding.process,
        )
        assert (finding.kind, *got) == ("xid", *want)
        assert finding.to_dict()["gpu_instance"] == want[2]

    def test_scan_json_carries_instances(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """`gpuwarden scan --json` prints the GPU and compute instance of each MIG Xid."""
        log = tmp_path / "mig.log"
        log.write_text("".join(f"[ {i}.5] {line}\n" for i, (line, _) in enumerate(MIG_LINES)))
        cli_main(["scan", "--json", str(log)])
        out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert [(f["xid"], f["gpu_instance"], f.get("compute_instance")) for f in out] == [
            (94, 5, None),
            (13, 2, 1),
            (31, 14, 7),
        ]

    async def test_event_carries_instances(
        self, tmp_path: Path, pool: concurrent.futures.ThreadPoolExecutor
    ) -> None:
        """The daemon's Xid event (kernel log through the correlator) names the instances."""
        h = Harness(tmp_path, FakeKmsg.with_records(capture_records()), pool)
        h.shared.get(XidCorrelator, XidCorrelator).set_identity(PCI, IDENTITY)
        h.device.write(MIG_LINES[1][0])
        events, _ = await h.collect()
        [event] = events
        assert (event.kind, event.attributes["xid"]) == ("xid", 13)
        assert (event.attributes["gpu_instance"], event.attributes["compute_instance"]) == (2, 1)
        assert "GPU instance 2, compute instance 1" in event.message
        await h.collector.close()


# --- class 5: multi-line records ------------------------------------------------------------
# open-gpu-kernel-modules src/common/nvswitch/kernel/inc/common_nvswitch.h NVSWITCH_PRINT_SXID
# ("nvidia-%s: SXid (PCI:" NVLINK_PCI_DEV_FMT "): %05d, " fmt), intr_nvswitch.h
# NVSWITCH_REPORT_FATAL ("Fatal, Link %02d %s%s"), then error_nvswitch.c
# _nvswitch_dump_error_entry: "Severity %d Engine instance %02d Sub-engine instance %02d" and one
# or two "Data {0x%08x, ...}" lines, each with the same SXid prefix.
SXID_RECORD = (
    "nvidia-nvswitch3: SXid (PCI:0000:c6:00.0): 24007, Fatal, Link 58 sourcetrack TCEN0 "
    "crumbstore ECC DBE Error (First)",
    "nvidia-nvswitch3: SXid (PCI:0000:c6:00.0): 24007, Severity 1 Engine instance 58 "
    "Sub-engine instance 00",
    "nvidia-nvswitch3: SXid (PCI:0000:c6:00.0): 24007, Data {0x00000000, 0x00000001, "
    "0x00000000, 0x0000003a, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000}",
    "nvidia-nvswitch3: SXid (PCI:0000:c6:00.0): 24007, Data {0x00000010, 0x00000000, "
    "0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000}",
)
# osapi.c (RmInitAdapter's register check) prints this as ONE printk with embedded newlines:
# one /dev/kmsg record, three lines in `dmesg`.
BUS_BLOCK = (
    "NVRM: The NVIDIA GPU 0000:18:00.0",
    "NVRM: (PCI ID: 10de:2335) installed in this system has",
    "NVRM: fallen off the bus and is not responding to commands.",
)
XID79_18 = "NVRM: Xid (PCI:0000:18:00): 79, pid=2211, name=python3, GPU has fallen off the bus."
# Drivers before the 4xx series (public bug reports of the 3xx drivers): the older wording, the
# board line, then the Xid 79.
OLD_BUS = (
    "NVRM: GPU at 0000:02:00.0 has fallen off the bus.",
    "NVRM: GPU is on Board 0324117170315.",
    "NVRM: Xid (PCI:0000:02:00): 79, GPU has fallen off the bus.",
)


class TestMultiLineRecords:
    """What the driver writes as one record is one finding."""

    @BOTH
    def test_sxid_follow_up_lines_join_their_sxid(self, way: object) -> None:
        """Header, Severity and two Data lines: one SXid, at the header, with the details."""
        assert callable(way)
        [finding] = way(*SXID_RECORD, "usb 1-1: new device")
        assert (finding.kind, finding.code, finding.line) == ("sxid", 24007, 1)
        assert finding.device == "nvidia-nvswitch3"
        assert finding.attributes["nvswitch_severity"] == 1
        assert finding.attributes["engine_instance"] == 58
        assert "0x0000003a" in str(finding.attributes["data"])
        assert "0x00000010" in str(finding.attributes["data"])

    @BOTH
    def test_two_sxids_each_with_follow_ups(self, way: object) -> None:
        """A new header (same code, another link) starts a new SXid; lines of another switch
        written in between do not break a record."""
        assert callable(way)
        other = SXID_RECORD[0].replace("Link 58", "Link 59")
        found = way(
            SXID_RECORD[0],
            "nvidia-nvswitch1: SXid (PCI:0000:c4:00.0): 12028, Non-fatal, Link 02 egress error",
            *SXID_RECORD[1:],
            other,
            *SXID_RECORD[1:3],
        )
        assert [(f.device, f.code, f.line) for f in found] == [
            ("nvidia-nvswitch3", 24007, 1),
            ("nvidia-nvswitch1", 12028, 2),
            ("nvidia-nvswitch3", 24007, 6),
        ]
        assert "0x00000010" in str(found[0].attributes["data"])
        assert "engine_instance" not in found[1].attributes

    @BOTH
    def test_fallen_off_block_then_its_xid_79_is_one_finding(self, way: object) -> None:
        """The three-line block and the Xid 79 after it: one Xid 79 with the block's facts."""
        assert callable(way)
        [finding] = way(*BUS_BLOCK, XID79_18)
        assert (finding.kind, finding.code, finding.pci_bus_id) == ("xid", 79, "0000:18:00.0")
        assert finding.attributes["pci_device_id"] == "10de:2335"
        assert finding.attributes["fallen_off_bus_line"] == 1
        assert finding.severity is Severity.CRITICAL

    def test_a_block_long_before_an_xid_79_is_its_own_finding(self) -> None:
        """Hundreds of lines apart they are two incidents, whatever lies between."""
        found = scan_dmesg(*BUS_BLOCK, *["usb 1-1: new device"] * 200, XID79_18)
        assert [(f.kind, f.line) for f in found] == [("gpu_fallen_off_bus", 1), ("xid", 204)]
        assert "fallen_off_bus_line" not in found[1].attributes

    def test_fallen_off_block_in_one_record(self) -> None:
        """/dev/kmsg keeps the block as one record with newlines in it: still a finding."""
        [alone] = scan("\n".join(BUS_BLOCK))
        assert (alone.kind, alone.pci_bus_id) == ("gpu_fallen_off_bus", "0000:18:00.0")
        assert alone.attributes["pci_device_id"] == "10de:2335"
        [merged] = scan("\n".join(BUS_BLOCK), XID79_18)
        assert (merged.kind, merged.code) == ("xid", 79)

    @BOTH
    def test_older_wording_is_fallen_off_the_bus(self, way: object) -> None:
        """`GPU at <bdf> has fallen off the bus.` alone is a finding; with its Xid 79, one."""
        assert callable(way)
        [alone] = way(*OLD_BUS[:2])
        assert (alone.kind, alone.pci_bus_id, alone.severity) == (
            "gpu_fallen_off_bus",
            "0000:02:00.0",
            Severity.CRITICAL,
        )
        [merged] = way(*OLD_BUS)
        assert (merged.kind, merged.code, merged.pci_bus_id) == ("xid", 79, "0000:02:00.0")

    @BOTH
    def test_xid_79_then_the_one_line_form_is_one_finding(self, way: object) -> None:
        """osinit.c RmCheckForGpuLost: the Xid 79 first, then `GPU <bdf>: GPU has fallen off
        the bus.` and the serial number: one finding (as before)."""
        assert callable(way)
        found = way(
            XID79_18,
            "NVRM: GPU 0000:18:00.0: GPU has fallen off the bus.",
            "NVRM: GPU 0000:18:00.0: GPU serial number is 1654321098765.",
        )
        assert [(f.kind, f.code) for f in found] == [("xid", 79)]

    def test_findings_come_in_line_order(self) -> None:
        """A record held open for its follow-ups does not reorder what scan prints."""
        found = scan_dmesg(
            *BUS_BLOCK, "I/O error, dev sdb, sector 8 op 0x1:(WRITE) flags 0x0", *SXID_RECORD[:2]
        )
        assert [f.line for f in found] == sorted(f.line for f in found)
        assert [f.kind for f in found] == ["gpu_fallen_off_bus", "io_error", "sxid"]


# --- class 6: OOM kills ---------------------------------------------------------------------
# mm/oom_kill.c: dump_oom_summary (4.19+) "oom-kill:constraint=%s,nodemask=%*pbl,cpuset=...,
# mems_allowed=...,task_memcg=...,task=%s,pid=%d,uid=%d", then __oom_kill_process
# "%s: Killed process %d (%s) total-vm:%lukB, ..." (message "Out of memory" or "Memory cgroup
# out of memory"); RHEL 7's kernel and older ones "Killed process %d, UID %d, (%s) total-vm:...".
# systemd names a forked child "(sd-...)" or "(resolved)" until it execs: the parentheses are
# part of the name.
OOM_SUMMARY = (
    "oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0-1,"
    "oom_memcg=/kubepods/pod7,task_memcg=/kubepods/pod7/c1,task=python3,pid=9876,uid=1000"
)


class TestOomKills:
    """Every kernel's wording of an OOM kill is one oom_kill finding with pid and name."""

    @BOTH
    @pytest.mark.parametrize(
        ("line", "pid", "process", "uid"),
        [
            (
                "Killed process 7537, UID 0, (java) total-vm:12345678kB, anon-rss:1234567kB, "
                "file-rss:0kB, shmem-rss:0kB",
                7537,
                "java",
                0,
            ),
            (
                "Memory cgroup out of memory: Killed process 3451, UID 1000, (pt_main_thread) "
                "total-vm:8123456kB, anon-rss:7123456kB, file-rss:1024kB, shmem-rss:0kB",
                3451,
                "pt_main_thread",
                1000,
            ),
            (
                "Out of memory: Killed process 812 ((resolved)) total-vm:1024kB, anon-rss:12kB, "
                "file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:44kB oom_score_adj:0",
                812,
                "(resolved)",
                0,
            ),
            (
                "Out of memory: Killed process 55 (Web (Content)) total-vm:1kB, anon-rss:1kB, "
                "file-rss:0kB, shmem-rss:0kB, UID:1000 pgtables:4kB oom_score_adj:0",
                55,
                "Web (Content)",
                1000,
            ),
            (
                OOM_SUMMARY.replace("task=python3", "task=(sd-pam)"),
                9876,
                "(sd-pam)",
                1000,
            ),
        ],
    )
    def test_wordings(self, way: object, line: str, pid: int, process: str, uid: int) -> None:
        assert callable(way)
        [finding] = way(line)
        assert (finding.kind, finding.pid, finding.process, finding.attributes.get("uid")) == (
            "oom_kill",
            pid,
            process,
            uid,
        )
        assert process in finding.meaning

    @BOTH
    def test_summary_and_kill_line_are_one_finding(self, way: object) -> None:
        """The summary line and the `Killed process` line after it: one kill, with the
        summary's constraint and cgroup, at the kill line."""
        assert callable(way)
        kill = (
            "Memory cgroup out of memory: Killed process 9876 (python3) total-vm:1kB, "
            "anon-rss:1kB, file-rss:0kB, shmem-rss:0kB, UID:1000 pgtables:4kB oom_score_adj:0"
        )
        [finding] = way(OOM_SUMMARY, kill)
        assert (finding.kind, finding.pid, finding.line) == ("oom_kill", 9876, 2)
        assert finding.attributes["constraint"] == "CONSTRAINT_MEMCG"
        assert finding.attributes["memcg"] == "/kubepods/pod7/c1"

    def test_two_kills_are_two_findings(self) -> None:
        """A summary for another pid does not swallow a kill."""
        found = scan(
            OOM_SUMMARY,
            "Out of memory: Killed process 1111 (a) total-vm:1kB",
            OOM_SUMMARY.replace("pid=9876", "pid=2222"),
            "Out of memory: Killed process 2222 (b) total-vm:1kB",
        )
        assert [f.pid for f in found] == [9876, 1111, 2222]


# --- class 7: host faults -------------------------------------------------------------------
HOST_FAULTS = [
    # drivers/md/raid1.c raid1_error: one pr_crit with two lines
    (
        "md/raid1:md0: Disk failure on sdb1, disabling device.\n"
        "md/raid1:md0: Operation continuing on 1 devices.",
        "raid_member_failed",
        "sdb1",
        Severity.CRITICAL,
    ),
    # drivers/md/raid5.c raid5_error
    (
        "md/raid:md127: Disk failure on nvme2n1, disabling device.",
        "raid_member_failed",
        "nvme2n1",
        Severity.CRITICAL,
    ),
    # fs/ext3/super.c ext3_handle_error (kernels before 4.3)
    (
        "EXT3-fs (sda1): error: remounting filesystem read-only",
        "fs_error",
        "sda1",
        Severity.CRITICAL,
    ),
    # fs/ext4/super.c ext4_handle_error
    (
        "EXT4-fs (nvme0n1p2): Remounting filesystem read-only",
        "fs_error",
        "nvme0n1p2",
        Severity.CRITICAL,
    ),
    # fs/btrfs: btrfs_handle_fs_error -> "forced readonly" (device, then state letters in 6.x)
    (
        "BTRFS info (device sdc1 state EA): forced readonly",
        "fs_error",
        "sdc1",
        Severity.CRITICAL,
    ),
    # fs/xfs/xfs_fsops.c xfs_do_force_shutdown
    (
        "XFS (dm-3): Filesystem has been shut down due to log error (0x2).",
        "fs_error",
        "dm-3",
        Severity.CRITICAL,
    ),
    # drivers/nvme/host/multipath.c nvme_ns_head_submit_bio
    (
        "block nvme1n1: no available path - failing I/O",
        "nvme_error",
        "nvme1n1",
        Severity.CRITICAL,
    ),
    # block/blk-core.c handle_bad_sector: one printk with two lines (5.12+ wording)
    (
        "kworker/u8:2: attempt to access beyond end of device\n"
        "sda1: rw=1, sector=123456, nr_sectors = 8 limit=100000",
        "io_error",
        "sda1",
        Severity.CRITICAL,
    ),
    # drivers/md/md.c super_written
    ("md: super_written gets error=-5", "raid_member_failed", "", Severity.CRITICAL),
    # fs/btrfs/disk-io.c write_dev_supers
    (
        "BTRFS error (device sdb): error writing primary super block to device 1",
        "fs_error",
        "sdb",
        Severity.CRITICAL,
    ),
    # fs/jbd2/journal.c jbd2_write_superblock
    (
        "JBD2: Error -5 detected when updating journal superblock for sda1-8.",
        "fs_error",
        "sda1-8",
        Severity.CRITICAL,
    ),
    # fs/ext4/page-io.c ext4_end_bio
    (
        "EXT4-fs warning (device sda1): ext4_end_bio:343: I/O error 10 writing to inode 1234 "
        "starting block 5678)",
        "io_error",
        "sda1",
        Severity.CRITICAL,
    ),
    # kernel/panic.c panic()
    ("Kernel panic - not syncing: Fatal exception", "kernel_panic", "", Severity.CRITICAL),
    # arch/x86/kernel/dumpstack.c __die_header: "%s: %04lx [#%d]%s%s%s%s%s"
    ("Oops: 0002 [#1] PREEMPT SMP NOPTI", "kernel_oops", "", Severity.CRITICAL),
    (
        "general protection fault, probably for non-canonical address 0xdead000000000100: "
        "0000 [#1] SMP NOPTI",
        "kernel_oops",
        "",
        Severity.CRITICAL,
    ),
    # kernel/watchdog.c watchdog_timer_fn, and the perf hard-lockup detector
    (
        "watchdog: BUG: soft lockup - CPU#7 stuck for 22s! [python3:4321]",
        "cpu_lockup",
        "",
        Severity.WARNING,
    ),
    ("watchdog: Watchdog detected hard LOCKUP on cpu 12", "cpu_lockup", "", Severity.CRITICAL),
    # arch/x86/kernel/cpu/mce/core.c print_mce / mce_notify_irq
    (
        "mce: [Hardware Error]: CPU 3: Machine Check Exception: 5 Bank 7: be00000000800400",
        "machine_check",
        "",
        Severity.CRITICAL,
    ),
    (
        "mce: [Hardware Error]: CPU 0: Machine Check: 0 Bank 18: dc2040000000011b",
        "machine_check",
        "",
        Severity.WARNING,
    ),
    ("mce: [Hardware Error]: Machine check events logged", "machine_check", "", Severity.WARNING),
    # drivers/acpi/apei/ghes.c ("%s{%u}" HW_ERR prefix) and drivers/firmware/efi/cper.c
    (
        "{2}[Hardware Error]: Hardware error from APEI Generic Hardware Error Source: 0",
        "hardware_error",
        "",
        Severity.WARNING,
    ),
    # drivers/pci/pcie/aer.c aer_print_error, a device that is not a GPU
    (
        "mlx5_core 0000:83:00.0: AER: PCIe Bus Error: severity=Uncorrected (Fatal), "
        "type=Transaction Layer, (Requester ID)",
        "pcie_error",
        "0000:83:00.0",
        Severity.CRITICAL,
    ),
    # drivers/edac/edac_mc.c edac_ue_error
    (
        "EDAC MC1: 1 UE memory read error on CPU_SrcID#1_Ha#0_Chan#0_DIMM#1 (channel:0 slot:1)",
        "memory_error",
        "CPU_SrcID#1_Ha#0_Chan#0_DIMM#1",
        Severity.CRITICAL,
    ),
]


class TestHostFaults:
    """Host faults that kill GPU jobs are named, with meaning and action."""

    @BOTH
    @pytest.mark.parametrize(("line", "kind", "device", "severity"), HOST_FAULTS)
    def test_fault(
        self, way: object, line: str, kind: str, device: str, severity: Severity
    ) -> None:
        assert callable(way)
        [finding] = way(*line.split("\n")) if way is scan_dmesg else way(line)
        assert (finding.kind, finding.device, finding.severity) == (kind, device, severity)
        assert kind in KINDS
        assert finding.name
        assert finding.meaning
        assert finding.action
        assert finding.to_dict()["name"] == finding.name
        if device:
            assert device in finding.meaning

    @pytest.mark.parametrize(
        "line", [f[0] for f in HOST_FAULTS if "only" in f[0] or "shut" in f[0]]
    )
    def test_read_only_file_systems_say_so(self, line: str) -> None:
        """A file system that went read-only (or XFS shut down) is an fs_error that says so."""
        [finding] = scan(line)
        assert finding.attributes["read_only"] is True
        assert "read-only" in finding.name or "shut down" in finding.name

    def test_raid_remaining_devices(self) -> None:
        [finding] = scan(HOST_FAULTS[0][0])
        assert (finding.attributes["array"], finding.attributes["remaining_devices"]) == ("md0", 1)

    def test_beyond_end_of_device_over_two_lines(self) -> None:
        """`dmesg` prints the two lines of handle_bad_sector's printk apart: one finding."""
        [finding] = scan_dmesg(
            "python3: attempt to access beyond end of device",
            "nvme0n1p1: rw=0, want=2048, limit=1024",
        )
        assert (finding.kind, finding.device, finding.process) == ("io_error", "nvme0n1p1", "")

    def test_oops_block_is_one_finding(self) -> None:
        """mm/fault.c's `BUG: kernel NULL pointer dereference` and the die line after it."""
        found = scan_dmesg(
            "BUG: kernel NULL pointer dereference, address: 0000000000000008",
            "#PF: supervisor read access in kernel mode",
            "Oops: 0000 [#1] PREEMPT SMP NOPTI",
            "CPU: 3 PID: 4321 Comm: python3 Tainted: P           OE      6.8.0-49-generic",
            "RIP: 0010:nv_dma_map+0x2a/0x90 [nvidia]",
            "Kernel panic - not syncing: Fatal exception",
        )
        assert [f.kind for f in found] == ["kernel_oops", "kernel_panic"]
        assert "NULL pointer" in str(found[0].attributes["text"])
        assert found[1].attributes["reason"] == "Fatal exception"

    def test_machine_check_block_is_one_finding(self) -> None:
        """print_mce's lines after the `Machine Check Exception` line belong to it."""
        found = scan_dmesg(
            "mce: [Hardware Error]: CPU 3: Machine Check Exception: 5 Bank 7: be00000000800400",
            "mce: [Hardware Error]: RIP !INEXACT! 10:<ffffffff81a6f0c4> {intel_idle+0xd4/0x130}",
            "mce: [Hardware Error]: TSC 0 ADDR 1f2f4c0 MISC 38a0000086",
            "mce: [Hardware Error]: PROCESSOR 0:50657 TIME 1600000000 SOCKET 0 APIC 6 microcode 1",
            "mce: [Hardware Error]: Run the above through 'mcelog --ascii'",
            "mce: [Hardware Error]: Machine check: Processor context corrupt",
            "Kernel panic - not syncing: Fatal machine check",
        )
        assert [f.kind for f in found] == ["machine_check", "kernel_panic"]
        assert (found[0].attributes["cpu"], found[0].attributes["bank"]) == (3, 7)

    def test_cper_record_severity_from_its_lines(self) -> None:
        """A CPER record's lines share its `{N}`; `event severity:` sets the finding's."""
        found = scan_dmesg(
            "{1}[Hardware Error]: Hardware error from APEI Generic Hardware Error Source: 0",
            "{1}[Hardware Error]: event severity: fatal",
            "{1}[Hardware Error]:  Error 0, type: fatal",
            "{1}[Hardware Error]:   section_type: PCIe error",
            "{2}[Hardware Error]: Hardware error from APEI Generic Hardware Error Source: 1",
            "{2}[Hardware Error]: event severity: corrected",
            "{2}[Hardware Error]:   section_type: memory error",
        )
        assert [(f.kind, f.severity, f.line) for f in found] == [
            ("hardware_error", Severity.CRITICAL, 1),
            ("hardware_error", Severity.WARNING, 5),
        ]
        assert "PCIe error" in str(found[0].attributes["text"])

    @pytest.mark.parametrize(
        "line",
        [
            # ordinary lines next to the faults above
            "md/raid1:md0: active with 2 out of 2 mirrors",
            "md: md0: resync done.",
            "EXT4-fs (sda1): re-mounted 1c2d3e4f. Quota mode: none.",
            "BTRFS info (device sdc1): using crc32c (crc32c-intel) checksum algorithm",
            "XFS (dm-3): Ending clean mount",
            "block nvme1n1: the capability attribute has been deprecated.",
            "mce: CPU0: Thermal monitoring enabled (TM1)",
            "NMI watchdog: Enabled. Permanently consumes one hw-PMU counter.",
            "Kernel command line: BOOT_IMAGE=/vmlinuz panic=10 oops=panic",
            "pstore: Registered efi_pstore as persistent store backend",
            "ERST: Error Record Serialization Table (ERST) support is initialized.",
            "HEST: Table parsing has been initialized.",
            "GHES: APEI firmware first mode is enabled by APEI bit.",
        ],
    )
    def test_ordinary_lines_are_no_findings(self, line: str) -> None:
        assert scan(line) == []
        assert scan_dmesg(line) == []


# --- the prefilter ------------------------------------------------------------------------------
FINDING_LINES = [
    *(line for line, _ in MIG_LINES),
    *SXID_RECORD,
    *BUS_BLOCK,
    XID79_18,
    *OLD_BUS,
    OOM_SUMMARY,
    "Out of memory: Killed process 9876 (python3) total-vm:1kB",
    *(line for fault in HOST_FAULTS for line in fault[0].split("\n")),
    "INFO: task python3:55012 blocked for more than 245 seconds.",
    "nvme nvme1: I/O 234 QID 7 timeout, reset controller",
    "Oops: 0000 [#1] PREEMPT SMP NOPTI",
    "BUG: kernel NULL pointer dereference, address: 0000000000000008",
    "{1}[Hardware Error]: event severity: fatal",
]
NOISE = [
    "usb 1-1: new high-speed USB device number 2 using xhci_hcd",
    "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  580.159.04",
    "EXT4-fs (sda1): mounted filesystem with ordered data mode.",
    "      Tainted: P           OE      6.8.0-49-generic #49-Ubuntu",
    'audit: type=1400 audit(1700000000.123:45): apparmor="STATUS"',
]


def _as_dmesg(messages: list[str]) -> list[str]:
    return [f"[{i:5d}.000000] {m}\n" for i, m in enumerate(messages, 1)]


class TestPrefilter:
    """`scan` skips lines that hold none of the words a finding needs: it finds exactly what
    feeding every record to the matchers finds."""

    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.sampled_from(FINDING_LINES + NOISE), max_size=30))
    def test_same_findings_as_the_full_path(self, messages: list[str]) -> None:
        lines = _as_dmesg(messages)
        slow = MatcherSet(prefilter=False)
        want = sorted(
            (f.line, f.kind, f.code, f.pid, f.device, f.pci_bus_id)
            for f in slow.scan(parse_lines(lines, ParseStats()))
        )
        stats = ParseStats()
        got = sorted(
            (f.line, f.kind, f.code, f.pid, f.device, f.pci_bus_id)
            for f in scan_lines(lines, stats)
        )
        assert got == want
        assert stats.lines == len(lines)

    def test_malformed_lines_that_could_hold_a_finding_are_counted(self) -> None:
        """A broken line with a finding's words in it is parsed, and counted as malformed;
        every line, parsed or not, is counted."""
        stats = ParseStats()
        lines = [
            "6,notanumber,17,-;NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.\n",
            "6,notanumber,18,-;usb 1-1: new device\n",
            "[  5.000000] NVRM: Xid (PCI:0000:3b:00): 13, Graphics Exception\n",
        ]
        found = scan_lines(lines, stats)
        assert [(f.code, f.line) for f in found] == [(13, 3)]
        assert (stats.lines, stats.malformed) == (3, 1)

    def test_every_finding_line_passes_and_noise_does_not(self) -> None:
        """A line that is a finding on its own (without the prefilter) is a candidate."""
        matchers = MatcherSet()
        alone = [m for m in FINDING_LINES if list(MatcherSet(prefilter=False).scan(records(m)))]
        assert len(alone) > 30
        assert all(matchers.candidate(m) and matchers.candidate_line(m) for m in alone)
        assert not any(matchers.candidate(line) for line in NOISE[:2] + NOISE[3:])


class TestLiveRecords:
    """The daemon reads records in batches: a record complete in a batch is raised in that
    round, not held for a later record."""

    async def test_sxid_raised_in_the_round_it_was_read(
        self, tmp_path: Path, pool: concurrent.futures.ThreadPoolExecutor
    ) -> None:
        h = Harness(tmp_path, FakeKmsg.with_records(capture_records()), pool)
        await h.collect()
        for line in SXID_RECORD:
            h.device.write(line, usec=int(time.monotonic() * 1e6))
        events, _ = await h.collect()
        [event] = events
        assert (event.kind, event.attributes["xid"]) == ("sxid", 24007)
        assert event.attributes["engine_instance"] == 58
        # a follow-up line arriving in the next round belongs to the record already raised
        h.device.write(SXID_RECORD[3], usec=int(time.monotonic() * 1e6))
        events, _ = await h.collect()
        assert events == []
        await h.collector.close()


FALLEN_OFF = (
    "NVRM: The NVIDIA GPU 0000:3b:00.0\n"
    "NVRM: (PCI ID: 10de:2335) installed in this system has\n"
    "NVRM: fallen off the bus and is not responding to commands."
)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_line_handed_over_with_its_newline_reads_as_without(shape: str) -> None:
    """`parse_line` takes a line's `\\r\\n` off; a further, indented line of a record kept its
    `\\n`, and the driver's three-line "fallen off the bus" record then split into four parts
    and was missed by a caller that hands `readlines()`' lines over as they are."""
    text = render(shape, Record(FALLEN_OFF, seq=1, usec=5_000_001))
    bare = text.split("\n")
    for ending in ("\n", "\r\n"):
        kept = [line + ending for line in bare]
        assert [r.message for r in parse_lines(kept)] == [r.message for r in parse_lines(bare)]
        assert scan_lines(kept, ParseStats()) == scan_lines(bare, ParseStats())
    assert any(f.kind == "gpu_fallen_off_bus" for f in scan_lines(bare, ParseStats())), shape
