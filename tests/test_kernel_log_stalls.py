"""What the kernel says when a node stalls or slows for a reason outside the GPU: a network file
server that stopped answering (the usual cause of a job stuck in D state), an RCU stall, CPUs
throttled for heat, an NVIDIA driver whose kernel module and libraries differ in version (no
CUDA program starts), and a PCIe port that contained an error or lost its link (the device
below it is gone). Each wording is the kernel's or the driver's, in every version named in
tests/fixtures/kernel_log/corpus/SOURCES.md (class 12).

A line that says the fault is over (`nfs: server ... OK`, `temperature/speed normal`, a slot's
`Link Up`) clears it; and a fault after its all-clear is news, never a repeat held back.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import NamedTuple

import pytest

from agent.contracts.collector import MemoryKeyValueStore
from agent.contracts.model import Event, RepairAction, Sample, Severity
from agent.program.commands.scan import EXIT_CLEAN, EXIT_WARNINGS
from agent.program.commands.scan import exit_code as scan_exit_code
from agent.program.diagnose.findings import Finding as CheckFinding
from agent.program.diagnose.findings import Status
from agent.program.diagnose.kernel_findings import KernelLogScan, classify_kernel_log
from agent.runtime.repairs import RepairLedger
from collectors.kernel_log.matchers import KINDS, Finding
from tests.support.klog_shapes import SHAPES
from tests.support.kmsg import FakeKmsg
from tests.test_kernel_log_pcie import in_shape
from tests.test_kernel_log_records import BOTH, scan, scan_dmesg
from tests.test_kmsg_collector import Harness, executor, value

__all__ = ["executor"]  # the fixture, used by name

R = RepairAction


class Line(NamedTuple):
    text: str
    """One record; a newline in it is a printk with several lines (one /dev/kmsg record, several
    `dmesg` lines)."""
    kind: str
    device: str
    severity: Severity
    repair: RepairAction
    clears: tuple[str, ...] = ()
    attributes: Mapping[str, object] = MappingProxyType({})


STORAGE = "network_storage"
THROTTLED = "cpu_throttled"
MISMATCH = "driver_mismatch"
LINK = "pcie_link_down"
NET = "network_link"

LINES = [
    # net/sunrpc/clnt.c rpc_check_timeout (call_timeout before 5.1) and call_decode: the RPC
    # program's name, then the server as it was mounted.
    Line(
        "nfs: server nas01.example.com not responding, still trying",
        STORAGE,
        "nas01.example.com",
        Severity.WARNING,
        R.CHECK_STORAGE,
        attributes={"program": "nfs"},
    ),
    Line(
        "nfs: server 10.0.0.5 not responding, timed out",
        STORAGE,
        "10.0.0.5",
        Severity.CRITICAL,
        R.CHECK_STORAGE,
    ),
    Line(
        "lockd: server 10.0.0.5 not responding, still trying",
        STORAGE,
        "10.0.0.5",
        Severity.WARNING,
        R.CHECK_STORAGE,
        attributes={"program": "lockd"},
    ),
    Line(
        "nfs: server [fd00::5] not responding, still trying",
        STORAGE,
        "[fd00::5]",
        Severity.WARNING,
        R.CHECK_STORAGE,
    ),
    Line(
        "nfs: server nas01.example.com OK",
        STORAGE,
        "nas01.example.com",
        Severity.INFO,
        R.NONE,
        (STORAGE,),
    ),
    # fs/smb/client/connect.c server_unresponsive: 5.8+, 5.4-5.7, and up to 5.3
    Line(
        "CIFS: VFS: \\\\192.168.1.5 has not responded in 180 seconds. Reconnecting...",
        STORAGE,
        "192.168.1.5",
        Severity.WARNING,
        R.CHECK_STORAGE,
        attributes={"program": "cifs", "silent_seconds": 180},
    ),
    Line(
        "CIFS VFS: \\\\192.168.1.5 has not responded in 180 seconds. Reconnecting...",
        STORAGE,
        "192.168.1.5",
        Severity.WARNING,
        R.CHECK_STORAGE,
    ),
    Line(
        "CIFS VFS: Server files01 has not responded in 120 seconds. Reconnecting...",
        STORAGE,
        "files01",
        Severity.WARNING,
        R.CHECK_STORAGE,
    ),
    # kernel/rcu/tree_stall.h and tree_exp.h (pr_fmt "rcu: " from 4.19; none before)
    Line(
        "rcu: INFO: rcu_sched self-detected stall on CPU",
        "cpu_lockup",
        "",
        Severity.WARNING,
        R.INVESTIGATE,
        attributes={"rcu_flavor": "rcu_sched"},
    ),
    Line(
        "rcu: INFO: rcu_preempt detected stalls on CPUs/tasks:",
        "cpu_lockup",
        "",
        Severity.WARNING,
        R.INVESTIGATE,
    ),
    Line(
        "INFO: rcu_bh detected stalls on CPUs/tasks:",
        "cpu_lockup",
        "",
        Severity.WARNING,
        R.INVESTIGATE,
    ),
    Line(
        "rcu: INFO: rcu_preempt detected expedited stalls on CPUs/tasks: { 1-...D } 2651 "
        "jiffies s: 2425 root: 0x2/.",
        "cpu_lockup",
        "",
        Severity.WARNING,
        R.INVESTIGATE,
    ),
    # therm_throt.c (arch/x86/kernel/cpu/mcheck, then .../mce with pr_fmt "mce: ", then
    # drivers/thermal/intel from 5.12): the words before 5.5 and from 5.5
    Line(
        "CPU2: Package temperature above threshold, cpu clock throttled (total events = 245)",
        THROTTLED,
        "",
        Severity.WARNING,
        R.CHECK_COOLING,
        attributes={"cpu": 2, "level": "package", "throttle_events": 245},
    ),
    Line(
        "mce: CPU2: Core temperature above threshold, cpu clock throttled (total events = 9)",
        THROTTLED,
        "",
        Severity.WARNING,
        R.CHECK_COOLING,
        attributes={"level": "core"},
    ),
    Line(
        "CPU9: Package temperature is above threshold, cpu clock is throttled (total events = "
        "1234)",
        THROTTLED,
        "",
        Severity.WARNING,
        R.CHECK_COOLING,
    ),
    Line(
        "CPU9: Package temperature/speed normal (total events = 1234)",
        THROTTLED,
        "",
        Severity.INFO,
        R.NONE,
        (THROTTLED,),
    ),
    Line(
        "mce: CPU2: Core temperature/speed normal",
        THROTTLED,
        "",
        Severity.INFO,
        R.NONE,
        (THROTTLED,),
    ),
    # NVIDIA's osapi.c (open-gpu-kernel-modules): 515-570, then 575 on (names the client)
    Line(
        "NVRM: API mismatch: the client has the version 550.54.15, but\n"
        "NVRM: this kernel module has the version 535.161.08.  Please\n"
        "NVRM: make sure that this kernel module and all NVIDIA driver\n"
        "NVRM: components have the same version.",
        MISMATCH,
        "",
        Severity.CRITICAL,
        R.REBOOT_NODE,
        attributes={"client_version": "550.54.15"},
    ),
    Line(
        "NVRM: API mismatch: the client 'nvidia-smi' (pid 4242)\n"
        "NVRM: has the version 570.133.20, but this kernel module has\n"
        "NVRM: the version 575.51.02.  Please make sure that this\n"
        "NVRM: kernel module and all NVIDIA driver components\n"
        "NVRM: have the same version.",
        MISMATCH,
        "",
        Severity.CRITICAL,
        R.REBOOT_NODE,
        attributes={"client": "nvidia-smi", "client_pid": 4242},
    ),
    Line(
        "nvidia-modeset: Version mismatch: nvidia.ko(535.161.08) nvidia-modeset.ko(550.54.15)",
        MISMATCH,
        "",
        Severity.CRITICAL,
        R.REBOOT_NODE,
    ),
    # drivers/pci/pcie/dpc.c: 4.9-4.18 (port service device), 5.3-6.15 (dev_fmt "DPC: "),
    # 6.16 on (one line, the source named only when valid)
    Line(
        "dpc 0000:00:03.2:pcie008: DPC containment event, status:0x1f01 source:0x0000",
        LINK,
        "0000:00:03.2",
        Severity.CRITICAL,
        R.INVESTIGATE,
    ),
    Line(
        "pcieport 0000:00:1c.0: DPC: containment event, status:0x1f01 source:0x4100",
        LINK,
        "0000:00:1c.0",
        Severity.CRITICAL,
        R.INVESTIGATE,
        attributes={"dpc_status": "0x1f01", "source_pci_bus_id": "0000:41:00.0"},
    ),
    Line(
        "pcieport 10000:e0:01.0: DPC: containment event, status:0x000d, ERR_FATAL received "
        "from 10000:e1:00.0",
        LINK,
        "10000:e0:01.0",
        Severity.CRITICAL,
        R.INVESTIGATE,
        attributes={"source_pci_bus_id": "10000:e1:00.0"},
    ),
    Line(
        "pcieport 0000:00:01.0: DPC: containment event, status:0x1f01: unmasked uncorrectable "
        "error detected",
        LINK,
        "0000:00:01.0",
        Severity.CRITICAL,
        R.INVESTIGATE,
    ),
    # drivers/pci/hotplug: pciehp_ctrl.c (4.19 on; pciehp_hpc.c 4.2-4.18, same words), the
    # port service device's name before 5.3, dev_fmt "pciehp: " from 5.3; before 4.2 the older
    # words
    Line(
        "pcieport 0000:00:1c.0: pciehp: Slot(8): Link Down",
        LINK,
        "0000:00:1c.0",
        Severity.WARNING,
        R.INVESTIGATE,
        attributes={"slot": "8"},
    ),
    Line(
        "pcieport 0000:00:1c.0: pciehp: Slot(8): Card not present",
        LINK,
        "0000:00:1c.0",
        Severity.WARNING,
        R.INVESTIGATE,
    ),
    Line(
        "pciehp 0000:00:1c.4:pcie004: Slot(4): Link Down",
        LINK,
        "0000:00:1c.4",
        Severity.WARNING,
        R.INVESTIGATE,
    ),
    Line(
        "pciehp 0000:00:1c.4:pcie04: slot(4): Link Down event",
        LINK,
        "0000:00:1c.4",
        Severity.WARNING,
        R.INVESTIGATE,
    ),
    Line(
        "pciehp 0000:00:1c.4:pcie04: Card not present on Slot(4)",
        LINK,
        "0000:00:1c.4",
        Severity.WARNING,
        R.INVESTIGATE,
    ),
    Line(
        "pcieport 0000:00:1c.0: pciehp: Slot(8): Link Up",
        LINK,
        "0000:00:1c.0",
        Severity.INFO,
        R.NONE,
        (LINK,),
    ),
    Line(
        "pciehp 0000:00:1c.4:pcie04: slot(4): Link Up event",
        LINK,
        "0000:00:1c.4",
        Severity.INFO,
        R.NONE,
        (LINK,),
    ),
    # drivers/pci/pcie/err.c pcie_do_recovery, on the port (`AER: ` from 4.19; `AER: Device`
    # in aerdrv_core.c before): a containment the kernel recovered from, or could not
    Line(
        "pcieport 0000:00:1c.0: AER: device recovery successful",
        LINK,
        "0000:00:1c.0",
        Severity.INFO,
        R.NONE,
        (LINK,),
    ),
    Line(
        "pcieport 0000:00:1c.0: AER: Device recovery successful",
        LINK,
        "0000:00:1c.0",
        Severity.INFO,
        R.NONE,
        (LINK,),
    ),
    Line(
        "pcieport 0000:00:1c.0: AER: device recovery failed",
        LINK,
        "0000:00:1c.0",
        Severity.CRITICAL,
        R.INVESTIGATE,
    ),
    # A NIC's link (netdev_info: `<driver> <bus address> <interface>: ...`): mlx5e_update_carrier,
    # Intel's e1000e, igb (its own name again), ixgbe, i40e, ice, Broadcom's bnxt_en and tg3;
    # drivers/net/bonding/bond_main.c (`(slave %s)` from 4.x, `for interface %s` before)
    Line(
        "mlx5_core 0000:17:00.0 ens1f0np0: Link down",
        NET,
        "ens1f0np0",
        Severity.WARNING,
        R.INVESTIGATE,
        attributes={"driver": "mlx5_core", "pci_address": "0000:17:00.0"},
    ),
    Line(
        "mlx5_core 0000:17:00.0 ens1f0np0: Link up", NET, "ens1f0np0", Severity.INFO, R.NONE, (NET,)
    ),
    Line(
        "ice 0000:31:00.0 ens801f0: NIC Link is Down",
        NET,
        "ens801f0",
        Severity.WARNING,
        R.INVESTIGATE,
    ),
    Line(
        "igb 0000:03:00.0 eno1: igb: eno1 NIC Link is Down",
        NET,
        "eno1",
        Severity.WARNING,
        R.INVESTIGATE,
    ),
    Line(
        "ixgbe 0000:01:00.0 eth0: NIC Link is Up 10 Gbps, Flow Control: RX/TX",
        NET,
        "eth0",
        Severity.INFO,
        R.NONE,
        (NET,),
    ),
    Line(
        "bnxt_en 0000:3b:00.0 ens2f0np0: NIC Link is Up, 100000 Mbps (NRZ) full duplex, Flow "
        "control: none",
        NET,
        "ens2f0np0",
        Severity.INFO,
        R.NONE,
        (NET,),
    ),
    Line("tg3 0000:01:00.0 eno2: Link is down", NET, "eno2", Severity.WARNING, R.INVESTIGATE),
    Line(
        "r8169 0000:02:00.0 enp2s0: Link is Down",
        NET,
        "enp2s0",
        Severity.WARNING,
        R.INVESTIGATE,
        attributes={"driver": "r8169", "pci_address": "0000:02:00.0"},
    ),
    Line(
        "r8169 0000:02:00.0 enp2s0: Link is Up - 1Gbps/Full - flow control rx/tx",
        NET,
        "enp2s0",
        Severity.INFO,
        R.NONE,
        (NET,),
    ),
    Line(
        "tg3 0000:01:00.0 eno2: Link is up at 1000 Mbps, full duplex",
        NET,
        "eno2",
        Severity.INFO,
        R.NONE,
        (NET,),
    ),
    Line(
        "bond0: (slave ens1f1): link status definitely down, disabling slave",
        NET,
        "ens1f1",
        Severity.WARNING,
        R.INVESTIGATE,
        attributes={"bond": "bond0"},
    ),
    Line(
        "bond0: link status definitely down for interface ens1f1, disabling it",
        NET,
        "ens1f1",
        Severity.WARNING,
        R.INVESTIGATE,
    ),
    Line(
        "bond0: (slave ens1f1): link status definitely up, 25000 Mbps full duplex",
        NET,
        "ens1f1",
        Severity.INFO,
        R.NONE,
        (NET,),
    ),
    # net/sched/sch_generic.c dev_watchdog: `%s (%s): transmit queue %u timed out`, in 6.x
    # through netdev_crit as `CPU: %d: transmit queue %u timed out %u ms`
    Line(
        "NETDEV WATCHDOG: ens1f0np0 (mlx5_core): transmit queue 12 timed out 5340 ms",
        NET,
        "ens1f0np0",
        Severity.WARNING,
        R.INVESTIGATE,
        attributes={"driver": "mlx5_core"},
    ),
    Line(
        "ice 0000:b1:00.0 ens801f0np0: NETDEV WATCHDOG: CPU: 38: transmit queue 14 timed out "
        "5376 ms",
        NET,
        "ens801f0np0",
        Severity.WARNING,
        R.INVESTIGATE,
        attributes={"driver": "ice", "tx_queue": 14},
    ),
    Line(
        "NETDEV WATCHDOG: eth0 (e1000e): transmit queue 0 timed out",
        NET,
        "eth0",
        Severity.WARNING,
        R.INVESTIGATE,
    ),
]

QUIET = [
    # what these subsystems also say that is not a fault
    "NFS: Registering the id_resolver key type",
    "nfs4: Deprecated parameter 'intr'",
    "lockd: up and running",
    "CIFS: Attempting to mount \\\\192.168.1.5\\share",
    "rcu: Hierarchical RCU implementation.",
    "rcu: \t(t=21002 jiffies g=12345 q=678 ncpus=64)",
    "rcu: RCU calculated value of scheduler-enlistment delay is 100 jiffies.",
    "therm_throt: CPU0: Thermal monitoring enabled (TM1)",
    "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024",
    "NVRM: has the version 570.133.20, but this kernel module has",
    # DPC's second line before 6.16 follows its containment event: one finding, not two
    "pcieport 0000:00:1c.0: DPC: unmasked uncorrectable error detected",
    "pcieport 0000:00:1c.0: DPC: ERR_FATAL detected",
    "pcieport 0000:00:07.1: DPC: enabled with IRQ 50",
    # DPC recovered the link: pciehp says it let the bounce pass
    "pcieport 0000:00:1c.0: pciehp: Slot(21): Link Down/Up ignored",
    "pcieport 0000:00:1c.0: pciehp: Slot(21) Powering on due to button press",
    "mlx5_core 0000:17:00.0: firmware version: 28.39.1002",
    "mlx5_core 0000:17:00.0 ens1f0np0: renamed from eth0",
    "ice 0000:31:00.0: The DDP package was successfully loaded: ICE OS Default Package",
    "bond0: (slave ens1f1): Enslaving as a backup interface with a down link",
    "IPv6: ADDRCONF(NETDEV_CHANGE): ens1f0np0: link becomes ready",
    # a PCI function's own line names no interface: no name is made up from its address
    "mlx5_core 0000:17:00.0: Link down",
    "ata3: SATA link down (SStatus 0 SControl 300)",
]


def _only(findings: list[Finding]) -> Finding:
    assert len(findings) == 1, [f.to_dict() for f in findings]
    return findings[0]


def assert_line(way: object, line: Line) -> None:
    """`line` read one way (as a record, as `dmesg` lines) is the one finding it names."""
    assert callable(way)
    finding = _only(way(*line.text.split("\n")) if way is scan_dmesg else way(line.text))
    got = (finding.kind, finding.device, finding.severity, finding.repair_action)
    assert got == (line.kind, line.device, line.severity, line.repair)
    assert finding.clears == line.clears
    assert line.kind in KINDS
    assert finding.name and finding.meaning and finding.action
    assert "?" not in finding.meaning, finding.meaning  # every field the text names is read
    if line.device:
        assert line.device in finding.meaning
    as_dict = finding.to_dict()
    for key, expected in line.attributes.items():
        assert as_dict.get(key) == expected, key


def assert_in_shape(shape: str, lines: list[Line]) -> None:
    """The first line of each of `lines` saved as `shape` is the finding it names."""
    for line in lines:
        finding = _only(in_shape(shape, [line.text.split("\n")[0]]))
        got = (finding.kind, finding.device, finding.severity, finding.clears)
        assert got == (line.kind, line.device, line.severity, line.clears), (shape, line.text)


class TestLines:
    @BOTH
    @pytest.mark.parametrize("line", LINES, ids=[line.text[:60] for line in LINES])
    def test_line(self, way: object, line: Line) -> None:
        assert_line(way, line)

    @pytest.mark.parametrize("shape", SHAPES)
    def test_every_line_in_every_saved_shape(self, shape: str) -> None:
        """The first line of each (a `dmesg` line holds no more) as each tool saves it."""
        assert_in_shape(shape, LINES)

    def test_every_all_clear_names_what_it_clears(self) -> None:
        """A line that ends a fault clears the kind it ends, and only an all-clear does."""
        for line in LINES:
            assert (line.severity is Severity.INFO) == bool(line.clears), line.text
            if line.clears:
                assert line.clears == (line.kind,)

    def test_the_whole_mismatch_record_names_both_versions(self) -> None:
        """/dev/kmsg keeps the driver's one printk whole: both versions are read from it."""
        old, new = (line for line in LINES if line.text.startswith("NVRM: API mismatch"))
        first = _only(scan(old.text)).to_dict()
        assert (first["client_version"], first["module_version"]) == ("550.54.15", "535.161.08")
        second = _only(scan(new.text)).to_dict()
        assert (second["client_version"], second["module_version"]) == (
            "570.133.20",
            "575.51.02",
        )

    @pytest.mark.parametrize("shape", SHAPES)
    def test_both_versions_in_every_saved_shape(self, shape: str) -> None:
        """A saved shape splits the driver's printk into lines (indented under the first, or
        not at all with `dmesg -t`): the versions on its further lines are read as from the
        whole record, with the client the first line names."""
        old, new = (line for line in LINES if line.text.startswith("NVRM: API mismatch"))
        for line, versions in (
            (old, ("550.54.15", "535.161.08")),
            (new, ("570.133.20", "575.51.02")),
        ):
            whole = _only(scan(line.text)).to_dict()
            found = _only(in_shape(shape, [line.text]))
            got = found.to_dict()
            assert (got["client_version"], got["module_version"]) == versions, shape
            for key in ("client", "client_pid", "kind", "severity", "repair_action", "name"):
                assert got.get(key) == whole.get(key), (shape, key)
            assert found.record.line == 1

    @BOTH
    @pytest.mark.parametrize("line", QUIET)
    def test_quiet(self, way: object, line: str) -> None:
        assert callable(way)
        assert way(line) == []


