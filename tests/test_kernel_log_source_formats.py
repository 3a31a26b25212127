"""Every format string that prints a line the kernel log's matchers promise to catch, read in
the driver's and the kernel's own source, filled with values (edge values among them) and saved
in every shape of tests/support/klog_shapes.py, then read back the way `gpuwarden scan` and a
followed file read it (bytes cut at `\\n`, `iter_lines`, `scan_lines`).

Where each format comes from (file, function, versions) is beside it here and in
tests/fixtures/kernel_log/corpus/SOURCES.md ("Format strings by source"). The values are made
up; the fixed words and the order of the fields are the sources'.
"""

from __future__ import annotations

import io
from typing import NamedTuple

import pytest

from agent.contracts.model import Severity
from agent.program.commands.scan import scan_lines
from collectors.kernel_log.finding import Finding
from collectors.kernel_log.lines import iter_lines
from collectors.kernel_log.matchers import MatcherSet
from collectors.kernel_log.parse import ParseStats
from tests.support.klog_shapes import KERNEL_ONLY, SHAPES, Record, render

S = Severity
GPU = "0000:3b:00.0"
WIDE = "10000:3b:00.0"  # a VMD domain: `%04x` of a domain above 0xffff prints five digits
SWITCH = "0000:c7:00.0"


class Format(NamedTuple):
    source: str
    records: tuple[str, ...]
    """The records one event writes, in order (a printk with newlines is one record)."""
    kind: str
    severity: Severity
    pci: str = ""
    code: int | None = None
    pid: int | None = None
    process: str = ""
    device: str = ""


def _f(
    source: str, records: str | tuple[str, ...], kind: str, severity: Severity, **facts: object
) -> Format:
    held = (records,) if isinstance(records, str) else records
    return Format(source, held, kind, severity, **facts)  # type: ignore[arg-type]


