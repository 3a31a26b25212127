"""Host findings in the kernel log: disks, RAID, file systems, NVMe, network file servers, OOM
kills, hung tasks, RCU stalls, CPUs throttled for heat, host memory errors (EDAC), an NVIDIA
driver whose kernel module and libraries differ in version, PCIe ports that contained an error
or lost a slot's link, NIC links, cables and transmit timeouts, processes killed for corrupt
host memory, failed kernel allocations, workqueue lockups, connection tracking and TCP out of
room, processes that crash, clocks marked unstable, and what a log saved after a crash shows
(panic, oops, CPU lockups, machine checks, firmware (CPER) hardware errors). Each has a kind, a short name, a severity, a
meaning and an action; a line that ends a fault (`nfs: server ... OK`) clears it.

Formats are the kernel's printk strings, by file: block/blk-core.c, fs/buffer.c, fs/ext4
(super.c, page-io.c), fs/ext3 (before 4.3), fs/jbd2/journal.c, fs/xfs, fs/btrfs, drivers/md
(md.c, raid1.c, raid5.c, raid10.c), drivers/nvme/host (pci.c, core.c, multipath.c),
mm/oom_kill.c (and RHEL 7's wording), kernel/hung_task.c, kernel/panic.c,
arch/x86/kernel/dumpstack.c and arch/x86/mm/fault.c, kernel/watchdog.c,
arch/x86/kernel/cpu/mce/core.c, drivers/edac/edac_mc.c, drivers/acpi/apei/ghes.c with
drivers/firmware/efi/cper.c, net/sunrpc/clnt.c, fs/smb/client/connect.c, kernel/rcu/tree_stall.h
and tree_exp.h, drivers/thermal/intel/therm_throt.c, drivers/pci/pcie/dpc.c,
drivers/pci/pcie/err.c, drivers/pci/hotplug/pciehp_ctrl.c, NIC drivers through netdev_info,
drivers/net/bonding, net/sched/sch_generic.c, mlx5's events.c, mm/memory-failure.c,
mm/page_alloc.c and mm/vmalloc.c, kernel/workqueue.c, nf_conntrack_core.c, net/ipv4/tcp.c,
arch/x86/mm/fault.c and arch/x86/kernel/traps.c, kernel/time/clocksource.c and
arch/x86/kernel/tsc.c, and NVIDIA's osapi.c and nvidia-modeset (the
wordings of each version: tests/fixtures/kernel_log/corpus/SOURCES.md).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from agent.contracts.model import AttributeValue, RepairAction, Severity
from collectors.kernel_log.finding import (
    ANY_BDF,
    Assembling,
    Finding,
    Matcher,
    OpenRecords,
    Ready,
    TriggerIndex,
    number,
)
from collectors.kernel_log.parse import LogRecord

HOST_KINDS: Final = (
    "io_error",
    "fs_error",
    "nvme_error",
    "raid_member_failed",
    "oom_kill",
    "hung_task",
    "kernel_panic",
    "kernel_oops",
    "cpu_lockup",
    "machine_check",
    "memory_error",
    "hardware_error",
    "network_storage",
    "cpu_throttled",
    "driver_mismatch",
    "pcie_link_down",
    "network_link",
    "memory_pressure",
    "network_drops",
    "process_crash",
    "clock_unstable",
)

R = RepairAction
HOST_REPAIR: Final[dict[str, RepairAction]] = {
    "io_error": R.CHECK_STORAGE,
    "fs_error": R.CHECK_STORAGE,
    "nvme_error": R.CHECK_STORAGE,
    "raid_member_failed": R.CHECK_STORAGE,
    "oom_kill": R.RESTART_APPLICATION,  # the job's memory, not the node
    "hung_task": R.INVESTIGATE,
    # The kernel itself may be unstable from here on: the node needs a restart.
    "kernel_panic": R.REBOOT_NODE,
    "kernel_oops": R.REBOOT_NODE,
    "cpu_lockup": R.INVESTIGATE,
    # A file server that stops answering hangs every job that reads or writes there.
    "network_storage": R.CHECK_STORAGE,
    "cpu_throttled": R.CHECK_COOLING,
    # The kernel module loaded is not the one the installed libraries need: a restart loads it.
    "driver_mismatch": R.REBOOT_NODE,
    "pcie_link_down": R.INVESTIGATE,
    # A NIC of the training network going down stalls every collective on the node.
    "network_link": R.INVESTIGATE,
    "memory_pressure": R.INVESTIGATE,
    "network_drops": R.INVESTIGATE,
    # A process's own crash: the job's to restart, the node's to look at only if it repeats.
    "process_crash": R.INVESTIGATE,
    "clock_unstable": R.INVESTIGATE,
}
"""The repair of each host kind; machine_check, memory_error and hardware_error depend on the
record (`_hardware_repair`). A test holds that every kind has one."""


def _hardware_repair(severity: Severity) -> RepairAction:
    """An uncorrected machine check or a fatal firmware error: the part must be looked at;
    a corrected one is to watch."""
    return R.HARDWARE_INSPECTION if severity >= Severity.CRITICAL else R.INVESTIGATE


_DEV: Final = r"[\w.:/-]+"


def _edac(kind: str) -> re.Pattern[str]:
    """An EDAC report of `kind` errors (`CE` corrected, `UE` uncorrected), with the DIMM's
    label after ` on ` where the driver knows it."""
    return re.compile(
        rf"EDAC (?:\w+ )?MC(?P<mc>\d+): (?:(?P<count>\d+) )?{kind}\b.*?"
        r"(?P<where> on (?P<device>[^\s(]+))?(?: \(|$)"
    )


@dataclass(frozen=True)
class _Rule:
    kind: str
    name: str
    pattern: re.Pattern[str]
    severity: Severity
    meaning: str
    action: str
    triggers: tuple[str, ...]
    """Substrings one of which every line this rule matches contains."""
    numbers: Mapping[str, str] = field(default_factory=dict)
    """Named groups kept as whole-number attributes: group -> attribute name."""
    texts: Mapping[str, str] = field(default_factory=dict)
    """Named groups kept as text attributes: group -> attribute name."""
    fixed: Mapping[str, AttributeValue] = field(default_factory=dict)
    repair: RepairAction | None = None
    """The repair where the kind's (`HOST_REPAIR`) depends on the record."""
    clears: tuple[str, ...] = ()
    """An all-clear (`nfs: server ... OK`): the kinds it clears for its subject."""
    derived: Callable[[Mapping[str, str]], Mapping[str, AttributeValue]] | None = None
    """Attributes worked out from the match's groups (a register decoded, a word lowered)."""


def _all_clear(
    kind: str,
    name: str,
    pattern: re.Pattern[str],
    meaning: str,
    action: str,
    *,
    triggers: tuple[str, ...],
    numbers: Mapping[str, str] | None = None,
    texts: Mapping[str, str] | None = None,
    derived: Callable[[Mapping[str, str]], Mapping[str, AttributeValue]] | None = None,
) -> _Rule:
    """A line that says the kind's fault is over on its subject (`nfs: server ... OK`): info,
    no repair, and it clears that kind (the repair ledger and the holdoff both follow it)."""
    return _Rule(
        kind,
        name,
        pattern,
        Severity.INFO,
        meaning,
        action,
        triggers,
        numbers=numbers or {},
        texts=texts or {},
        repair=R.NONE,
        clears=(kind,),
        derived=derived,
    )


_DISK_ACTION = (
    "check {device}'s health (smartctl -a, nvme smart-log) and the kernel log around this line; "
    "plan to replace the disk if errors repeat"
)
_READ_ONLY_ACTION = (
    "writes to {device} now fail (jobs writing checkpoints or logs there die): find the I/O or "
    "file-system error before this line, check the disk, then unmount and repair the file "
    "system ({repair}) before remounting it read-write"
)


def _dpc_source(values: Mapping[str, str]) -> dict[str, AttributeValue]:
    """The device whose error the port contained. Before 6.16 the line gives its requester id
    (`source:0x4100`: bus, device and function in 16 bits; 0 when not known) in the port's
    domain; from 6.16 its address, and only when it is known."""
    out: dict[str, AttributeValue] = {}
    if values.get("status"):
        out["dpc_status"] = values["status"].lower()
    if values.get("from"):
        out["source_pci_bus_id"] = values["from"].lower()
        return out
    requester = int(values["source"], 16) if values.get("source") else 0
    if requester:
        domain = values["device"].split(":", 1)[0]
        bus, slot, function = requester >> 8, (requester >> 3) & 0x1F, requester & 0x7
        out["source_pci_bus_id"] = f"{domain}:{bus:02x}:{slot:02x}.{function}".lower()
    return out


def _throttle_level(values: Mapping[str, str]) -> dict[str, AttributeValue]:
    return {"level": values["level"].lower()}


def _storage_program(values: Mapping[str, str]) -> dict[str, AttributeValue]:
    """The RPC program that timed out (`nfs`, `lockd`, ...), or `cifs`."""
    return {"program": values.get("program") or "cifs"}


_NOT_ANSWERING = (
    "processes reading or writing files there hang (in D state) until it answers; a job "
    "stuck in I/O with a healthy GPU is often this"
)
_SERVER_ACTION = (
    "check the file server {device} and the network path to it (ping, the storage network's "
    "links, the server's own logs); jobs recover on their own when it answers again"
)


# netdev_info's prefix (net/core/dev.c __netdev_printk): `<driver> <bus address> <interface>: `;
# a device without a parent prints the interface alone. An interface name starts with a letter
# and after a space or the line's start: a PCI function's own `<driver> <address>: ` names none.
_NETDEV: Final = (
    r"(?:^|(?<=\s))(?:(?P<driver>[\w.-]{1,32}) (?P<address>[\w.:-]{1,64}) )?"
    r"(?P<device>[A-Za-z][\w.@-]{0,31}): "
)


def _netdev(values: Mapping[str, str]) -> dict[str, AttributeValue]:
    out: dict[str, AttributeValue] = {}
    if values.get("driver") or values.get("old_driver"):
        out["driver"] = values.get("driver") or values["old_driver"]
    if values.get("address"):
        out["pci_address"] = values["address"]
    return out