# -- through the collector: all-clears and the repeat holdoff ------------------------------------


def _write(device: FakeKmsg, line: str) -> None:
    """A record logged now (the holdoff goes by when a record was logged)."""
    device.write(line, level=5, usec=int(time.monotonic() * 1e6))


def _of(events: list[Event], kind: str) -> list[Event]:
    return [e for e in events if e.kind == kind]


class Flap(NamedTuple):
    case: str
    kind: str
    down: list[str]
    up: list[str]


FLAPS = [
    Flap(
        "a file server that stops answering twice",
        STORAGE,
        ["nfs: server nas01 not responding, still trying"] * 3,
        ["nfs: server nas01 OK"] * 2,
    ),
    Flap(
        "CPUs throttled for heat twice, every CPU of the package saying so",
        THROTTLED,
        [
            f"CPU{n}: Package temperature above threshold, cpu clock throttled (total events = 7)"
            for n in range(8)
        ],
        [f"CPU{n}: Package temperature/speed normal" for n in range(8)],
    ),
    Flap(
        "a NIC whose link goes down twice",
        NET,
        ["mlx5_core 0000:17:00.0 ens1f0np0: Link down"],
        ["mlx5_core 0000:17:00.0 ens1f0np0: Link up"],
    ),
    Flap(
        "a PCIe port that contains an error twice and recovers",
        LINK,
        ["pcieport 0000:00:1c.0: DPC: containment event, status:0x1f01 source:0x4100"],
        ["pcieport 0000:00:1c.0: AER: device recovery successful"],
    ),
    Flap(
        "a NIC cable pulled twice",
        NET,
        ["mlx5_core 0000:3b:00.0: Port module event: module 0, Cable unplugged"],
        ["mlx5_core 0000:3b:00.0: Port module event: module 0, Cable plugged"],
    ),
    Flap(
        "a slot whose link goes down twice",
        LINK,
        ["pcieport 0000:00:1c.0: pciehp: Slot(8): Link Down"],
        ["pcieport 0000:00:1c.0: pciehp: Slot(8): Link Up"],
    ),
]