# open-gpu-kernel-modules src/nvidia/src/kernel/gpu/rc/kernel_rc.c `krcReportXid`:
#   570.86.15 on (XID_PRINT_WITH_ATTR, attr `PCI:%04x:%02x:%02x`[` GPU-I:%02u`[` GPU-CI:%02u`]]):
#     "NVRM: Xid (<attr>): %d, pid=%s, name=%s, %s%s"  with a process (a channel's, or the
#     current one's while an RM call is served), "NVRM: Xid (<attr>): %d, %s%s" without one;
#     the last %s is " caused by previous Xid %d" for Xid 45 (preemptive removal) from
#     570.124.04, else empty. pid is `%u` (up to 4294967295); name is the task's comm
#     (os-interface.c `os_get_current_process_name`: up to 15 bytes, any but NUL).
#   515.43.04-560.x: always "..., pid=%s, name=%s, %s" with pid "'<unknown>'" and name
#     "<unknown>" when no channel is known. The message (pMsg) may be empty ("" for NULL).
# The GSP-RM path (kernel_gsp.c `_kgspRpcOsErrorLog`) ends in the same krcReportXid.
XID = [
    _f(
        "kernel_rc.c 595",
        "NVRM: Xid (PCI:0000:3b:00): 13, pid=4242, name=python3, Graphics SM "
        "Warp Exception on (GPC 0, TPC 1, SM 0): Out Of Range Address",
        "xid",
        S.WARNING,
        pci=GPU,
        code=13,
        pid=4242,
        process="python3",
    ),
    _f(
        "kernel_rc.c 595 GPU-I",
        "NVRM: Xid (PCI:0000:3b:00 GPU-I:05): 31, pid=7, name=train, "
        "MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f_12340000",
        "xid",
        S.WARNING,
        pci=GPU,
        code=31,
        pid=7,
        process="train",
    ),
    _f(
        "kernel_rc.c 595 GPU-I GPU-CI",
        "NVRM: Xid (PCI:0000:3b:00 GPU-I:14 GPU-CI:07): 94, "
        "pid=7194, name=a, Contained: CE User Channel (0x9). RST: No, D-RST: No",
        "xid",
        S.WARNING,
        pci=GPU,
        code=94,
        pid=7194,
        process="a",
    ),
    _f(
        "kernel_rc.c 595, no process",
        "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",
        "xid",
        S.CRITICAL,
        pci=GPU,
        code=79,
    ),
    _f(
        "kernel_rc.c 570.124.04 root cause",
        "NVRM: Xid (PCI:0000:3b:00): 45, pid=11, name=job, Ch 00000001 caused by previous Xid 149",
        "xid",
        S.INFO,
        pci=GPU,
        code=45,
        pid=11,
        process="job",
    ),
    _f(
        "kernel_rc.c 570.124.04 root cause, no process",
        "NVRM: Xid (PCI:0000:3b:00): 45, Ch 00000001 caused by previous Xid 149",
        "xid",
        S.INFO,
        pci=GPU,
        code=45,
    ),
    _f(
        "kernel_rc.c 515 no channel",
        "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', "
        "name=<unknown>, GPU has fallen off the bus.",
        "xid",
        S.CRITICAL,
        pci=GPU,
        code=79,
    ),
    _f(
        "kernel_rc.c 515 no channel, MIG",
        "NVRM: Xid (PCI:0000:3b:00 GPU-I:14 GPU-CI:07): 43, "
        "pid='<unknown>', name=<unknown>, Ch 00000008",
        "xid",
        S.INFO,
        pci=GPU,
        code=43,
    ),
    _f(
        "kernel_rc.c, wide domain",
        "NVRM: Xid (PCI:10000:3b:00): 48, pid=5, name=x, An "
        "uncorrectable double bit error (DBE) has been detected",
        "xid",
        S.CRITICAL,
        pci=WIDE,
        code=48,
        pid=5,
        process="x",
    ),
    _f(
        "kernel_rc.c, largest address",
        "NVRM: Xid (PCI:ffff:ff:1f): 48, pid=5, name=x, DBE",
        "xid",
        S.CRITICAL,
        pci="ffff:ff:1f.0",
        code=48,
        pid=5,
        process="x",
    ),
    _f(
        "kernel_rc.c, largest pid, colons in the name",
        "NVRM: Xid (PCI:0000:3b:00): 13, pid=4294967295, name=nv: x: y, Graphics Exception",
        "xid",
        S.WARNING,
        pci=GPU,
        code=13,
        pid=4294967295,
        process="nv: x: y",
    ),
    _f(
        "kernel_rc.c, brackets and spaces in the name",
        "NVRM: Xid (PCI:0000:3b:00): 13, pid=123, name=[w:1] (x) y, Graphics Exception",
        "xid",
        S.WARNING,
        pci=GPU,
        code=13,
        pid=123,
        process="[w:1] (x) y",
    ),
    _f(
        "kernel_rc.c, empty name",
        "NVRM: Xid (PCI:0000:3b:00): 13, pid=123, name=, Graphics Exception",
        "xid",
        S.WARNING,
        pci=GPU,
        code=13,
        pid=123,
    ),
    _f(
        "kernel_rc.c, empty message",
        "NVRM: Xid (PCI:0000:3b:00): 13, pid=123, name=python3, ",
        "xid",
        S.WARNING,
        pci=GPU,
        code=13,
        pid=123,
        process="python3",
    ),
    _f(
        "kernel_rc.c, empty name and message",
        "NVRM: Xid (PCI:0000:3b:00): 13, pid=123, name=, ",
        "xid",
        S.WARNING,
        pci=GPU,
        code=13,
        pid=123,
    ),
    _f(
        "kernel_rc.c 515, no channel, empty message",
        "NVRM: Xid (PCI:0000:3b:00): 13, pid='<unknown>', name=<unknown>, ",
        "xid",
        S.WARNING,
        pci=GPU,
        code=13,
    ),
    # NVLink5 and Xid 154: the driver's words set the severity (SOURCES.md 04-severity).
    _f(
        "GSP NVLink5",
        "NVRM: Xid (PCI:0000:3b:00): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 00 "
        "(0x004505c6 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)",
        "xid",
        S.CRITICAL,
        pci=GPU,
        code=149,
    ),
    _f(
        "gpu.c Xid 154",
        "NVRM: Xid (PCI:0000:3b:00): 154, GPU recovery action changed from 0x0 "
        "(None) to 0x2 (Node Reboot Required)",
        "xid",
        S.CRITICAL,
        pci=GPU,
        code=154,
    ),
]