_LINK_ACTION = (
    "check the link of {device} (ip -s link, ethtool {device}, the switch port); if nobody took "
    "it down, look at the cable or transceiver and the NIC's firmware; jobs whose collectives "
    "run over it (NCCL) stall or fail while it is down"
)


def _page_recovery(results: str) -> re.Pattern[str]:
    """mm/memory-failure.c action_result's line ending in one of `results` (a pattern)."""
    return re.compile(
        r"(?:Memory failure: |MCE )(?P<pfn>0x[0-9a-fA-F]{1,16}): (?:recovery action for "
        rf"(?P<page>[^:\n]{{1,64}}): |(?P<old_page>[^:\n]{{1,64}}) page recovery: ){results}"
    )


_CRASH = (
    "the program died; in a CUDA, NCCL or NVIDIA library (libcuda, libnccl, libnvidia-*) the "
    "driver or the library may be at fault, elsewhere the program or its memory"
)
_CRASH_ACTION = (
    "read the job's own log and core dump (coredumpctl info {pid}); a crash in a CUDA library "
    "after a driver update, or on one node only, points at that node's driver"
)
_CLOCK = (
    "every clock read (time.time(), CUDA event timings, NCCL's timeouts) costs more, and steps "
    "that read the time often slow down; on a virtual machine the host may be overloaded"
)
_CLOCK_ACTION = (
    "check the clock in use (cat /sys/devices/system/clocksource/clocksource0/"
    "current_clocksource); on a virtual machine ask the provider; on bare metal check the "
    "firmware's TSC and power settings; a restart brings the fast clock back if the cause is "
    "gone"
)


