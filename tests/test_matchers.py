"""Matchers find Xids, SXids, lost GPUs and the host kinds in realistic kernel lines, and nothing
in ordinary ones; user-space lines are counted, not trusted."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.contracts.model import Severity
from collectors.kernel_log.matchers import (
    FallenOffBusMatcher,
    Finding,
    HostMatcher,
    MatcherSet,
    SxidMatcher,
    XidMatcher,
)
from collectors.kernel_log.parse import LogRecord


def records(*messages: str, facility: int | None = None) -> list[LogRecord]:
    return [LogRecord(message=m, line=i, facility=facility) for i, m in enumerate(messages, 1)]


def scan(*messages: str) -> list[Finding]:
    return list(MatcherSet().scan(records(*messages)))


class TestXid:
    """NVRM Xid lines in their variations."""

    @pytest.mark.parametrize(
        ("line", "pci", "code", "pid", "process"),
        [
            (
                "NVRM: Xid (PCI:0000:3b:00): 79, pid=2314, name=python3, GPU has fallen off the bus.",
                "0000:3b:00.0",
                79,
                2314,
                "python3",
            ),
            (
                "NVRM: Xid (0000:86:00): 13, pid=4411, name=train.py, Graphics SM Warp Exception on "
                "(GPC 1, TPC 0, SM 1): Out Of Range Address",
                "0000:86:00.0",
                13,
                4411,
                "train.py",
            ),
            (
                "NVRM: Xid (PCI:0000:C1:00): 94, pid='<unknown>', name=<unknown>, Contained: CE User "
                "Channel (0x9). RST: No, D-RST: No",
                "0000:c1:00.0",
                94,
                None,
                "",
            ),
            (
                "NVRM: Xid (PCI:0001:0a:00): 48, An uncorrectable double bit error (DBE) has been "
                "detected on GPU in the framebuffer at partition 6, subpartition 0.",
                "0001:0a:00.0",
                48,
                None,
                "",
            ),
            (
                "NVRM: Xid (PCI:0000:18:00): 119, pid=1021, name=nvidia-smi, Timeout after 6s of "
                "waiting for RPC response from GPU0 GSP! Expected function 76 (GSP_RM_CONTROL)",
                "0000:18:00.0",
                119,
                1021,
                "nvidia-smi",
            ),
            ("NVRM: Xid (PCI:0000:18:00): 31", "0000:18:00.0", 31, None, ""),
        ],
    )
    def test_variants(self, line: str, pci: str, code: int, pid: int | None, process: str) -> None:
        """PCI: prefix optional, no function number, text varies; the address is normalised."""
        [finding] = XidMatcher().feed(LogRecord(message=line, line=3))
        assert (finding.kind, finding.pci_bus_id, finding.code, finding.pid, finding.process) == (
            "xid",
            pci,
            code,
            pid,
            process,
        )
        assert finding.line == 3
        assert finding.meaning
        assert finding.action

    @pytest.mark.parametrize(
        ("name", "process"),
        [
            ("python3", "python3"),
            ("my trainer", "my trainer"),
            ("pt(worker)", "pt(worker)"),
            ("job,rank0", "job,rank0"),
            ("a,b,c", "a,b,c"),
            ("<unknown>", ""),
        ],
    )
    def test_the_process_name_ends_where_the_driver_ends_it(self, name: str, process: str) -> None:
        """kernel_rc.c writes `pid=%s, name=%s, %s`: the name (a task's comm, which may hold
        spaces, parentheses and commas) ends at the `, ` before the driver's text, the first
        comma of the name does not end it; the text after is the driver's."""
        text = "Ch 00000008, errorString CTX SWITCH TIMEOUT, Info 0x1c003"
        line = f"NVRM: Xid (PCI:0000:3b:00): 109, pid=1234, name={name}, {text}"
        [finding] = XidMatcher().feed(LogRecord(message=line, line=3))
        assert (finding.pid, finding.process) == (1234, process)
        [alone] = XidMatcher().feed(LogRecord(message=f"NVRM: Xid (0000:3b:00): 13, name={name}"))
        assert alone.process == process

    def test_catalog_severity_and_unknown_codes(self) -> None:
        """79 is critical, 13 a warning (application), an unknown code is kept and says so."""
        found = scan(
            "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",
            "NVRM: Xid (PCI:0000:3b:00): 13, Graphics Exception",
            "NVRM: Xid (PCI:0000:3b:00): 4242, something new",
        )
        assert [(f.code, f.severity) for f in found] == [
            (79, Severity.CRITICAL),
            (13, Severity.WARNING),
            (4242, Severity.WARNING),
        ]
        assert found[1].attributes["fault"] == "application"
        assert found[2].attributes["known"] is False
        assert "4242" in found[2].meaning
        assert "catalog" in found[2].meaning