# src/common/nvswitch/kernel/inc/common_nvswitch.h `NVSWITCH_PRINT_SXID` (515 to 595, the
# same): "nvidia-%s: SXid (PCI:%04x:%02x:%02x.%x): %05d, " + the caller's format; the device
# name is "nvswitch%d" (nvswitch.c); kernel-open/nvidia/linux_nvswitch.c `nvswitch_os_print`
# adds only the printk level. The callers' formats: inc/intr_nvswitch.h
# `NVSWITCH_REPORT_CORRECTABLE`/`_NONFATAL`/`_FATAL` ("Correctable, "/"Non-fatal, "/"Fatal, "
# "Link %02d %s%s", the last %s " (First)"), `NVSWITCH_REPORT_PRI_ERROR_NONFATAL`
# ("Non-fatal, %s, instance=%d, chiplet=%d"), `NVSWITCH_UNHANDLED_CHECK` ("Fatal, unhandled
# interrupt in %s(%d)"); error_nvswitch.c `_nvswitch_dump_error_entry` (the follow-ups).
SXID = [
    _f(
        "intr_nvswitch.h FATAL",
        "nvidia-nvswitch3: SXid (PCI:0000:c7:00.0): 20034, Fatal, Link 44 LTSSM Fault Up",
        "sxid",
        S.CRITICAL,
        pci=SWITCH,
        code=20034,
        device="nvidia-nvswitch3",
    ),
    _f(
        "intr_nvswitch.h NONFATAL",
        "nvidia-nvswitch0: SXid (PCI:0000:c7:00.0): 12028, "
        "Non-fatal, Link 02 egress non-posted PRIV error (First)",
        "sxid",
        S.WARNING,
        pci=SWITCH,
        code=12028,
        device="nvidia-nvswitch0",
    ),
    _f(
        "intr_nvswitch.h CORRECTABLE, code with leading zeros, wide domain",
        "nvidia-nvswitch11: SXid (PCI:10000:c7:00.0): 01001, Correctable, Link 03 RX CRC",
        "sxid",
        S.INFO,
        pci="10000:c7:00.0",
        code=1001,
        device="nvidia-nvswitch11",
    ),
    _f(
        "intr_nvswitch.h UNHANDLED_CHECK",
        "nvidia-nvswitch1: SXid (PCI:0000:c7:00.0): 10001, "
        "Fatal, unhandled interrupt in _nvswitch_service_nport(123)",
        "sxid",
        S.CRITICAL,
        pci=SWITCH,
        code=10001,
        device="nvidia-nvswitch1",
    ),
    _f(
        "intr_nvswitch.h PRI_ERROR_NONFATAL",
        "nvidia-nvswitch1: SXid (PCI:0000:c7:00.0): 22013, "
        "Non-fatal, PRI error, instance=3, chiplet=0",
        "sxid",
        S.INFO,
        pci=SWITCH,
        code=22013,
        device="nvidia-nvswitch1",
    ),
    _f(
        "error_nvswitch.c with follow-ups",
        (
            "nvidia-nvswitch2: SXid (PCI:0000:c7:00.0): 11011, Non-fatal, Link 00 ingress request "
            "context mismatch (First)",
            "nvidia-nvswitch2: SXid (PCI:0000:c7:00.0): 11011, Severity 1 Engine instance 00 "
            "Sub-engine instance 00",
            "nvidia-nvswitch2: SXid (PCI:0000:c7:00.0): 11011, Data {0x00000000, 0x00000001, "
            "0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000}",
        ),
        "sxid",
        S.WARNING,
        pci=SWITCH,
        code=11011,
        device="nvidia-nvswitch2",
    ),
]