# {device}, {process}, {pid}, {seconds} ... in meaning/action are filled from the match.
_RULES: Final[Sequence[_Rule]] = (
    # block/blk-core.c: `I/O error, dev sda, sector 2048 op 0x1:(WRITE) ...` (prefixed by
    # `blk_update_request: ` before 5.16) and fs/buffer.c: `Buffer I/O error on dev sda1, ...`
    _Rule(
        "io_error",
        "disk I/O error",
        re.compile(rf"(?:Buffer )?I/O error,? (?:on )?dev(?:ice)? (?P<device>{_DEV}),"),
        Severity.CRITICAL,
        "the block device {device} returned an I/O error",
        _DISK_ACTION,
        ("I/O error",),
    ),
    # The same block-layer line when the request failed with another status (blk_errors[] in
    # block/blk-core.c: BLK_STS_MEDIUM is `critical medium`, a disk's unreadable sectors):
    # `critical medium error, dev sdb, sector 8 op 0x0:(READ) ...`; `print_req_error: ` or
    # `blk_update_request: ` (`end_request: ` before 3.x) in front on older kernels. The
    # statuses that say nothing of the device (not supported, a retry, the kernel's own
    # resources) are left out.
    _Rule(
        "io_error",
        "disk request failed",
        re.compile(
            r"(?P<status>critical (?:medium|target|nexus|space allocation)|recoverable "
            r"transport|timeout|protection|device offline) error, dev "
            rf"(?P<device>{_DEV}),"
        ),
        Severity.CRITICAL,
        "the block device {device} failed a request with a {status} error (medium: sectors "
        "that cannot be read or written; target, nexus, transport: the device or its path "
        "failed the command; space allocation: thin storage is full; timeout: no answer; "
        "offline: the device is gone)",
        _DISK_ACTION,
        ("error, dev ",),
        texts={"status": "block_error"},
    ),
    # fs/ext4/page-io.c ext4_end_bio: `EXT4-fs warning (device sda1): ext4_end_bio:343: I/O
    # error 10 writing to inode 1234 starting block 5678)`
    _Rule(
        "io_error",
        "ext4 write I/O error",
        re.compile(rf"EXT4-fs warning \(device (?P<device>{_DEV})\): .*I/O error"),
        Severity.CRITICAL,
        "writing a file on {device} failed with an I/O error (data written by the application "
        "may be lost)",
        _DISK_ACTION,
        ("I/O error",),
    ),
    # fs/ext4/super.c ext4_handle_error (`EXT4-fs (sda1): Remounting filesystem read-only`)
    # and fs/ext3/super.c (`EXT3-fs (sda1): error: remounting filesystem read-only`)
    _Rule(
        "fs_error",
        "file system remounted read-only",
        re.compile(
            rf"EXT(?P<version>[234])-fs \((?P<device>{_DEV})\): (?:error: )?"
            r"[Rr]emounting filesystem read-only"
        ),
        Severity.CRITICAL,
        "the ext{version} file system on {device} hit an error and the kernel remounted it "
        "read-only",
        _READ_ONLY_ACTION.replace("{repair}", "e2fsck"),
        ("-fs (",),
        texts={"version": "ext_version"},
        fixed={"read_only": True},
    ),
    # fs/btrfs: `BTRFS info (device sdc1 state EA): forced readonly` (state letters since 6.x)
    _Rule(
        "fs_error",
        "file system remounted read-only",
        re.compile(r"BTRFS \w+ \(device (?P<device>[^\s)]+)[^)]*\): forced readonly"),
        Severity.CRITICAL,
        "the btrfs file system on {device} hit an error and the kernel forced it read-only",
        _READ_ONLY_ACTION.replace("{repair}", "btrfs check"),
        ("BTRFS",),
        fixed={"read_only": True},
    ),
    # fs/xfs/xfs_fsops.c xfs_do_force_shutdown: `XFS (dm-3): Filesystem has been shut down due
    # to log error (0x2).`, and `... Shutting down filesystem.` after a corruption report
    _Rule(
        "fs_error",
        "XFS file system shut down",
        re.compile(
            rf"XFS \((?P<device>{_DEV})\): .*(?:Filesystem has been shut down|"
            r"[Ss]hutting down filesystem)"
        ),
        Severity.CRITICAL,
        "the XFS file system on {device} shut itself down after an error: every read and write "
        "on it now fails",
        _READ_ONLY_ACTION.replace("{repair}", "xfs_repair"),
        ("XFS (",),
        fixed={"read_only": True},
    ),
    # fs/ext4/super.c: `EXT4-fs error (device sda1): ext4_find_entry:1455: inode #2: ...`
    _Rule(
        "fs_error",
        "ext4 error",
        re.compile(rf"EXT4-fs (?:error|critical error) \(device (?P<device>{_DEV})\)"),
        Severity.CRITICAL,
        "the ext4 file system on {device} found an error (corruption or failed I/O)",
        "unmount {device} and run e2fsck at the next chance; check the disk",
        ("EXT4-fs ",),
    ),
    _Rule(
        "fs_error",
        "superblock write failed",
        re.compile(rf"EXT4-fs \((?P<device>{_DEV})\): I/O error while writing superblock"),
        Severity.CRITICAL,
        "writing the ext4 superblock of {device} failed (the file system may not mount again)",
        "check the disk behind {device}; unmount it and run e2fsck",
        ("I/O error",),
    ),
    _Rule(
        "fs_error",
        "ext4 error",
        re.compile(rf"EXT4-fs \((?P<device>{_DEV})\): previous I/O error"),
        Severity.CRITICAL,
        "the ext4 file system on {device} hit I/O errors",
        "check the disk behind {device}; unmount it and run e2fsck",
        ("I/O error",),
    ),
    # fs/jbd2/journal.c: `JBD2: Error -5 detected when updating journal superblock for sda1-8.`
    # and `Aborting journal on device sda1-8.` (the file system goes read-only next)
    _Rule(
        "fs_error",
        "journal superblock write failed",
        re.compile(
            rf"JBD2: Error (?P<errno>-?\d+) detected when updating journal superblock for "
            rf"(?P<device>{_DEV}?)\.?$"
        ),
        Severity.CRITICAL,
        "writing the journal superblock of {device} failed (error {errno}); the file system "
        "will abort its journal and go read-only",
        "check the disk behind {device}; unmount the file system and run e2fsck",
        ("JBD2",),
        numbers={"errno": "errno"},
    ),
    _Rule(
        "fs_error",
        "journal aborted",
        re.compile(rf"Aborting journal on device (?P<device>{_DEV}?)\.?$"),
        Severity.CRITICAL,
        "the journal of the file system on {device} was aborted after an error; the file "
        "system goes read-only",
        "check the disk behind {device}; unmount the file system and run e2fsck",
        ("Aborting journal",),
    ),
    # fs/xfs: `XFS (sdb1): Metadata corruption detected at ...`, `XFS (dm-0): log I/O error -5`,
    # `XFS (md0): metadata I/O error in "..." at daddr ...`
    _Rule(
        "fs_error",
        "XFS error",
        re.compile(rf"XFS \((?P<device>{_DEV})\): .*(?:[Cc]orruption|I/O error)"),
        Severity.CRITICAL,
        "the XFS file system on {device} found corruption or an I/O error",
        "check the disk behind {device}; unmount it and run xfs_repair",
        ("XFS (",),
    ),
    # fs/btrfs/disk-io.c write_dev_supers: `BTRFS error (device sdb): error writing primary
    # super block to device 1`
    _Rule(
        "fs_error",
        "superblock write failed",
        re.compile(
            r"BTRFS \w+ \(device (?P<device>[^\s)]+)[^)]*\): error writing primary super block"
        ),
        Severity.CRITICAL,
        "writing the btrfs superblock of {device} failed",
        "check the disk behind {device} (smartctl -a); replace it if errors repeat",
        ("BTRFS",),
    ),
    # fs/btrfs: `BTRFS error (device sda1): bdev /dev/sda1 errs: wr 1, ...`, `BTRFS critical
    # (device sda1): corrupt leaf ...`, older `BTRFS: error (device sda1) in ...: errno=-5 IO
    # failure`
    _Rule(
        "fs_error",
        "btrfs error",
        re.compile(r"BTRFS(?::)? (?:error|critical) \(device (?P<device>[^\s)]+)"),
        Severity.CRITICAL,
        "the btrfs file system on {device} reported an error (failed I/O or corruption)",
        "check the disk behind {device}; run btrfs device stats and btrfs scrub",
        ("BTRFS",),
    ),
    # drivers/md/raid1.c, raid10.c: `md/raid1:md0: Disk failure on sdb1, disabling device.` with
    # `md/raid1:md0: Operation continuing on 1 devices.` in the same printk; raid5.c: `md/raid:`
    _Rule(
        "raid_member_failed",
        "RAID member failed",
        re.compile(
            rf"md/(?P<level>raid\d*):(?P<array>{_DEV}): Disk failure on (?P<device>{_DEV}), "
            r"disabling device(?:.*Operation continuing on (?P<remaining>\d+) devices)?",
            re.DOTALL,
        ),
        Severity.CRITICAL,
        "the md array {array} failed its member {device} and runs degraded",
        "replace {device} and add the new disk to {array} (mdadm --manage {array} --add); "
        "until then one more failure can lose the array",
        ("Disk failure on",),
        numbers={"remaining": "remaining_devices"},
        texts={"array": "array", "level": "raid_level"},
    ),
    # drivers/md/md.c super_written: `md: super_written gets error=-5`
    _Rule(
        "raid_member_failed",
        "RAID superblock write failed",
        re.compile(r"md: super_written gets error=(?P<errno>-?\d+)"),
        Severity.CRITICAL,
        "md could not write an array's superblock to a member disk (error {errno}); md fails "
        "that member",
        "find the member named in the lines after this one (cat /proc/mdstat) and replace it",
        ("super_written",),
        numbers={"errno": "errno"},
    ),
    # drivers/nvme/host/pci.c: `nvme nvme0: I/O 123 QID 4 timeout, aborting` / `..., reset
    # controller`, `controller is down; will reset: CSTS=0xffffffff`, `Removing after probe
    # failure status: -19`, `Device not ready; aborting reset`. From 6.x the timeouts name the
    # command id and opcode: `I/O tag 283 (b11b) opcode 0x2 (Read) QID 7 timeout, aborting
    # req_op:READ(0) size:131072`; over fabrics tcp.c `queue 2: timeout request 0x28 type 4`
    # (5.x), then `I/O tag 40 (2028) type 4 opcode 0x2 (Read) QID 2 timeout` (rdma.c without
    # the type).
    _Rule(
        "nvme_error",
        "NVMe controller down",
        re.compile(
            r"nvme (?P<device>nvme\d+): (?:controller is down|Removing after "
            r"probe failure|Device not ready|Disabling device after reset failure)"
        ),
        Severity.CRITICAL,
        "the NVMe controller {device} went down or was removed",
        "check {device} (nvme smart-log, firmware) and its slot; replace it if it repeats",
        ("nvme nvme",),
    ),
    _Rule(
        "nvme_error",
        "NVMe timeout or reset",
        re.compile(
            r"nvme (?P<device>nvme\d+): (?:I/O (?:tag )?\d+ (?:\(\w+\) )?(?:type \d+ )?"
            r"(?:opcode 0x[0-9a-fA-F]+ \([^)\n]{0,40}\) )?QID \d+ timeout|queue \d+: timeout "
            r"request 0x[0-9a-fA-F]+|Abort status|resetting controller|.*reset controller)"
        ),
        Severity.WARNING,
        "the NVMe controller {device} timed out on a command or was reset",
        "check {device} (nvme smart-log, firmware version); repeated timeouts mean a "
        "failing drive or slot",
        ("nvme nvme",),
    ),
    # drivers/nvme/host/multipath.c nvme_ns_head_submit_bio: `block nvme1n1: no available
    # path - failing I/O`
    _Rule(
        "nvme_error",
        "NVMe multipath: no path left",
        re.compile(rf"(?P<device>nvme{_DEV}): no available path - failing I/O"),
        Severity.CRITICAL,
        "the NVMe namespace {device} has no working path left: its I/O fails",
        "check the controllers behind {device} (nvme list-subsys) and their links or fabric "
        "connections; reconnect or replace the failed path",
        ("no available path",),
    ),
    # drivers/edac/edac_mc.c edac_ce_error / edac_ue_error, through edac_mc_printk
    # (`EDAC MC%d: `): `EDAC MC0: 1 CE memory read error on CPU_SrcID#0_Ha#0_Chan#1_DIMM#0
    # (channel:1 slot:0 page:0x12345 offset:0x0 grain:32 syndrome:0x0 ...)`, `... UE ...`;
    # ghes_edac writes `1 CE Single-bit ECC on unknown memory (node:0 card:0 ...)`. The
    # label after ` on ` names the DIMM where the driver knows it.
    _Rule(
        "memory_error",
        "uncorrected memory error",
        _edac("UE"),
        Severity.CRITICAL,
        "the memory controller MC{mc} reported uncorrected host memory errors{where}: data "
        "in host memory was lost",
        "drain the node; decode the error (rasdaemon: ras-mc-ctl --errors, the BMC's event log) "
        "and have the DIMM replaced",
        ("EDAC",),
        numbers={"mc": "memory_controller", "count": "errors"},
        repair=RepairAction.HARDWARE_INSPECTION,
    ),
    _Rule(
        "memory_error",
        "corrected memory error",
        _edac("CE"),
        Severity.WARNING,
        "the memory controller MC{mc} corrected host memory errors{where}",
        "corrected errors at a low rate are normal: watch the count (rasdaemon: ras-mc-ctl "
        "--summary) and replace the DIMM whose count keeps growing",
        ("EDAC",),
        numbers={"mc": "memory_controller", "count": "errors"},
        repair=RepairAction.INVESTIGATE,
    ),
    # kernel/hung_task.c: `INFO: task python3:4321 blocked for more than 120 seconds.` The
    # name is the task's comm (15 bytes at most; it may hold a colon, `kworker/u8:2`): bounded,
    # so a line of many `task ` costs no pass over the rest of it from each one.
    _Rule(
        "hung_task",
        "hung task",
        re.compile(
            r"task (?P<process>[^\n]{1,64}?):(?P<pid>\d{1,10}) blocked for more than "
            r"(?P<seconds>\d{1,10}) seconds"
        ),
        Severity.WARNING,
        "the task {process} (pid {pid}) was blocked in the kernel for more "
        "than {seconds} s (often waiting on a disk, a network mount or a driver)",
        "look at the stack trace that follows in the log and at the device it waits on",
        ("blocked for more than",),
        numbers={"seconds": "blocked_seconds"},
    ),
    # kernel/panic.c panic(): `Kernel panic - not syncing: Fatal exception`
    _Rule(
        "kernel_panic",
        "kernel panic",
        re.compile(r"Kernel panic - not syncing: ?(?P<reason>.*)$", re.DOTALL),
        Severity.CRITICAL,
        "the kernel stopped the machine (panic: {reason})",
        "find the cause in the lines before the panic (an oops, a machine check, a lockup or "
        "hung task set to panic, out of memory with panic_on_oom); check that the machine came "
        "back, and keep this log for the hardware or driver vendor",
        ("Kernel panic",),
        texts={"reason": "reason"},
    ),
    # kernel/watchdog.c: `watchdog: BUG: soft lockup - CPU#7 stuck for 22s! [python3:4321]`
    _Rule(
        "cpu_lockup",
        "soft lockup",
        re.compile(
            r"soft lockup - CPU#(?P<cpu>\d+) stuck for (?P<seconds>\d+)s! "
            r"\[(?P<process>.*):(?P<pid>\d+)\]"
        ),
        Severity.WARNING,
        "CPU {cpu} ran kernel code for {seconds} s without scheduling (task {process}, pid "
        "{pid}): a driver or the kernel is stuck in a loop or waiting with interrupts off",
        "look at the stack trace after this line (the module it names: nvidia, a file system, "
        "a network driver); if it repeats, drain the node and restart it",
        ("soft lockup",),
        numbers={"cpu": "cpu", "seconds": "stuck_seconds"},
    ),
    # kernel/watchdog_perf.c (watchdog_hld.c before 6.6): `Watchdog detected hard LOCKUP on
    # cpu 12`
    _Rule(
        "cpu_lockup",
        "hard lockup",
        re.compile(r"Watchdog detected hard LOCKUP on cpu (?P<cpu>\d+)"),
        Severity.CRITICAL,
        "CPU {cpu} stopped taking interrupts (hard lockup): the machine is hung or about to be",
        "drain the node and restart it; keep the stack trace after this line for the driver or "
        "hardware vendor",
        ("hard LOCKUP",),
        numbers={"cpu": "cpu"},
    ),
    # net/sunrpc/clnt.c rpc_check_timeout (call_timeout before 5.1) and call_decode, written
    # without a prefix: the RPC program (`nfs`, `lockd`, ...) and the server as mounted. At
    # most once per RPC task, rate-limited from about 5.1.
    _Rule(
        "network_storage",
        "file server not responding",
        re.compile(
            r"^(?P<program>[\w.-]{1,32}): server (?P<device>\S{1,255}) not responding, "
            r"still trying"
        ),
        Severity.WARNING,
        "the file server {device} stopped answering ({program}): " + _NOT_ANSWERING,
        _SERVER_ACTION,
        ("not responding, still trying",),
        derived=_storage_program,
    ),
    _Rule(
        "network_storage",
        "file server timed out",
        re.compile(
            r"^(?P<program>[\w.-]{1,32}): server (?P<device>\S{1,255}) not responding, "
            r"timed out"
        ),
        Severity.CRITICAL,
        "the file server {device} stopped answering ({program}) and a soft mount gave up: "
        "reads and writes there failed with I/O errors (a checkpoint being written may be "
        "incomplete)",
        _SERVER_ACTION + "; check the files written while it was down",
        ("not responding, timed out",),
        derived=_storage_program,
    ),
    _all_clear(
        "network_storage",
        "file server answers again",
        re.compile(r"^(?P<program>[\w.-]{1,32}): server (?P<device>\S{1,255}) OK$"),
        "the file server {device} answers again ({program})",
        "nothing: jobs that waited on it carry on",
        triggers=(": server ",),
        derived=_storage_program,
    ),
    # fs/smb/client (fs/cifs before 6.4) connect.c server_unresponsive: up to 5.3 `CIFS VFS:
    # Server <host> has not responded...`, from 5.4 `\\<host> has not responded...`, with
    # the prefix `CIFS: VFS: ` from 5.8.
    _Rule(
        "network_storage",
        "file server not responding",
        re.compile(
            r"CIFS:? VFS: (?:Server |\\\\)(?P<device>[^\s\\]{1,255}) has not responded in "
            r"(?P<seconds>\d{1,9}) seconds"
        ),
        Severity.WARNING,
        "the SMB file server {device} has not answered for {seconds} s and the client "
        "reconnects: " + _NOT_ANSWERING,
        _SERVER_ACTION,
        ("has not responded in",),
        numbers={"seconds": "silent_seconds"},
        derived=_storage_program,
    ),
    # kernel/rcu/tree_stall.h (tree.c before 5.2) and tree_exp.h; `rcu: ` from 4.19. The
    # flavour is rcu_sched or rcu_preempt (also rcu_bh before 4.20).
    _Rule(
        "cpu_lockup",
        "RCU stall",
        re.compile(
            r"INFO: (?P<flavor>rcu_\w{1,16}) (?:self-detected stall on CPU|detected "
            r"(?:expedited )?stalls on CPUs/tasks)"
        ),
        Severity.WARNING,
        "a CPU did not pass through a quiescent state for RCU ({flavor}) for over 20 s: a "
        "driver or the kernel held it in a loop or with interrupts off, and tasks waiting on "
        "RCU hang meanwhile",
        "look at the stack trace after this line (the module it names: nvidia, a file system, "
        "a network driver); if stalls repeat, drain the node and restart it",
        ("self-detected stall on CPU", "stalls on CPUs/tasks"),
        texts={"flavor": "rcu_flavor"},
    ),
    # therm_throt.c (arch/x86/kernel/cpu/mcheck, then mce with pr_fmt `mce: ` from about 5.0,
    # drivers/thermal/intel from 5.12). 5.5 changed the words (`is above threshold, cpu clock
    # is throttled`) and added the count to the all-clear. At most once per 300 s per CPU.
    _Rule(
        "cpu_throttled",
        "CPU throttled for heat",
        re.compile(
            r"CPU(?P<cpu>\d{1,5}): (?P<level>Core|Package) temperature (?:is )?above threshold, "
            r"cpu clock (?:is )?throttled(?: \(total events = (?P<count>\d{1,12})\))?"
        ),
        Severity.WARNING,
        "the host CPUs are too hot (CPU {cpu}'s {level} temperature passed its threshold) and "
        "run at lower clocks: data loading and every CPU-side step of a job slow down",
        "check the node's cooling (fans, inlet temperature, the BMC's sensor log) and "
        "whether the CPU load is normal for this job",
        ("above threshold, cpu clock",),
        numbers={"cpu": "cpu", "count": "throttle_events"},
        derived=_throttle_level,
    ),
    _all_clear(
        "cpu_throttled",
        "CPU temperature normal",
        re.compile(r"CPU(?P<cpu>\d{1,5}): (?P<level>Core|Package) temperature/speed normal"),
        "the host CPUs' temperature and clocks are back to normal (CPU {cpu}'s {level})",
        "nothing",
        triggers=("temperature/speed normal",),
        numbers={"cpu": "cpu"},
        derived=_throttle_level,
    ),
    # NVIDIA's nvidia-modeset (nvidia-modeset-linux.c): the modules loaded differ in version.
    _Rule(
        "driver_mismatch",
        "NVIDIA driver version mismatch",
        re.compile(
            r"Version mismatch: (?P<first>nvidia[\w-]{0,16}\.ko)\((?P<a>[^)\s]{1,64})\) "
            r"(?P<second>nvidia[\w-]{0,16}\.ko)\((?P<b>[^)\s]{1,64})\)"
        ),
        Severity.CRITICAL,
        "the NVIDIA kernel modules loaded are of different versions ({first} {a}, {second} "
        "{b}): a driver upgrade is half in effect",
        "restart the node so that every NVIDIA module is loaded from the installed driver",
        ("Version mismatch: nvidia",),
    ),
    # drivers/pci/pcie/dpc.c: 4.9-4.18 on the port service device (`dpc <bdf>:pcie008: DPC
    # containment event, status:... source:...`), 5.3-6.15 `<driver> <bdf>: DPC: containment
    # event, status:... source:...` (its `... detected` line after it says no more), from 6.16
    # one line naming the source only when it is valid.
    _Rule(
        "pcie_link_down",
        "PCIe port contained an error",
        re.compile(
            rf"(?P<device>{ANY_BDF})(?::pcie\d{{2,3}})?: DPC:? containment event, "
            r"status:(?P<status>0x[0-9a-fA-F]{1,8})(?: source:(?P<source>0x[0-9a-fA-F]{1,8})|"
            rf".{{0,40}}? received from (?P<from>{ANY_BDF}))?"
        ),
        Severity.CRITICAL,
        "the PCIe port {device} took its link down to contain an uncorrectable error "
        "(Downstream Port Containment): the devices below it stopped answering and are "
        "recovered or removed; a GPU there is lost to its jobs",
        "find the device below {device} (lspci -t) and its AER report just before this line; "
        "if it is a GPU or NIC that does not come back, drain the node and restart it",
        ("containment event",),
        derived=_dpc_source,
    ),
    # drivers/pci/hotplug: pciehp_ctrl.c from 4.19 (pciehp_hpc.c 4.2-4.18, the same words);
    # `pciehp <bdf>:pcie004: ` before 5.3, `<driver> <bdf>: pciehp: ` from 5.3; before 4.2
    # `slot(<n>): Link Down event` and `Card not present on Slot(<n>)`. `Link Down/Up ignored`
    # (DPC recovered the link) is no fault.
    _Rule(
        "pcie_link_down",
        "PCIe slot lost its device",
        re.compile(
            rf"(?P<device>{ANY_BDF})(?::pcie\d{{2,3}})?: (?:pciehp: )?"
            r"(?:[Ss]lot\((?P<slot>[^)\s]{1,32})\): (?:Link Down(?!/)|Card not present)|"
            r"Card not present on Slot\((?P<old_slot>[^)\s]{1,32})\))"
        ),
        Severity.WARNING,
        "the PCIe slot below port {device} lost its link or its card: the device there "
        "(a GPU, a NIC, an NVMe drive) is gone until it trains again",
        "if nobody removed it, find what was in the slot (lspci -t, the gpu collector's PCI "
        "count); a GPU or NIC that does not come back needs the node drained and restarted",
        ("Link Down", "Card not present"),
        texts={"slot": "slot", "old_slot": "slot"},
    ),
    _all_clear(
        "pcie_link_down",
        "PCIe slot link up",
        re.compile(
            rf"(?P<device>{ANY_BDF})(?::pcie\d{{2,3}})?: (?:pciehp: )?[Ss]lot\("
            r"(?P<slot>[^)\s]{1,32})\): Link Up(?!/)"
        ),
        "the PCIe slot below port {device} has its link up again",
        "check that the device in it came back (lspci, the gpu collector's PCI count)",
        triggers=("Link Up",),
        texts={"slot": "slot"},
    ),
    # drivers/pci/pcie/err.c pcie_do_recovery, on the port (`AER: ` from 4.19, aerdrv_core.c's
    # `AER: Device recovery ...` before): the devices below a contained error came back, or not.
    _all_clear(
        "pcie_link_down",
        "PCIe port recovered",
        re.compile(rf"(?P<device>{ANY_BDF}): (?:AER: )?[Dd]evice recovery successful"),
        "the kernel recovered the devices below PCIe port {device} after an error (the link "
        "was reset and their drivers resumed)",
        "check that the devices below it work again (lspci, the gpu collector's PCI count)",
        triggers=("recovery successful",),
    ),
    _Rule(
        "pcie_link_down",
        "PCIe recovery failed",
        re.compile(rf"(?P<device>{ANY_BDF}): (?:AER: )?[Dd]evice recovery failed"),
        Severity.CRITICAL,
        "the kernel could not recover the devices below PCIe port {device} after an error: "
        "they stay unusable (a GPU there is lost until the node restarts)",
        "find the device below {device} (lspci -t) and its AER or DPC report before this line; "
        "drain the node and restart it; if it fails again, have the device and its slot looked at",
        ("recovery failed",),
    ),
    # A NIC's link, through netdev_info: mlx5e_update_carrier (`Link down`, `Link up`), Intel's
    # e1000e, ixgbe, i40e, ice and Broadcom's bnxt_en (`NIC Link is Down`, `NIC Link is Up ...`,
    # igb with `igb: <interface> ` before it), tg3 (`Link is down`, `Link is up at ...`),
    # phylib's phy_print_status (`Link is Down`, `Link is Up - ...`).
    _Rule(
        "network_link",
        "network link down",
        re.compile(
            _NETDEV + r"(?:[\w-]{1,16}: [\w.@-]{1,32} )?(?:NIC Link is Down|Link down|"
            r"Link is [Dd]own)"
        ),
        Severity.WARNING,
        "the network interface {device} lost its link",
        _LINK_ACTION,
        ("Link is Down", "Link down", "Link is down"),
        derived=_netdev,
    ),
    _all_clear(
        "network_link",
        "network link up",
        re.compile(
            _NETDEV + r"(?:[\w-]{1,16}: [\w.@-]{1,32} )?(?:NIC Link is Up|Link up|Link is [Uu]p)"
        ),
        "the network interface {device} has its link again",
        "nothing; if it went down unasked, watch it for flaps (ip -s link, ethtool -S {device})",
        triggers=("Link is Up", "Link up", "Link is up"),
        derived=_netdev,
    ),
    # drivers/net/bonding/bond_main.c: `(slave <interface>): link status definitely down,
    # disabling slave` (slave_info, 4.x on), before `link status definitely down for interface
    # <interface>, disabling it`; `definitely up` when it is back.
    _Rule(
        "network_link",
        "bond member down",
        re.compile(
            r"(?P<bond>[\w.@-]{1,32}): (?:\(slave (?P<device>[\w.@-]{1,32})\): link status "
            r"definitely down|link status definitely down for interface "
            r"(?P<old_device>[\w.@-]{1,32}))"
        ),
        Severity.WARNING,
        "the bond {bond} disabled its member {device}: its link went down; the bond runs on the "
        "members left, with less bandwidth (or none, if it was the last)",
        _LINK_ACTION,
        ("link status definitely down",),
        texts={"bond": "bond"},
    ),
    _all_clear(
        "network_link",
        "bond member up",
        re.compile(
            r"(?P<bond>[\w.@-]{1,32}): (?:\(slave (?P<device>[\w.@-]{1,32})\): link status "
            r"definitely up|link status definitely up for interface (?P<old_device>[\w.@-]{1,32}))"
        ),
        "the bond {bond} has its member {device} back",
        "nothing",
        triggers=("link status definitely up",),
        texts={"bond": "bond"},
    ),
    # net/sched/sch_generic.c dev_watchdog: `NETDEV WATCHDOG: <interface> (<driver>): transmit
    # queue <n> timed out`; in 6.x through netdev_crit, `NETDEV WATCHDOG: CPU: <n>: transmit
    # queue <n> timed out <ms> ms`.
    _Rule(
        "network_link",
        "network transmit timeout",
        re.compile(
            r"(?:" + _NETDEV + r")?NETDEV WATCHDOG: (?:(?P<old_device>[\w.@-]{1,32}) "
            r"\((?P<old_driver>[\w.-]{1,32})\)|CPU: \d{1,5}): transmit queue "
            r"(?P<queue>\d{1,5}) timed out(?: (?P<waited>\d{1,12}) ms)?"
        ),
        Severity.WARNING,
        "the network interface {device} sent nothing from a transmit queue for seconds: the "
        "NIC or its driver hung and is being reset; traffic over it stalls meanwhile",
        "if it repeats, look at the NIC's firmware and driver (ethtool -i {device}) and the "
        "kernel log around this line; jobs whose collectives run over it (NCCL) time out",
        ("NETDEV WATCHDOG",),
        numbers={"queue": "tx_queue", "waited": "waited_ms"},
        derived=_netdev,
    ),
    # mlx5 events.c port_module (port.c mlx5_port_module_event 4.10-4.19): the cable or
    # transceiver of a port. Upstream 5.3+ writes the error through mlx5_core_err, which puts
    # `<function>:<line>:(pid <n>): ` before it (so does MLNX_OFED 4.5-4.6); plug and unplug
    # have no such prefix.
    _Rule(
        "network_link",
        "NIC cable or module error",
        re.compile(
            rf"(?P<device>{ANY_BDF}): (?:\w{{1,40}}:\d{{1,6}}:\(pid \d{{1,10}}\): )?Port module "
            r"event\[error\]: module (?P<module>\d{1,4}), (?P<status>[A-Za-z ]{1,32}), "
            r"(?P<error>[^\n]{1,200}?)\.?$"
        ),
        Severity.WARNING,
        "the cable or transceiver module {module} of the NIC {device} failed ({error}): its "
        "port's link is down or unreliable",
        "reseat or replace the cable or transceiver of module {module} (mlxlink -d {device} "
        "-m shows its state); a module too hot needs the node's airflow checked; jobs whose "
        "collectives run over the port (NCCL) stall or fail meanwhile",
        ("Port module event[error]",),
        numbers={"module": "module"},
        texts={"error": "module_error", "status": "module_status"},
    ),
    _Rule(
        "network_link",
        "NIC cable removed",
        re.compile(
            rf"(?P<device>{ANY_BDF}): Port module event: module (?P<module>\d{{1,4}}), "
            r"(?P<status>Cable unplugged|Cable disabled)"
        ),
        Severity.WARNING,
        "the cable or transceiver module {module} of the NIC {device} was removed or disabled "
        "({status}): its port has no link",
        "if nobody took it out, reseat the cable or transceiver of module {module}; jobs whose "
        "collectives run over the port (NCCL) stall or fail meanwhile",
        ("Port module event: ",),
        numbers={"module": "module"},
        texts={"status": "module_status"},
    ),
    _all_clear(
        "network_link",
        "NIC cable plugged",
        re.compile(
            rf"(?P<device>{ANY_BDF}): Port module event: module (?P<module>\d{{1,4}}), "
            r"Cable plugged"
        ),
        "the cable or transceiver module {module} of the NIC {device} is plugged in",
        "check that the port's link comes up (ethtool, ibstat)",
        triggers=("Port module event: ",),
        numbers={"module": "module"},
    ),
    # mm/memory-failure.c kill_proc: the page a process used holds an uncorrected error
    # (hwpoison): `Memory failure: <pfn>: Sending SIGBUS to <comm>:<pid> due to hardware
    # memory corruption` (5.3+; `Killing` 4.8-4.19; `MCE <pfn>: Killing ...` before, `early`
    # in 3.0), and `... forcibly killing <comm>:<pid> because of failure to unmap corrupted page`.
    _Rule(
        "memory_error",
        "process killed for corrupt memory",
        re.compile(
            r"(?:Memory failure: |MCE )(?P<pfn>0x[0-9a-fA-F]{1,16}): (?:Sending SIGBUS to|"
            r"Killing|forcibly killing) (?P<process>.{1,64}?):(?P<pid>\d{1,10}) (?:early )?"
            r"(?:due to hardware memory corruption|because of failure to unmap corrupted page)"
        ),
        Severity.CRITICAL,
        "the process {process} (pid {pid}) was killed (SIGBUS, 'Bus error') because host memory "
        "it used holds an uncorrected error (page frame {pfn}): a job dies this way with no "
        "fault of its own",
        "have the DIMM looked at: find it in the machine check and EDAC lines before this one "
        "(ras-mc-ctl --errors, the BMC's event log); drain the node until it is replaced, then "
        "rerun the job from its last checkpoint",
        ("hardware memory corruption", "unmap corrupted page"),
        texts={"pfn": "page_frame"},
        repair=RepairAction.HARDWARE_INSPECTION,
    ),
    # mm/memory-failure.c action_result: `Memory failure: <pfn>: recovery action for <page
    # type>: <Ignored|Failed|Delayed|Recovered>` (4.8+; `MCE <pfn>: recovery action for ...`
    # 4.2-4.7; `MCE <pfn>: <page type> page recovery: <result>` before).
    _Rule(
        "memory_error",
        "corrupt memory not recovered",
        _page_recovery("Failed"),
        Severity.CRITICAL,
        "host memory holds an uncorrected error (page frame {pfn}) that the kernel could not "
        "take out of use: what uses that page may read corrupt data or be killed",
        "drain the node and have the DIMM replaced (ras-mc-ctl --errors, the BMC's event log "
        "name it); restart the node",
        ("recovery action for", "page recovery:"),
        texts={"pfn": "page_frame", "page": "page_type", "old_page": "page_type"},
        fixed={"recovery": "failed"},
        repair=RepairAction.HARDWARE_INSPECTION,
    ),
    _Rule(
        "memory_error",
        "corrupt memory taken out of use",
        _page_recovery("(?P<result>Recovered|Delayed|Ignored)"),
        Severity.WARNING,
        "host memory holds an uncorrected error (page frame {pfn}); the kernel took the page "
        "out of use ({result}): the DIMM is failing",
        "plan to replace the DIMM (ras-mc-ctl --errors, the BMC's event log name it); more such "
        "lines mean it is getting worse",
        ("recovery action for", "page recovery:"),
        texts={"pfn": "page_frame", "page": "page_type", "old_page": "page_type"},
        derived=lambda values: {"recovery": values["result"].lower()},
        repair=RepairAction.HARDWARE_INSPECTION,
    ),
    # mm/page_alloc.c warn_alloc (warn_alloc_failed before 4.9): `<comm>: page allocation
    # failure: order:<n>, mode:<gfp>(<flags>), nodemask=...` (`failure.` before 3.0; the flags
    # from 4.6, nodemask from 4.11, cpuset on the same line from 5.x); the stall warning of
    # 4.9-4.12; mm/vmalloc.c's reasons through it (`vmalloc: allocation failure: <n> bytes`
    # up to 5.12, `vmalloc error: size <n>, ...` from 5.13).
    _Rule(
        "memory_pressure",
        "kernel memory allocation failed",
        re.compile(
            r"^(?P<process>.{1,64}?): (?:page allocation (?:failure[.:] order:(?P<order>\d{1,2})|"
            r"stalls for (?P<stall_ms>\d{1,12})ms, order:(?P<stall_order>\d{1,2}))|vmalloc(?::| "
            r"error:) (?:allocation failure[,:] (?:allocated \d{1,20} of )?(?P<bytes>\d{1,20}) "
            r"bytes|size (?P<size>\d{1,20}),))(?:.*?mode:(?P<mode>0x[0-9a-fA-F]{1,10})"
            r"(?:\((?P<flags>[\w|]{1,200})\))?)?"
        ),
        Severity.WARNING,
        "a kernel memory allocation for {process} failed: host memory is short, or too "
        "fragmented for the size asked; the call that needed it failed (a driver's buffer, a "
        "network buffer, memory pinned for RDMA or GPUDirect), and a job that made it may fail "
        "with 'out of memory' or 'cannot allocate memory'",
        "look at the host's memory (free -m; /proc/buddyinfo: few free blocks of large order "
        "mean fragmentation) and what holds it (page cache, pinned and huge pages, the job); "
        "compacting (echo 1 > /proc/sys/vm/compact_memory) helps a fragmented host; if it "
        "repeats under the job, keep more memory free (vm.min_free_kbytes) or pin less",
        ("page allocation failure", "page allocation stalls", "vmalloc error:", "vmalloc: "),
        numbers={
            "order": "order",
            "stall_order": "order",
            "stall_ms": "stalled_ms",
            "bytes": "bytes",
            "size": "bytes",
        },
        texts={"mode": "gfp_mode", "flags": "gfp_flags"},
    ),
    # kernel/workqueue.c wq_watchdog_timer_fn (4.5+): `BUG: workqueue lockup - pool cpus=<list>
    # [node=<n>] flags=0x<f> nice=<n> stuck for <n>s!` (` bh`/` bh-hi` for a BH pool from
    # 6.12); it repeats every 30 s while the pool is stuck.
    _Rule(
        "cpu_lockup",
        "workqueue lockup",
        re.compile(
            r"BUG: workqueue lockup - pool cpus=(?P<cpus>[\d,-]{1,256})(?: node=\d{1,5})? "
            r"flags=0x[0-9a-fA-F]{1,8}(?: nice=-?\d{1,3}| bh(?:-hi)?)? stuck for "
            r"(?P<seconds>\d{1,10})s!"
        ),
        Severity.WARNING,
        "a kernel worker pool (CPUs {cpus}) ran none of its queued work for {seconds} s: what "
        "waits on that work (I/O completions, a driver's deferred work, the NVIDIA driver's "
        "among them) hangs meanwhile",
        "look at the busy workqueues and the stack traces the kernel prints after this line "
        "(the module they name); if it repeats, drain the node and restart it",
        ("workqueue lockup",),
        numbers={"seconds": "stuck_seconds"},
        texts={"cpus": "cpus"},
    ),
    # net/netfilter/nf_conntrack_core.c __nf_conntrack_alloc: `nf_conntrack: table full,
    # dropping packet` (a period after it in 3.0; from about 4.8 the module's pr_fmt doubles
    # the prefix: `nf_conntrack: nf_conntrack: table full, dropping packet`).
    _Rule(
        "network_drops",
        "connection tracking table full",
        re.compile(r"nf_conntrack: table full, dropping packet"),
        Severity.WARNING,
        "the kernel's connection-tracking table is full and it drops the packets of new "
        "connections: new connections (NCCL's bootstrap, the storage, SSH) fail or time out "
        "while old ones carry on",
        "raise net.netfilter.nf_conntrack_max (sysctl; conntrack -C counts what is tracked), or "
        "leave the training network's traffic untracked (a NOTRACK rule in the raw table)",
        ("table full, dropping packet",),
    ),
    # net/ipv4/tcp.c tcp_check_oom (pr_fmt `TCP: `, 3.2+): `out of memory -- consider tuning
    # tcp_mem`, `too many orphaned sockets`; 3.0 wrote `Out of socket memory` and `TCP: too
    # many of orphaned sockets`.
    _Rule(
        "network_drops",
        "TCP out of memory",
        re.compile(r"TCP: out of memory -- consider tuning tcp_mem|^Out of socket memory$"),
        Severity.WARNING,
        "TCP has used all the memory net.ipv4.tcp_mem allows: the kernel drops data and resets "
        "connections (a job's TCP transport, a data loader reading over the network, the "
        "storage) until sockets free some",
        "see which sockets hold memory (ss -tm) and what TCP uses (/proc/net/sockstat); raise "
        "net.ipv4.tcp_mem if the node needs it",
        ("consider tuning tcp_mem", "Out of socket memory"),
    ),
    _Rule(
        "network_drops",
        "too many orphaned sockets",
        re.compile(r"TCP: too many (?:of )?orphaned sockets"),
        Severity.WARNING,
        "more closed TCP connections wait to finish than net.ipv4.tcp_max_orphans allows: the "
        "kernel resets them at once, and their last data is lost",
        "find what opens and drops connections that fast (ss -s); raise "
        "net.ipv4.tcp_max_orphans if that is the node's normal load",
        ("orphaned sockets",),
    ),
    # arch/x86/mm/fault.c show_signal_msg, with debug.exception-trace (default on):
    # `<comm>[<pid>]: segfault at <addr> ip <ip> sp <sp> error <n> in <object>[<base>+<size>]`
    # (`[<offset>,<base>+<size>]` from 6.12; ` likely on CPU <n> (core <n>, socket <n>)` from
    # 6.1); arch/x86/kernel/traps.c (pr_fmt `traps: `): `<comm>[<pid>] trap <name> ip:...`,
    # `<comm>[<pid>] general protection fault ip:...` (`general protection ip:` to 4.19).
    _Rule(
        "process_crash",
        "process crashed",
        re.compile(
            r"^(?P<process>.{1,64}?)\[(?P<pid>\d{1,10})\]: segfault at (?P<address>[0-9a-fA-F]{1,16}) "
            r"ip [0-9a-fA-F]{1,16} sp [0-9a-fA-F]{1,16} error [0-9a-fA-F]{1,8}"
            r"(?:(?P<where> in (?P<object>[^\[\n]{1,255}))\[)?(?:.*? likely on CPU (?P<cpu>\d{1,5}))?"
        ),
        Severity.WARNING,
        "the process {process} (pid {pid}) was killed by a segmentation fault (a bad memory "
        "access, at address {address}){where}: " + _CRASH,
        _CRASH_ACTION,
        ("segfault at",),
        texts={"object": "object", "address": "fault_address"},
        numbers={"cpu": "cpu"},
        fixed={"fault": "segfault"},
    ),
    _Rule(
        "process_crash",
        "process crashed",
        re.compile(
            r"^traps: (?P<process>.{1,64}?)\[(?P<pid>\d{1,10})\] (?:trap (?P<trap>[a-z0-9 ]{1,40}?)|"
            r"(?P<gp>general protection)(?: fault)?) ip:[0-9a-fA-F]{1,16} sp:[0-9a-fA-F]{1,16} "
            r"error:[0-9a-fA-F]{1,8}(?:(?P<where> in (?P<object>[^\[\n]{1,255}))\[)?"
        ),
        Severity.WARNING,
        "the process {process} (pid {pid}) was killed by a CPU fault ({trap}{gp}){where}: "
        + _CRASH,
        _CRASH_ACTION,
        ("traps: ",),
        texts={"object": "object", "trap": "fault", "gp": "fault"},
    ),
    # kernel/time/clocksource.c clocksource_watchdog (pr_fmt `clocksource: `, 4.4+; `on CPU<n>`
    # from 4.6): `timekeeping watchdog on CPU<n>: Marking clocksource '<name>' as unstable
    # because the skew is too large:`; before 4.4 `Clocksource <name> unstable (delta = <n>
    # ns)`; arch/x86/kernel/tsc.c: `tsc: Marking TSC unstable due to <reason>`.
    _Rule(
        "clock_unstable",
        "clock marked unstable",
        re.compile(
            r"(?:timekeeping watchdog(?: on CPU(?P<cpu>\d{1,5}))?: Marking clocksource "
            r"'(?P<device>[\w.-]{1,32})' as unstable|^Clocksource (?P<old_device>[\w.-]{1,32}) "
            r"unstable \(delta = (?P<delta>-?\d{1,20}) ns\))"
        ),
        Severity.WARNING,
        "the kernel stopped trusting the {device} clock (it drifted from another) and moved to "
        "a slower one: " + _CLOCK,
        _CLOCK_ACTION,
        ("as unstable", "unstable (delta"),
        numbers={"cpu": "cpu", "delta": "skew_ns"},
    ),
    _Rule(
        "clock_unstable",
        "TSC marked unstable",
        re.compile(r"Marking (?P<device>TSC) unstable due to (?P<reason>[^\n]{1,80})"),
        Severity.WARNING,
        "the kernel stopped trusting the CPU's time-stamp counter ({device}: {reason}) and moved to a "
        "slower clock: " + _CLOCK,
        _CLOCK_ACTION,
        ("TSC unstable",),
        texts={"reason": "reason"},
    ),
)