class TestSxid:
    """NVSwitch SXid lines: fatal or not, as the text says."""

    def test_fatal_and_non_fatal(self) -> None:
        """`Fatal` is critical, `Non-fatal` a warning; switch device and PCI address kept."""
        found = scan(
            "nvidia-nvswitch2: SXid (PCI:0000:07:00.0): 20034, Fatal, Link 44 LTSSM Fault Up",
            "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress "
            "non-posted PRIV error (First)",
            "nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 11004, Severity 0 Engine instance 8",
        )
        assert [(f.kind, f.device, f.pci_bus_id, f.code, f.severity) for f in found] == [
            ("sxid", "nvidia-nvswitch2", "0000:07:00.0", 20034, Severity.CRITICAL),
            ("sxid", "nvidia-nvswitch0", "0000:05:00.0", 12028, Severity.WARNING),
            ("sxid", "nvidia-nvswitch1", "0000:06:00.0", 11004, Severity.WARNING),
        ]


THREE_LINES = (
    "NVRM: The NVIDIA GPU 0000:18:00.0",
    "NVRM: (PCI ID: 10de:2335) installed in this system has",
    "NVRM: fallen off the bus and is not responding to commands.",
)


class TestFallenOffBus:
    """GPU fallen off the bus without an Xid line."""

    def test_three_line_form(self) -> None:
        """One finding, at the first line, with the GPU's address and PCI device id."""
        [finding] = scan("usb 1-1: new device", *THREE_LINES)
        assert (finding.kind, finding.pci_bus_id, finding.line, finding.severity) == (
            "gpu_fallen_off_bus",
            "0000:18:00.0",
            2,
            Severity.CRITICAL,
        )
        assert finding.attributes["pci_device_id"] == "10de:2335"

    def test_interrupted_sequence_is_no_finding(self) -> None:
        """Another driver's line between the parts breaks the sequence."""
        assert scan(THREE_LINES[0], "usb 1-1: new device", THREE_LINES[1], THREE_LINES[2]) == []
        assert scan(THREE_LINES[1], THREE_LINES[2]) == []

    def test_one_line_form_alone_and_after_xid_79(self) -> None:
        """Alone it is a finding; right after an Xid 79 for the same GPU it is not repeated."""
        one_line = "NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus."
        [alone] = scan(one_line)
        assert (alone.kind, alone.pci_bus_id) == ("gpu_fallen_off_bus", "0000:3b:00.0")
        after = scan(
            "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus.", one_line
        )
        assert [f.kind for f in after] == ["xid"]
        other_gpu = scan("NVRM: Xid (PCI:0000:86:00): 79, GPU has fallen off the bus.", one_line)
        assert [f.kind for f in other_gpu] == ["xid", "gpu_fallen_off_bus"]

    def test_far_from_its_xid_79_is_reported(self) -> None:
        """Hundreds of records later, a new fall off the bus is a new finding."""
        matcher = FallenOffBusMatcher()
        for record in records(
            "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.", *["filler"] * 200
        ):
            assert list(matcher.feed(record)) == []
        found = list(matcher.feed(LogRecord("NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.")))
        assert len(found) == 1