# src/nvidia/arch/nvalloc/unix/src/osapi.c (515 to 595): one nv_printf of three lines;
# osinit.c `RmCheckForGpuLost...`: the Xid 79, then NV_DEV_PRINTF (os-interface.h: "NVRM: GPU
# %04x:%02x:%02x.%x: " + format) "GPU has fallen off the bus." and "GPU serial number is %s.";
# osinit.c `RmInitAdapter` "RmInitAdapter failed! (0x%x:0x%x:%d)", "GPU does not have the
# necessary power cables connected."; kernel-open/nvidia/nv.c "rm_init_adapter failed, device
# minor number %d" (both through NV_DEV_PRINTF).
LOST = [
    _f(
        "osapi.c three lines",
        "NVRM: The NVIDIA GPU 0000:18:00.0\nNVRM: (PCI ID: 10de:2335) "
        "installed in this system has\nNVRM: fallen off the bus and is not responding to "
        "commands.",
        "gpu_fallen_off_bus",
        S.CRITICAL,
        pci="0000:18:00.0",
    ),
    _f(
        "osapi.c three lines, then its Xid 79, wide domain",
        (
            "NVRM: The NVIDIA GPU 10000:18:00.0\nNVRM: (PCI ID: 10de:2335) installed in this "
            "system has\nNVRM: fallen off the bus and is not responding to commands.",
            "NVRM: Xid (PCI:10000:18:00): 79, GPU has fallen off the bus.",
        ),
        "xid",
        S.CRITICAL,
        pci="10000:18:00.0",
        code=79,
    ),
    _f(
        "osinit.c Xid 79 then the one line and the serial",
        (
            "NVRM: Xid (PCI:0000:3b:00): 79, pid=2314, name=python3, GPU has fallen off the bus.",
            "NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.",
            "NVRM: GPU 0000:3b:00.0: GPU serial number is 1650123456789.",
        ),
        "xid",
        S.CRITICAL,
        pci=GPU,
        code=79,
        pid=2314,
        process="python3",
    ),
    _f(
        "osinit.c one line alone",
        "NVRM: GPU 10000:18:00.0: GPU has fallen off the bus.",
        "gpu_fallen_off_bus",
        S.CRITICAL,
        pci="10000:18:00.0",
    ),
    _f(
        "osinit.c RmInitAdapter, nv.c rm_init_adapter",
        (
            "NVRM: GPU 0000:18:00.0: RmInitAdapter failed! (0x24:0x1c:1603)",
            "NVRM: GPU 0000:18:00.0: rm_init_adapter failed, device minor number 0",
        ),
        "gpu_init_failed",
        S.CRITICAL,
        pci="0000:18:00.0",
    ),
    _f(
        "osinit.c power cables",
        "NVRM: GPU 10000:18:00.0: GPU does not have the necessary power cables connected.",
        "gpu_init_failed",
        S.CRITICAL,
        pci="10000:18:00.0",
    ),
]