class _Blank(dict[str, str]):
    def __missing__(self, key: str) -> str:
        return "?"


def _rule_finding(rule: _Rule, record: LogRecord, match: re.Match[str]) -> Finding:
    values = {k: v or "" for k, v in match.groupdict().items()}
    # A pattern cannot name two groups alike: an older wording's device is `old_device`.
    values["device"] = values.get("device") or values.get("old_device", "")
    attributes: dict[str, AttributeValue] = dict(rule.fixed)
    for group, key in rule.numbers.items():
        if values.get(group):
            attributes[key] = int(values[group])
    for group, key in rule.texts.items():
        if values.get(group):
            attributes[key] = values[group].strip()
    if rule.derived is not None:
        attributes.update(rule.derived(values))
    return Finding(
        kind=rule.kind,
        severity=rule.severity,
        repair_action=rule.repair if rule.repair is not None else HOST_REPAIR[rule.kind],
        record=record,
        meaning=rule.meaning.format_map(_Blank(values)),
        action=rule.action.format_map(_Blank(values)),
        device=values.get("device", ""),
        process=values.get("process", ""),
        pid=number(values.get("pid")),
        name=rule.name,
        clears=rule.clears,
        attributes=attributes,
    )


# NVIDIA's osapi.c (open-gpu-kernel-modules), one printk over four or five lines: 515-570
# `the client has the version <v>, but / this kernel module has the version <v>.`, from 575
# `the client '<comm>' (pid <n>) / has the version <v>, but this kernel module has / the
# version <v>.` /dev/kmsg keeps it one record; a saved shape splits it into lines (indented
# under the first, or not with `dmesg -t`), so `ApiMismatchMatcher` reads the lines after the
# first as the rest of its text.
_API_MISMATCH: Final = _Rule(
    "driver_mismatch",
    "NVIDIA driver version mismatch",
    re.compile(
        r"NVRM: API mismatch: the client(?: '(?P<client>[^'\n]{0,64})' "
        r"\(pid (?P<client_pid>\d{1,10})\))?(?:\s+(?:NVRM: )?has the version|"
        r" has the version)?(?: (?P<client_version>\d[\w.-]{0,63}?), but)?"
        r"(?:\s+(?:NVRM: )?this kernel module has\s+(?:NVRM: )?the version "
        r"(?P<module_version>\d[\w.-]{0,63}?)\.\s)?"
    ),
    Severity.CRITICAL,
    "the NVIDIA kernel module loaded is not the version of the driver's libraries: no "
    "program can use the GPUs (CUDA and NVML fail with 'Driver/library version "
    "mismatch'); a driver upgrade that is not in effect until the next restart does this",
    "restart the node to load the kernel module that matches the installed driver (or, "
    "with no process on the GPUs, unload and reload the nvidia modules); in a container, "
    "check that the runtime mounts the host's driver libraries",
    ("API mismatch",),
    numbers={"client_pid": "client_pid"},
    texts={
        "client": "client",
        "client_version": "client_version",
        "module_version": "module_version",
    },
)
# The lines of the one printk follow each other, five of them at most.
API_MISMATCH_REACH: Final = 1
API_MISMATCH_LINES: Final = 5