class TestHostKinds:
    """Disk, file-system, NVMe, OOM and hung-task lines as the kernel writes them."""

    @pytest.mark.parametrize(
        ("line", "kind", "device", "process", "pid"),
        [
            (
                "blk_update_request: I/O error, dev sdb, sector 123456 op 0x1:(WRITE) flags 0x800 "
                "phys_seg 1 prio class 0",
                "io_error",
                "sdb",
                "",
                None,
            ),
            (
                "I/O error, dev nvme0n1, sector 2048 op 0x0:(READ) flags 0x80700 phys_seg 1 prio class 2",
                "io_error",
                "nvme0n1",
                "",
                None,
            ),
            (
                "Buffer I/O error on dev sdc1, logical block 0, async page read",
                "io_error",
                "sdc1",
                "",
                None,
            ),
            (
                "EXT4-fs error (device sdb1): ext4_find_entry:1455: inode #2: comm ls: reading "
                "directory lblock 0",
                "fs_error",
                "sdb1",
                "",
                None,
            ),
            ("EXT4-fs (dm-0): Remounting filesystem read-only", "fs_error", "dm-0", "", None),
            (
                "XFS (nvme1n1p1): Metadata corruption detected at xfs_buf_ioend+0x1a0/0x3d0 [xfs], "
                "xfs_inode block 0x1f0",
                "fs_error",
                "nvme1n1p1",
                "",
                None,
            ),
            ("XFS (md0): log I/O error -5", "fs_error", "md0", "", None),
            (
                "XFS (sdb1): Corruption of in-memory data (0x8) detected at xfs_trans_cancel+0x140/0x150 "
                "[xfs] (fs/xfs/xfs_trans.c:1098).  Shutting down filesystem.",
                "fs_error",
                "sdb1",
                "",
                None,
            ),
            (
                "nvme nvme1: I/O 234 QID 7 timeout, reset controller",
                "nvme_error",
                "nvme1",
                "",
                None,
            ),
            ("nvme nvme0: I/O 17 QID 0 timeout, aborting", "nvme_error", "nvme0", "", None),
            (
                "nvme nvme3: controller is down; will reset: CSTS=0xffffffff, PCI_STATUS=0x10",
                "nvme_error",
                "nvme3",
                "",
                None,
            ),
            (
                "nvme nvme2: Removing after probe failure status: -19",
                "nvme_error",
                "nvme2",
                "",
                None,
            ),
            (
                "Out of memory: Killed process 9876 (python3) total-vm:123456789kB, anon-rss:98765432kB, "
                "file-rss:0kB, shmem-rss:0kB, UID:1000 pgtables:200000kB oom_score_adj:0",
                "oom_kill",
                "",
                "python3",
                9876,
            ),
            (
                "Memory cgroup out of memory: Killed process 4321 (pt_main_thread) total-vm:1kB",
                "oom_kill",
                "",
                "pt_main_thread",
                4321,
            ),
            (
                "Killed process 1234 (java) total-vm:4096kB, anon-rss:2048kB, file-rss:0kB",
                "oom_kill",
                "",
                "java",
                1234,
            ),
            (
                "INFO: task kworker/u64:2:812 blocked for more than 122 seconds.",
                "hung_task",
                "",
                "kworker/u64:2",
                812,
            ),
            (
                "INFO: task python3:55012 blocked for more than 245 seconds.",
                "hung_task",
                "",
                "python3",
                55012,
            ),
        ],
    )
    def test_kind(self, line: str, kind: str, device: str, process: str, pid: int | None) -> None:
        """Kind, device or process and pid come out of the line; meaning names them."""
        [finding] = HostMatcher().feed(LogRecord(message=line))
        assert (finding.kind, finding.device, finding.process, finding.pid) == (
            kind,
            device,
            process,
            pid,
        )
        assert (device or process) in finding.meaning

    def test_hung_task_seconds(self) -> None:
        """The blocked time is kept as a number."""
        [finding] = scan("INFO: task python3:55012 blocked for more than 245 seconds.")
        assert finding.attributes["blocked_seconds"] == 245

    @pytest.mark.parametrize(
        "line",
        [
            "nvme nvme0: 16/0/0 default/read/poll queues",
            "EXT4-fs (sda1): mounted filesystem 1c2d3e4f with ordered data mode. Quota mode: none.",
            "XFS (sdb1): Mounting V5 Filesystem 1c2d3e4f-aaaa-bbbb-cccc-1234567890ab",
            "oom_reaper: reaped process 9876 (python3), now anon-rss:0kB, file-rss:0kB",
            "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  580.159.04",
            "NVRM: GPU at PCI:0000:3b:00: GPU-5b3c1d2e-8f4a-4c6b-9d1e-2a3b4c5d6e7f",
            "nvidia-nvswitch0: using MSI",
            "      Tainted: P           OE      6.8.0-49-generic #49-Ubuntu",
            '"echo 0 > /proc/sys/kernel/hung_task_timeout_secs" disables this message.',
        ],
    )
    def test_ordinary_lines_are_no_findings(self, line: str) -> None:
        """Lines near the findings, which are not findings themselves, produce nothing."""
        assert scan(line) == []