# The kernel (torvalds/linux; versions as in SOURCES.md).
HOST = [
    # kernel/hung_task.c `check_hung_task` (2.6.30 on; `hung_task_info` in 6.x): "INFO: task
    # %s:%d blocked for more than %ld seconds." The comm may hold colons and spaces.
    _f(
        "hung_task.c",
        "INFO: task python3:4242 blocked for more than 122 seconds.",
        "hung_task",
        S.WARNING,
        pid=4242,
        process="python3",
    ),
    _f(
        "hung_task.c, colons in comm",
        "INFO: task kworker/u16:3:1234 blocked for more than 120 seconds.",
        "hung_task",
        S.WARNING,
        pid=1234,
        process="kworker/u16:3",
    ),
    _f(
        "hung_task.c, spaces and brackets in comm",
        "INFO: task my job: [x]:77 blocked for more than 241 seconds.",
        "hung_task",
        S.WARNING,
        pid=77,
        process="my job: [x]",
    ),
    # kernel/watchdog.c `watchdog_timer_fn`: "BUG: soft lockup - CPU#%d stuck for %us! [%s:%d]"
    # (pr_fmt "watchdog: " from 4.x).
    _f(
        "watchdog.c soft lockup",
        "watchdog: BUG: soft lockup - CPU#12 stuck for 23s! [python3:4242]",
        "cpu_lockup",
        S.WARNING,
        pid=4242,
        process="python3",
    ),
    _f(
        "watchdog.c soft lockup, before pr_fmt",
        "BUG: soft lockup - CPU#3 stuck for 61s! [kworker/3:1:99]",
        "cpu_lockup",
        S.WARNING,
        pid=99,
        process="kworker/3:1",
    ),
    # kernel/watchdog_hld.c "Watchdog detected hard LOCKUP on cpu %d" (pr_fmt "NMI watchdog: "
    # in 4.x, "watchdog: " later); kernel/watchdog.c 6.x "CPU%u: Watchdog detected hard LOCKUP
    # on cpu %u" (seen in public reports).
    _f(
        "watchdog_hld.c 4.x",
        "NMI watchdog: Watchdog detected hard LOCKUP on cpu 5",
        "cpu_lockup",
        S.CRITICAL,
    ),
    _f(
        "watchdog.c 6.x",
        "watchdog: CPU5: Watchdog detected hard LOCKUP on cpu 5",
        "cpu_lockup",
        S.CRITICAL,
    ),
    # mm/oom_kill.c `__oom_kill_process` (5.x on; 4.x's "Killed process" alone; 2.6.32's) and
    # `oom_reap_task_mm` "oom_reaper: reaped process %d (%s), now anon-rss:%lukB, ..." (4.6 on):
    # the reaper's line is the same kill, not a second one.
    _f(
        "oom_kill.c 5.x",
        "Out of memory: Killed process 4242 (python3) total-vm:1234kB, "
        "anon-rss:100kB, file-rss:0kB, shmem-rss:0kB, UID:1000 pgtables:40kB oom_score_adj:0",
        "oom_kill",
        S.WARNING,
        pid=4242,
        process="python3",
    ),
    _f(
        "oom_kill.c 5.x memcg, parentheses in comm",
        "Memory cgroup out of memory: Killed process "
        "4242 (my job (x)) total-vm:1234kB, anon-rss:100kB, file-rss:0kB, shmem-rss:0kB, UID:0 "
        "pgtables:4kB oom_score_adj:-1000",
        "oom_kill",
        S.WARNING,
        pid=4242,
        process="my job (x)",
    ),
    _f(
        "oom_kill.c 4.x, then the reaper",
        (
            "Out of memory: Kill process 4242 (python3) score 900 or sacrifice child",
            "Killed process 4242 (python3) total-vm:1234kB, anon-rss:100kB, file-rss:0kB, "
            "shmem-rss:0kB",
            "oom_reaper: reaped process 4242 (python3), now anon-rss:0kB, file-rss:0kB, "
            "shmem-rss:0kB",
        ),
        "oom_kill",
        S.WARNING,
        pid=4242,
        process="python3",
    ),
    _f(
        "oom_kill.c 2.6.32",
        "Killed process 4242, UID 0, (python3) total-vm:1234kB, anon-rss:100kB, file-rss:0kB",
        "oom_kill",
        S.WARNING,
        pid=4242,
        process="python3",
    ),
    # arch/x86/kernel/cpu/mce/core.c `__print_mce`: HW_ERR "CPU %d: Machine Check%s: %Lx Bank
    # %d: %016Lx" (%s " Exception" when MCIP is set).
    _f(
        "mce/core.c __print_mce",
        "mce: [Hardware Error]: CPU 3: Machine Check Exception: 5 Bank 4: b200000000070005",
        "machine_check",
        S.CRITICAL,
    ),
    _f(
        "mce/core.c __print_mce, no MCIP",
        "mce: [Hardware Error]: CPU 3: Machine Check: 0 Bank 5: be00000000800400",
        "machine_check",
        S.CRITICAL,
    ),
    # block/blk-core.c by version (SOURCES.md 07-host-faults), fs/buffer.c.
    _f(
        "blk-core.c 4.12",
        "blk_update_request: I/O error, dev sda, sector 123",
        "io_error",
        S.CRITICAL,
        device="sda",
    ),
    _f(
        "blk-core.c 5.x",
        "I/O error, dev nvme0n1, sector 123 op 0x1:(WRITE) flags 0x800 phys_seg 1 prio class 2",
        "io_error",
        S.CRITICAL,
        device="nvme0n1",
    ),
    _f(
        "buffer.c",
        "Buffer I/O error on dev sda1, logical block 1234, lost async page write",
        "io_error",
        S.CRITICAL,
        device="sda1",
    ),
    # fs/ext4/super.c `__ext4_error` ("EXT4-fs error (device %s): %s:%d: comm %s: ..."),
    # `__ext4_std_error` ("... in %s:%d: %s"); fs/xfs (xfs_alert); fs/btrfs messages.c (6.2
    # on; newer kernels add " state %s" after the device when a state flag is set, as public
    # reports show).
    _f(
        "ext4 __ext4_error",
        "EXT4-fs error (device sda1): ext4_find_entry:1455: inode #2: comm "
        "ls: reading directory lblock 0",
        "fs_error",
        S.CRITICAL,
        device="sda1",
    ),
    _f(
        "ext4 __ext4_std_error",
        "EXT4-fs error (device nvme0n1p2) in ext4_reserve_inode_write:5701: Journal has aborted",
        "fs_error",
        S.CRITICAL,
        device="nvme0n1p2",
    ),
    _f(
        "xfs metadata I/O error",
        'XFS (dm-0): metadata I/O error in "xfs_trans_read_buf_map" at daddr 0x1 len 1 error 5',
        "fs_error",
        S.CRITICAL,
        device="dm-0",
    ),
    _f(
        "btrfs with state",
        "BTRFS: error (device sda1 state A) in btrfs_commit_transaction:2345: errno=-5 IO failure",
        "fs_error",
        S.CRITICAL,
        device="sda1",
    ),
    _f(
        "btrfs forced readonly with state",
        "BTRFS info (device sda1 state EA): forced readonly",
        "fs_error",
        S.CRITICAL,
        device="sda1",
    ),
    # drivers/nvme/host/pci.c `nvme_timeout` by version (SOURCES.md 07-host-faults).
    _f(
        "nvme pci.c 5.x",
        "nvme nvme0: I/O 123 QID 4 timeout, aborting",
        "nvme_error",
        S.WARNING,
        device="nvme0",
    ),
    _f(
        "nvme pci.c 6.x",
        "nvme nvme0: I/O tag 12 (100c) QID 4 timeout, reset controller",
        "nvme_error",
        S.WARNING,
        device="nvme0",
    ),
]