@dataclass
class _Mismatch:
    record: LogRecord
    text: str
    built: Finding
    lines: int = 1

    def finding(self) -> Finding:
        return self.built


class ApiMismatchMatcher(Assembling[_Mismatch]):
    """The driver's API mismatch: both versions, whether the record came whole (/dev/kmsg)
    or as lines (a saved shape), in which case the finding waits for the line with the
    kernel module's version."""

    triggers: Final = ("API mismatch", "the version ")

    def __init__(self) -> None:
        self._open: OpenRecords[_Mismatch] = OpenRecords(API_MISMATCH_REACH)

    def feed(self, record: LogRecord) -> Iterator[Finding]:
        yield from self._open.advance(record)
        message = record.message
        rule = _API_MISMATCH
        if "API mismatch" in message:
            match = rule.pattern.search(message)
            if match is None:
                return
            state = _Mismatch(record, message[match.start() :], _rule_finding(rule, record, match))
            if match["module_version"]:
                found = self._open.close(_MISMATCH_KEY)
                yield from (() if found is None else (found,))
                yield state.built
                return
            yield from self._open.hold(_MISMATCH_KEY, state)
            return
        held = self._open.get(_MISMATCH_KEY)
        if held is None or not message.startswith("NVRM: ") or held.lines >= API_MISMATCH_LINES:
            return
        held.text += "\n" + message
        held.lines += 1
        self._open.extend(_MISMATCH_KEY)
        match = rule.pattern.search(held.text)
        if match is None:
            return
        held.built = _rule_finding(rule, held.record, match)
        if match["module_version"]:
            found = self._open.close(_MISMATCH_KEY)
            if found is not None:
                yield found