@pytest.mark.parametrize("rounds", [1, 4], ids=["one round", "a round a line group"])
@pytest.mark.parametrize("flap", FLAPS, ids=[f.case for f in FLAPS])
async def test_a_fault_after_its_all_clear_is_news(
    tmp_path: Path, executor: concurrent.futures.Executor, flap: Flap, rounds: int
) -> None:
    """Down, up, down, up within one repeat holdoff: four events, each fault raised and each
    all-clear clearing it. The repeats inside each group are held back and counted."""
    device = FakeKmsg.with_records([])
    h = Harness(tmp_path, device, executor)
    await h.collect()
    events: list[Event] = []
    samples: list[Sample] = []
    for group in (flap.down, flap.up, flap.down, flap.up):
        for line in group:
            _write(device, line)
        if rounds > 1:
            found, samples = await h.collect()
            events += found
    if rounds == 1:
        events, samples = await h.collect()
    raised = _of(events, flap.kind)
    assert [e.severity is Severity.INFO for e in raised] == [False, True, False, True], [
        e.message for e in raised
    ]
    assert len({e.subject for e in raised}) == 1
    assert all(e.repair_action.required for e in raised[::2])
    assert all(flap.kind in e.clears for e in raised[1::2])
    # What the agent holds: the fault's repair, until its all-clear ends it.
    ledger = RepairLedger(MemoryKeyValueStore())
    held = []
    for event in raised:
        ledger.apply(event)
        held.append([(r.kind, r.subject) for r in ledger.active()])
    subject = raised[0].subject
    assert held == [[(flap.kind, subject)], [], [(flap.kind, subject)], []]
    repeats = 2 * (len(flap.down) - 1 + len(flap.up) - 1)
    suppressed = value(samples, "gpuwarden_kernel_log_suppressed_events_total", kind=flap.kind)
    assert (suppressed or 0) == repeats
    # An all-clear that ends a fault says how often the fault repeated unraised since its
    # event: those repeats are news of no other event.
    assert [e.attributes.get("fault_repeats_held_back") for e in raised[1::2]] == [
        len(flap.down) - 1
    ] * 2
    assert all("fault_repeats_held_back" not in e.attributes for e in raised[::2])