FORMATS = [*XID, *SXID, *LOST, *HOST]


def read_back(text: str, matchers: MatcherSet | None = None) -> list[Finding]:
    """`text` as a saved file's bytes, read the way `gpuwarden scan` reads one."""
    stream = io.BytesIO((text + "\n").encode())
    return scan_lines(iter_lines(stream), ParseStats(), matchers)


def saved(shape: str, records: tuple[str, ...], **writer: int | None) -> str:
    return "\n".join(
        render(shape, Record(message, seq=i, usec=5_000_000 + i, **writer))  # type: ignore[arg-type]
        for i, message in enumerate(records, 1)
    )


def facts(finding: Finding) -> tuple[object, ...]:
    return (
        finding.kind,
        finding.severity,
        finding.pci_bus_id,
        finding.code,
        finding.pid,
        finding.process,
        finding.device,
    )


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("form", FORMATS, ids=[f"{f.kind}: {f.source}" for f in FORMATS])
def test_every_source_format_in_every_saved_shape(form: Format, shape: str) -> None:
    """One event, one finding, with the facts its line gives, in each shape a tool saves."""
    found = read_back(saved(shape, form.records))
    expected = (form.kind, form.severity, form.pci, form.code, form.pid, form.process, form.device)
    assert [facts(f) for f in found] == [expected], (shape, form.records)


# Shapes in which a process's own write into the kernel log shows who wrote it: a raw
# record's facility (/dev/kmsg, dmesg -r, -x, --decode), the journal's and syslog's
# `ident[pid]:` for the rest.
FACILITY_SHAPES = frozenset({"kmsg", "dmesg-r", "dmesg-x", "dmesg-decode-iso"})
TELLING = sorted(set(SHAPES) - KERNEL_ONLY)


@pytest.mark.parametrize("shape", TELLING)
@pytest.mark.parametrize("form", FORMATS, ids=[f"{f.kind}: {f.source}" for f in FORMATS])
def test_a_process_writing_the_same_words_is_counted_not_found(form: Format, shape: str) -> None:
    """`echo 'NVRM: Xid ...' > /dev/kmsg` or `logger` gives the kernel's words from user
    space: no finding, one ignored record of the kind it would have been."""
    writer = {"facility": 1} if shape in FACILITY_SHAPES else {"pid": 42}
    matchers = MatcherSet()
    found = read_back(saved(shape, form.records, **writer), matchers)
    assert found == [], shape
    assert matchers.ignored[form.kind] == 1, (shape, dict(matchers.ignored))