_MISMATCH_KEY: Final = "api mismatch"


# mm/oom_kill.c. The summary (4.19+, dump_oom_summary) comes first:
#   oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,mems_allowed=0-1,
#   global_oom,task_memcg=/user.slice,task=python3,pid=9876,uid=1000
# then the kill (__oom_kill_process), `Out of memory: ` or `Memory cgroup out of memory: `:
#   Killed process 9876 (python3) total-vm:123kB, anon-rss:..., UID:1000 pgtables:...
# Before 5.0 the kill line stood alone; RHEL 7's kernel writes `Killed process 9876, UID 1000,
# (python3) total-vm:...`. A process name may hold parentheses and spaces (systemd names a
# forked child `(sd-pam)` until it execs): it ends at the `)` before ` total-vm:`.
# The summary is one printk line (1 KiB at most) starting at its `oom-kill:`: matched there
# only, its runs bounded, so a line of many `oom-kill:` costs no pass over the rest of it from
# each one.
_OOM_SUMMARY = re.compile(
    r"oom-kill:(?P<fields>.{0,2048}),task=(?P<process>.{0,64}),pid=(?P<pid>\d{1,10}),"
    r"uid=(?P<uid>\d{1,10})",
    re.DOTALL,
)
_OOM_SUMMARY_START: Final = "oom-kill:"
_OOM_FIELD = re.compile(r"(?:^|,)(?P<key>constraint|task_memcg|oom_memcg)=(?P<value>[^,]*)")
_OOM_KILL = re.compile(
    r"Killed process (?P<pid>\d+)(?:, UID (?P<uid>\d+),)? \((?P<process>.*?)\)"
    r"(?= total-vm:| vsz:| score |\s*$)",
    re.DOTALL,
)
_OOM_UID = re.compile(r"\bUID:(?P<uid>\d+)")
# The two lines come from one oom_kill_process() call; little can come between them.
OOM_REACH: Final = 16