class TestUserSpaceRecords:
    """Lines written from user space (facility >= 1) are not trusted."""

    def test_forged_xid_is_counted_not_found(self) -> None:
        """A fake Xid from user space is no finding; it is counted by kind."""
        matchers = MatcherSet()
        forged = records("NVRM: Xid (PCI:0000:3b:00): 48, pid=1, name=fake, forged", facility=1)
        assert list(matchers.scan(forged)) == []
        assert matchers.ignored == {"xid": 1}

    def test_forged_lines_cannot_complete_a_kernel_sequence(self) -> None:
        """A forged second and third line do not complete the driver's three-line message."""
        matchers = MatcherSet()
        first = LogRecord(THREE_LINES[0], line=1, facility=0)
        forged = [LogRecord(m, line=i, facility=1) for i, m in enumerate(THREE_LINES[1:], 2)]
        assert list(matchers.scan([first, *forged])) == []
        assert matchers.ignored == {}

    def test_records_without_facility_are_taken_as_given(self) -> None:
        """A saved dmesg line carries no facility: it counts."""
        [finding] = MatcherSet().feed(LogRecord("NVRM: Xid (PCI:0000:3b:00): 48, DBE"))
        assert finding.code == 48


_nvrm_like = st.one_of(
    st.text(max_size=200),
    st.builds(
        lambda pci, code, rest: f"NVRM: Xid (PCI:{pci}): {code}, {rest}",
        st.text("0123456789abcdefABCDEF:.", max_size=20),
        st.text("0123456789", max_size=8),
        st.text(max_size=40),
    ),
    st.builds(
        lambda dev, rest: f"nvidia-nvswitch{dev}: SXid (PCI:{rest}",
        st.integers(0, 99),
        st.text(max_size=60),
    ),
    st.sampled_from([*THREE_LINES, "NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus."]),
    st.builds(
        lambda a, b: f"INFO: task {a}:{b} blocked for more than 1 seconds.",
        st.text(max_size=30),
        st.text(max_size=10),
    ),
    st.builds(lambda a: f"Out of memory: Killed process {a}", st.text(max_size=40)),
)


class TestProperties:
    """No input crashes a matcher, in any order or mix of sources."""

    @given(st.lists(st.tuples(_nvrm_like, st.sampled_from([None, 0, 1, 3])), max_size=40))
    def test_matchers_never_crash(self, items: list[tuple[str, int | None]]) -> None:
        """Findings always have a known kind, a severity, a meaning and an action."""
        matchers = MatcherSet()
        recs = [LogRecord(message=m, line=i, facility=f) for i, (m, f) in enumerate(items, 1)]
        for finding in matchers.scan(recs):
            assert finding.kind in {
                "xid",
                "sxid",
                "gpu_fallen_off_bus",
                "io_error",
                "fs_error",
                "nvme_error",
                "oom_kill",
                "hung_task",
            }
            assert finding.meaning
            assert finding.action
            assert isinstance(finding.severity, Severity)
            finding.to_dict()

    @given(st.text(max_size=300))
    def test_each_matcher_alone(self, text: str) -> None:
        """Every matcher takes any single record and a flush."""
        for matcher in (XidMatcher(), SxidMatcher(), FallenOffBusMatcher(), HostMatcher()):
            found = [*matcher.feed(LogRecord(message=text)), *matcher.flush()]
            assert all(isinstance(f, Finding) and f.record.message == text for f in found)