async def test_an_all_clear_for_another_subject_holds_nothing_back(
    tmp_path: Path, executor: concurrent.futures.Executor
) -> None:
    """One server's all-clear says nothing of another's: the other's repeat stays held back."""
    device = FakeKmsg.with_records([])
    h = Harness(tmp_path, device, executor)
    await h.collect()
    for line in (
        "nfs: server nas01 not responding, still trying",
        "nfs: server nas02 not responding, still trying",
        "nfs: server nas02 OK",
        "nfs: server nas01 not responding, still trying",
    ):
        _write(device, line)
    events, _ = await h.collect()
    raised = [(e.subject, e.severity) for e in _of(events, STORAGE)]
    assert raised == [
        ("nas01", Severity.WARNING),
        ("nas02", Severity.WARNING),
        ("nas02", Severity.INFO),
    ]


# -- check and scan judge what the log says now ----------------------------------------------------


def _check_lines(*messages: str) -> list[CheckFinding]:
    return classify_kernel_log(
        KernelLogScan("test", records_read=len(messages), findings=scan(*messages))
    )


@pytest.mark.parametrize("flap", FLAPS, ids=[f.case for f in FLAPS])
def test_check_calls_a_fault_the_log_shows_ended_ok(flap: Flap) -> None:
    """`gpuwarden check` judges a host as it is: a fault its all-clear ended is history (the
    line says so, and counts every line), one raised again after it is current."""
    [ended] = _check_lines(*flap.down, *flap.up)
    assert ended.status is Status.OK, ended.detail
    assert ended.repair_action is RepairAction.NONE
    assert "ended" in ended.detail
    assert ended.data["count"] == len(flap.down) + len(flap.up)
    [again] = _check_lines(*flap.down, *flap.up, *flap.down)
    assert again.status in (Status.WARN, Status.FAIL), again.detail
    assert again.repair_action.required
    [current] = _check_lines(*flap.down)
    assert (current.status, current.repair_action) == (again.status, again.repair_action)


def test_an_all_clear_ends_only_its_own_subject() -> None:
    lines = _check_lines(
        "nfs: server nas01 not responding, still trying",
        "nfs: server nas02 not responding, still trying",
        "nfs: server nas02 OK",
    )
    assert sorted((line.subject, line.status) for line in lines) == [
        ("nas01", Status.WARN),
        ("nas02", Status.OK),
    ]


def test_scan_of_all_clears_alone_exits_clean() -> None:
    """A boot's `Link up` lines are no reason for `gpuwarden scan` to say there are warnings."""
    clears = scan(
        "mlx5_core 0000:17:00.0 ens1f0np0: Link up",
        "pcieport 0000:00:1c.0: AER: device recovery successful",
    )
    assert clears and all(f.severity is Severity.INFO for f in clears)
    assert scan_exit_code(clears) == EXIT_CLEAN
    warning = scan("mlx5_core 0000:17:00.0 ens1f0np0: Link down")
    assert scan_exit_code([*clears, *warning]) == EXIT_WARNINGS