def _oom_finding(
    record: LogRecord, pid: int, process: str, attributes: dict[str, AttributeValue]
) -> Finding:
    scope = ""
    if attributes.get("constraint") == "CONSTRAINT_MEMCG" or attributes.get("cgroup"):
        cgroup = attributes.get("oom_memcg") or attributes.get("memcg")
        scope = f" (its memory cgroup{f' {cgroup}' if cgroup else ''} reached its limit)"
    return Finding(
        kind="oom_kill",
        severity=Severity.WARNING,
        repair_action=HOST_REPAIR["oom_kill"],
        meaning=f"the kernel's OOM killer killed {process} (pid {pid}) to free memory{scope}",
        action=f"find out why {process} ran out of memory (its limits, the host's memory); "
        "rerun the job with more memory or a smaller batch",
        record=record,
        process=process,
        pid=pid,
        name="OOM kill",
        attributes=attributes,
    )


class OomMatcher(Assembling[Ready]):
    """OOM kills: the summary line and the kill line of one kill are one finding."""

    triggers: Final = ("oom-kill:", "Killed process ")

    def __init__(self) -> None:
        self._open: OpenRecords[Ready] = OpenRecords(OOM_REACH)

    def feed(self, record: LogRecord) -> Iterator[Finding]:
        yield from self._open.advance(record)
        message = record.message
        start = message.find(_OOM_SUMMARY_START)
        summary = _OOM_SUMMARY.match(message, start) if start >= 0 else None
        if summary is not None:
            attributes: dict[str, AttributeValue] = {"uid": int(summary["uid"])}
            for field_match in _OOM_FIELD.finditer(summary["fields"]):
                key = "memcg" if field_match["key"] == "task_memcg" else field_match["key"]
                attributes[key] = field_match["value"]
            pid = int(summary["pid"])
            found = _oom_finding(record, pid, summary["process"], attributes)
            for key in list(self._open.open):  # one kill at a time (oom_lock)
                if (earlier := self._open.close(key)) is not None:
                    yield earlier
            yield from self._open.hold(pid, Ready(found))
            return
        kill = _OOM_KILL.search(message)
        if kill is None:
            return
        pid = int(kill["pid"])
        held = self._open.get(pid)
        if held is None and self._open.near(pid):
            return  # its summary was handed on already (a live batch ended between them)
        if held is not None:  # else a summary of the other numbering stays its own finding
            self._open.drop(pid)
        attributes = dict(held.built.attributes) if held is not None else {}
        uid = kill["uid"] or (uid_match["uid"] if (uid_match := _OOM_UID.search(message)) else "")
        if uid:
            attributes["uid"] = int(uid)
        if "cgroup" in message[: kill.start()]:
            attributes["cgroup"] = True
        yield _oom_finding(record, pid, kill["process"], attributes)


# block/blk-core.c handle_bad_sector, one printk over two lines: 5.12+
#   python3: attempt to access beyond end of device
#   sda1: rw=1, sector=123456, nr_sectors = 8 limit=100000
# before: `attempt to access beyond end of device` / `sda1: rw=0, want=2048, limit=1024`.
# Found by its words, then the task read from just before them: a pattern that began with
# the optional `\S+: ` would try it from every place in a line (tests/test_kernel_log_hostile.py).
_BEYOND = re.compile(r"attempt to access beyond end of device")
_BEYOND_TASK = re.compile(r"(?:^|\s)(?P<task>\S{1,64}): $")
_BEYOND_DEVICE = re.compile(rf"(?m)^\s*(?P<device>{_DEV}): rw=\d+, (?:want|sector)=")


@dataclass
class _Beyond:
    record: LogRecord
    task: str
    device: str = ""

    def finding(self) -> Finding:
        device = self.device or "a block device"
        return Finding(
            kind="io_error",
            severity=Severity.CRITICAL,
            repair_action=HOST_REPAIR["io_error"],
            meaning=f"an I/O to {device} asked for sectors past its end and failed (a file "
            "system larger than its device, a corrupted one, or a volume that shrank)",
            action=f"compare the file system's size with {device}'s (blockdev --getsize64, the "
            "partition table); unmount and fsck it; check that a resized volume (dm, SAN LUN) "
            "did not shrink",
            record=self.record,
            device=self.device,
            name="I/O beyond the end of the device",
            attributes={"task": self.task} if self.task else {},
        )


class BeyondEndMatcher(Assembling[_Beyond]):
    triggers: Final = ("attempt to access beyond end of device", ": rw=")

    def __init__(self) -> None:
        self._open: OpenRecords[_Beyond] = OpenRecords(1)

    def feed(self, record: LogRecord) -> Iterator[Finding]:
        yield from self._open.advance(record)
        message = record.message
        if (start := _BEYOND.search(message)) is not None:
            task = _BEYOND_TASK.search(message, max(0, start.start() - 80), start.start())
            state = _Beyond(record, task["task"] if task is not None else "")
            device = _BEYOND_DEVICE.search(message, start.end())
            if device is not None:
                state.device = device["device"]
                yield state.finding()
                return
            yield from self._open.hold("beyond", state)
            return
        held = self._open.get("beyond")
        device = _BEYOND_DEVICE.search(message) if held is not None else None
        if held is not None and device is not None:
            held.device = device["device"]
            found = self._open.close("beyond")
            if found is not None:
                yield found


# A kernel oops: what went wrong first (arch/x86/mm/fault.c `BUG: kernel NULL pointer
# dereference, address: ...`, `BUG: unable to handle page fault for address: ...`; lib/bug.c
# `kernel BUG at mm/slub.c:4023!`; arm64 `Unable to handle kernel paging request at ...`),
# then the die line (arch/x86/kernel/dumpstack.c __die_header: "%s: %04lx [#%d]..." as
# `Oops: 0002 [#1] PREEMPT SMP NOPTI`, `general protection fault, ...: 0000 [#1] SMP`,
# `invalid opcode: 0000 [#1] SMP`; arm64 `Internal error: Oops: 96000005 [#1] SMP`).
_OOPS_START = re.compile(
    r"BUG: (?:unable to handle|kernel NULL pointer dereference)|kernel BUG at |"
    r"Unable to handle kernel "
)
_DIE = re.compile(r": (?P<err>[0-9a-f]{4,16}) \[#(?P<n>\d+)\]")
OOPS_REACH: Final = 8


@dataclass
class _Oops:
    record: LogRecord
    lines: list[str]
    what: str = ""
    count: int | None = None

    def finding(self) -> Finding:
        what = self.what or self.lines[0].strip()[:120]
        attributes: dict[str, AttributeValue] = {"text": " | ".join(self.lines)}
        if self.count is not None:
            attributes["oops_number"] = self.count
        return Finding(
            kind="kernel_oops",
            severity=Severity.CRITICAL,
            repair_action=HOST_REPAIR["kernel_oops"],
            meaning=f"the kernel hit a fault in its own code ({what}) and killed the task that "
            "ran it; the kernel may be unstable from here on",
            action="keep the log from this line to the end of the Call Trace (it names the "
            "module: nvidia, a file system, a driver); drain the node and restart it; report "
            "repeated oopses in one module to its vendor",
            record=self.record,
            name="kernel oops",
            attributes=attributes,
        )


class OopsMatcher(Assembling[_Oops]):
    triggers: Final = (
        "BUG: unable to handle",
        "BUG: kernel NULL pointer",
        "kernel BUG at",
        "Unable to handle kernel",
        " [#",
    )

    def __init__(self) -> None:
        self._open: OpenRecords[_Oops] = OpenRecords(OOPS_REACH)

    def feed(self, record: LogRecord) -> Iterator[Finding]:
        yield from self._open.advance(record)
        message = record.message.strip()
        if _OOPS_START.search(message):
            yield from self._open.hold("oops", _Oops(record, [message]))
            return
        die = _DIE.search(message) if " [#" in message else None
        if die is None:
            return
        held = self._open.get("oops")
        state = held if held is not None else _Oops(record, [])
        state.lines.append(message)
        what = message[: die.start()].strip().removeprefix("Oops: ")
        state.what, state.count = what, int(die["n"])
        if held is not None:  # else a start of the other numbering stays its own finding
            self._open.drop("oops")
        yield state.finding()


# arch/x86/kernel/cpu/mce/core.c print_mce, every line `mce: [Hardware Error]: ...`:
#   CPU 3: Machine Check Exception: 5 Bank 7: be00000000800400     (fatal, then a panic)
#   CPU 0: Machine Check: 0 Bank 18: dc2040000000011b              (a logged record)
#   RIP ..., TSC ... ADDR ... MISC ..., PROCESSOR ..., Run the above through 'mcelog --ascii'
#   Machine check: Processor context corrupt                       (mce_panic's reason)
# and mce_notify_irq's `Machine check events logged` (corrected errors went to the log).
# Bit 61 of the bank status (MCi_STATUS.UC) says the error was not corrected.
_MCE = re.compile(r"mce: \[Hardware Error\]: ?(?P<text>.*)$", re.DOTALL)
_MCE_HEAD = re.compile(
    r"CPU (?P<cpu>\d+): Machine Check(?P<exception> Exception)?: (?P<mcg>[0-9a-fA-F]+) "
    r"Bank (?P<bank>\d+): (?P<status>[0-9a-fA-F]+)"
)
_MCE_REASON = re.compile(r"^Machine check: (?P<reason>.+)")
_MCE_LOGGED: Final = "Machine check events logged"
_UNCORRECTED_BIT: Final = 61
MCE_REACH: Final = 16


@dataclass
class _Mce:
    record: LogRecord
    lines: list[str]
    uncorrected: bool
    attributes: dict[str, AttributeValue] = field(default_factory=dict)

    def finding(self) -> Finding:
        cpu, bank = self.attributes.get("cpu"), self.attributes.get("bank")
        where = f"CPU {cpu} reported, in machine-check bank {bank}," if cpu is not None else ""
        if self.uncorrected:
            meaning = f"{where or 'the CPU reported'} a hardware error it could not correct"
            action = (
                "drain the node: a CPU, memory or PCIe error was not corrected; decode it "
                "(mcelog --ascii, rasdaemon: ras-mc-ctl --errors), check the BMC's event log "
                "and have the part (DIMM, CPU) replaced"
            )
        else:
            meaning = f"{where or 'the CPU reported'} hardware errors that it corrected"
            action = (
                "corrected errors at a low rate are normal: decode them (rasdaemon: ras-mc-ctl "
                "--summary) and replace the DIMM or part whose count keeps growing"
            )
        return Finding(
            kind="machine_check",
            severity=Severity.CRITICAL if self.uncorrected else Severity.WARNING,
            repair_action=_hardware_repair(
                Severity.CRITICAL if self.uncorrected else Severity.WARNING
            ),
            meaning=meaning,
            action=action,
            record=self.record,
            name="machine check" + ("" if self.uncorrected else " (corrected)"),
            attributes={**self.attributes, "text": " | ".join(self.lines[:8])},
        )


class MachineCheckMatcher(Assembling[_Mce]):
    triggers: Final = ("[Hardware Error]",)

    def __init__(self) -> None:
        self._open: OpenRecords[_Mce] = OpenRecords(MCE_REACH)

    def feed(self, record: LogRecord) -> Iterator[Finding]:
        yield from self._open.advance(record)
        match = _MCE.search(record.message)
        if match is None:
            return
        text = match["text"].strip()
        held = self._open.get("mce")
        if (head := _MCE_HEAD.search(text)) is not None:
            status = int(head["status"], 16)
            state = _Mce(
                record,
                [text],
                bool(head["exception"]) or bool(status >> _UNCORRECTED_BIT & 1),
                {"cpu": int(head["cpu"]), "bank": int(head["bank"]), "status": head["status"]},
            )
            yield from self._open.hold("mce", state)
        elif held is not None or (text.startswith(_MCE_LOGGED) and self._open.near("mce")):
            if held is not None:
                held.lines.append(text)
                if (reason := _MCE_REASON.match(text)) is not None:
                    held.uncorrected, held.attributes["reason"] = True, reason["reason"]
            self._open.extend("mce")
        elif text.startswith(_MCE_LOGGED):
            yield _Mce(record, [text], uncorrected=False).finding()
        elif (reason := _MCE_REASON.match(text)) is not None:
            yield _Mce(record, [text], True, {"reason": reason["reason"]}).finding()


# drivers/acpi/apei/ghes.c: a firmware-reported error record (CPER), every line prefixed with
# `{N}[Hardware Error]: ` (N numbers the record):
#   {1}[Hardware Error]: Hardware error from APEI Generic Hardware Error Source: 0
#   {1}[Hardware Error]: event severity: fatal          (cper.c: fatal, recoverable,
#   {1}[Hardware Error]:  Error 0, type: fatal            corrected, info)
#   {1}[Hardware Error]:   section_type: PCIe error
_CPER = re.compile(r"\{(?P<seq>\d+)\}\[Hardware Error\]: ?(?P<text>.*)$", re.DOTALL)
_CPER_SOURCE = re.compile(r"Hardware error from APEI Generic Hardware Error Source: (?P<n>\d+)")
_CPER_SEVERITY = re.compile(r"event severity: (?P<severity>\w+)")
_CPER_SECTION = re.compile(r"section_type: (?P<section>.+)")
_CPER_SEVERITIES: Final = {
    "fatal": Severity.CRITICAL,
    "recoverable": Severity.CRITICAL,
    "corrected": Severity.WARNING,
    "info": Severity.INFO,
}
CPER_REACH: Final = 32


@dataclass
class _Cper:
    record: LogRecord
    lines: list[str]
    severity: str = ""
    sections: list[str] = field(default_factory=list)
    source: int | None = None

    def add(self, text: str) -> None:
        self.lines.append(text)
        if (severity := _CPER_SEVERITY.search(text)) is not None and not self.severity:
            self.severity = severity["severity"].lower()
        if (section := _CPER_SECTION.search(text)) is not None:
            self.sections.append(section["section"].strip())
        if (source := _CPER_SOURCE.search(text)) is not None:
            self.source = int(source["n"])

    def finding(self) -> Finding:
        severity = _CPER_SEVERITIES.get(self.severity, Severity.WARNING)
        what = ", ".join(dict.fromkeys(self.sections)) or "hardware"
        told = self.severity or "unstated"
        attributes: dict[str, AttributeValue] = {
            "event_severity": told,
            "text": " | ".join(self.lines[:12]),
        }
        if self.source is not None:
            attributes["error_source"] = self.source
        if severity >= Severity.CRITICAL:
            action = (
                "drain the node: the firmware reported an uncorrected error; check the BMC's "
                "event log (ipmitool sel list) and have the part named in the record replaced"
            )
        else:
            action = (
                "corrected errors at a low rate are normal; if they repeat, check the BMC's "
                "event log (ipmitool sel list) and the part named in the record"
            )
        return Finding(
            kind="hardware_error",
            severity=severity,
            repair_action=_hardware_repair(severity),
            meaning=f"the firmware reported a {told} {what} error (APEI/CPER record)",
            action=action,
            record=self.record,
            name="firmware-reported hardware error",
            attributes=attributes,
        )


class CperMatcher(Assembling[_Cper]):
    triggers: Final = ("[Hardware Error]",)

    def __init__(self) -> None:
        self._open: OpenRecords[_Cper] = OpenRecords(CPER_REACH)

    def feed(self, record: LogRecord) -> Iterator[Finding]:
        yield from self._open.advance(record)
        match = _CPER.search(record.message)
        if match is None:
            return
        seq, text = int(match["seq"]), match["text"].strip()
        held = self._open.get(seq)
        if held is not None and not _CPER_SOURCE.search(text):
            held.add(text)
            self._open.extend(seq)
            return
        if held is None and self._open.near(seq) and not _CPER_SOURCE.search(text):
            self._open.extend(seq)  # a line of a record handed on already
            return
        state = _Cper(record, [])
        state.add(text)
        yield from self._open.hold(seq, state)


class HostRulesMatcher:
    """The single-line rules: the first rule (in `_RULES` order) that matches a line wins."""

    def __init__(self, rules: Sequence[_Rule] = _RULES) -> None:
        self._index = TriggerIndex([(rule, rule.triggers) for rule in rules])
        self.triggers: tuple[str, ...] = tuple(dict.fromkeys(t for r in rules for t in r.triggers))

    def feed(self, record: LogRecord) -> Iterator[Finding]:
        for rule in self._index.hits(record.message):
            match = rule.pattern.search(record.message)
            if match is not None:
                yield _rule_finding(rule, record, match)
                return

    def settle(self) -> list[Finding]:
        return []

    def flush(self) -> list[Finding]:
        return []


def host_matchers() -> list[Matcher]:
    return [
        OomMatcher(),
        ApiMismatchMatcher(),
        BeyondEndMatcher(),
        OopsMatcher(),
        MachineCheckMatcher(),
        CperMatcher(),
        HostRulesMatcher(),
    ]


class HostMatcher:
    """All the host kinds as one matcher (`MatcherSet` feeds the parts one by one)."""

    def __init__(self) -> None:
        self._parts = host_matchers()
        self._index = TriggerIndex([(part, part.triggers) for part in self._parts])
        self.triggers: tuple[str, ...] = tuple(
            dict.fromkeys(t for part in self._parts for t in part.triggers)
        )

    def feed(self, record: LogRecord) -> Iterator[Finding]:
        for part in self._index.hits(record.message):
            yield from part.feed(record)

    def settle(self) -> list[Finding]:
        return [f for part in self._parts for f in part.settle()]

    def flush(self) -> list[Finding]:
        return [f for part in self._parts for f in part.flush()]
