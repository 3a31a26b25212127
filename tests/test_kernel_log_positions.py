"""Distances between kernel-log records in a saved file that mixes shapes.

A raw /dev/kmsg record is placed by its sequence number, a dmesg or journal line by its line
number (collectors/kernel_log/finding.py `position`). A file can hold both (two captures
pasted together, a kmsg dump with dmesg lines around it), and a sequence number minus a line
number says nothing: a record of the other numbering neither ends nor joins a message held
open for its further lines. Otherwise `gpuwarden scan` (which never feeds a matcher the lines
without its trigger words) and the collector (which feeds it every record) disagree.

Each multi-line matcher gets a pool of its own lines, the other lines its logic must stand,
and noise; the log mixes raw records (sequence numbers close to the line numbers, so that a
difference of the two numberings falls within a matcher's reach) with the other shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.contracts.model import AttributeValue
from agent.program.commands.scan import scan_lines
from collectors.kernel_log.matchers import Finding, MatcherSet
from collectors.kernel_log.parse import ParseStats, parse_lines
from tests.support.klog_shapes import KERNEL_ONLY, Record, render

SXID = "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 11011, "
XID79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=2314, name=python3, GPU has fallen off the bus."
NOISE = (
    "usb 1-1: new high-speed USB device number 2 using xhci_hcd",
    "NVRM: Xid (PCI:0000:3b:00): 13, pid=4411, name=train.py, Graphics SM Warp Exception",
)
# The lines of each message a matcher assembles over several records, or measures the distance
# between (the corpus, tests/fixtures/kernel_log/corpus/, has each in context with its source).
POOLS: dict[str, tuple[str, ...]] = {
    "sxid": (
        SXID + "Fatal, Link 12 ingress request context mismatch (First)",
        SXID + "Severity 5 Engine instance 12 Sub-engine instance 00",
        SXID + "Data {0x00000000, 0x00000001}",
        "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 3 egress credit",
    ),
    "xid79-nearby": (
        XID79,
        "NVRM: GPU at 0000:3b:00.0 has fallen off the bus.",
        "NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.",
    ),
    "fallen-off-bus-three-lines": (
        "NVRM: The NVIDIA GPU 0000:3b:00.0",
        "NVRM: (PCI ID: 10de:2335) installed in this system has",
        "NVRM: fallen off the bus and is not responding to commands.",
        XID79,
    ),
    "oom": (
        "oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,mems_allowed=0-1,"
        "global_oom,task_memcg=/user.slice,task=python3,pid=4321,uid=1000",
        "Out of memory: Killed process 4321 (python3) total-vm:20000kB, anon-rss:1000kB",
    ),
    "oops": (
        "BUG: kernel NULL pointer dereference, address: 0000000000000000",
        "Oops: 0002 [#1] SMP PTI",
    ),
    "mce": (
        "mce: [Hardware Error]: CPU 3: Machine Check: 0 Bank 7: 9c00000000800400",
        "mce: [Hardware Error]: RIP 10:<ffffffff8100a000> {intel_idle+0x5/0x10}",
        "mce: [Hardware Error]: Machine check: Processor context corrupt",
        "mce: [Hardware Error]: Machine check events logged",
    ),
    "cper": (
        "{1}[Hardware Error]: Hardware error from APEI Generic Hardware Error Source: 0",
        "{1}[Hardware Error]: event severity: fatal",
        "{1}[Hardware Error]:   section_type: PCIe error",
    ),
    "beyond-end": (
        "python3: attempt to access beyond end of device",
        "sda1: rw=1, sector=123456, nr_sectors = 8 limit=100000",
    ),
}
# Lines of every matcher in one log: one raw record can hold several matchers' messages.
POOLS["all"] = tuple(line for pool in list(POOLS.values()) for line in pool)
OTHER_SHAPES = sorted(KERNEL_ONLY | {"dmesg-x", "journal-short", "syslog-kern-log"})


@dataclass(frozen=True)
class Entry:
    raw: bool
    shape: str
    message: str


@st.composite
def mixed_logs(draw: st.DrawFn, pool: tuple[str, ...]) -> list[str]:
    """Saved lines: each record raw or in another shape, the raw ones numbered upwards from
    near the start, as one capture numbers them."""
    part = st.sampled_from(pool + NOISE)
    entries = draw(
        st.lists(
            st.builds(
                Entry,
                st.booleans(),
                st.sampled_from(OTHER_SHAPES),
                st.lists(part, min_size=1, max_size=2).map("\n".join),
            ),
            min_size=1,
            max_size=14,
        )
    )
    seq = draw(st.integers(0, 12))
    text = []
    for entry in entries:
        shape = "kmsg" if entry.raw else entry.shape
        text.append(render(shape, Record(entry.message, seq=seq, facility=0)))
        # Mostly the next numbers; now and then a jump past every matcher's reach.
        seq += draw(st.sampled_from((1, 1, 2, 3, 60))) if entry.raw else 0
    return "\n".join(text).split("\n")


def both_ways(lines: list[str]) -> tuple[list[Finding], list[Finding]]:
    """scan's findings (prefiltered lines) and those of every record fed to every matcher."""
    fast = scan_lines(lines, ParseStats())
    full = list(MatcherSet(prefilter=False).scan(parse_lines(lines)))
    return fast, full


def dicts(findings: list[Finding]) -> list[dict[str, AttributeValue]]:
    return [f.to_dict() for f in findings]


class TestMixedNumberings:
    @pytest.mark.parametrize("kind", sorted(POOLS))
    @settings(max_examples=250, deadline=None)
    @given(data=st.data())
    def test_prefilter_finds_what_every_record_fed_finds(
        self, kind: str, data: st.DataObject
    ) -> None:
        """Whatever the mix, scan's prefiltered path finds what the full path finds, and each
        finding stands where its record stands in the file."""
        lines = data.draw(mixed_logs(POOLS[kind]))
        fast, full = both_ways(lines)
        assert dicts(fast) == dicts(full)
        assert dicts(list(MatcherSet().scan(parse_lines(lines)))) == dicts(full)
        assert [f.line for f in full] == sorted(f.line for f in full)


def sxids(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.kind == "sxid"]


class TestExamples:
    def test_a_raw_record_between_an_sxid_and_its_follow_up_does_not_split_them(self) -> None:
        """Hypothesis's case: a raw record (seq 1) after a dmesg SXid header on line 2 read as
        1 - 2 = -1 records away, closed the SXid in the full path only. Another source's record
        between a header and its follow-up is what /dev/kmsg gives live too (another CPU's
        printk): the follow-up belongs to the header."""
        lines = [
            "[    0.000000] " + XID79,
            "               " + SXID + "Fatal, Link 12 ingress request context mismatch (First)",
            "0,1,0,-;" + XID79,
            "[    0.000000] " + SXID + "Severity 5 Engine instance 12 Sub-engine instance 00",
        ]
        fast, full = both_ways(lines)
        assert dicts(fast) == dicts(full)
        [sxid] = sxids(full)
        assert (sxid.line, sxid.attributes["engine_instance"]) == (2, 12)

    def test_a_follow_up_in_the_other_numbering_is_not_joined_by_coincidence(self) -> None:
        """A raw SXid header with seq 1 and a dmesg follow-up on line 2 are 2 - 1 = 1 apart
        only by coincidence: the follow-up stands for its own record."""
        lines = [
            "0,1,0,-;" + SXID + "Fatal, Link 12 ingress request context mismatch (First)",
            "[    0.000000] " + SXID + "Severity 5 Engine instance 12 Sub-engine instance 00",
        ]
        fast, full = both_ways(lines)
        assert dicts(fast) == dicts(full)
        assert [(f.line, "engine_instance" in f.attributes) for f in sxids(full)] == [
            (1, False),
            (2, True),
        ]

    def test_a_fallen_off_bus_block_is_not_claimed_across_numberings(self) -> None:
        """The older drivers' fallen-off-bus line waits for its Xid 79; one in the other
        numbering is not its Xid (2 - 1 looks near): both are reported."""
        lines = [
            "0,1,0,-;NVRM: GPU at 0000:3b:00.0 has fallen off the bus.",
            "[    0.000000] " + XID79,
        ]
        fast, full = both_ways(lines)
        assert dicts(fast) == dicts(full)
        assert [(f.kind, f.line) for f in full] == [("gpu_fallen_off_bus", 1), ("xid", 2)]
        assert "fallen_off_bus_form" not in full[1].attributes

    def test_the_three_line_form_is_not_pieced_together_across_numberings(self) -> None:
        lines = [
            "0,1,0,-;NVRM: The NVIDIA GPU 0000:3b:00.0",
            "[    0.000000] NVRM: (PCI ID: 10de:2335) installed in this system has",
            "[    0.000000] NVRM: fallen off the bus and is not responding to commands.",
        ]
        fast, full = both_ways(lines)
        assert dicts(fast) == dicts(full) == []

    def test_a_line_of_the_other_numbering_does_not_part_the_three_lines(self) -> None:
        """Hypothesis's case: a dmesg line between two raw records of one block (seq 0, 1)
        ended the block in the full path only. It says nothing of what came between them."""
        lines = [
            "[    5.123456] NVRM: The NVIDIA GPU 0000:3b:00.0",
            "4,0,5123456,-;NVRM: The NVIDIA GPU 0000:3b:00.0",
            "[    5.123456] usb 1-1: new high-speed USB device number 2 using xhci_hcd",
            "4,1,5123456,-;NVRM: (PCI ID: 10de:2335) installed in this system has",
            "4,2,5123456,-;NVRM: fallen off the bus and is not responding to commands.",
        ]
        fast, full = both_ways(lines)
        assert dicts(fast) == dicts(full)
        assert [(f.kind, f.line, f.attributes["pci_device_id"]) for f in full] == [
            ("gpu_fallen_off_bus", 2, "10de:2335")
        ]

    def test_an_oom_summary_keeps_its_kill_line_across_a_raw_record(self) -> None:
        """The OOM summary and its kill line in dmesg with a raw record between: one finding
        with the summary's facts; the raw record's numbering does not close it."""
        lines = [
            "[    0.000000] oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,"
            "mems_allowed=0-1,global_oom,task_memcg=/user.slice,task=python3,pid=4321,uid=1000",
            "0,900,0,-;Out of memory: Killed process 77 (bash) total-vm:1kB, anon-rss:1kB",
            "[    0.000000] Out of memory: Killed process 4321 (python3) total-vm:20000kB, "
            "anon-rss:1000kB",
        ]
        fast, full = both_ways(lines)
        assert dicts(fast) == dicts(full)
        assert [(f.line, f.pid, f.attributes.get("memcg")) for f in full] == [
            (2, 77, None),
            (3, 4321, "/user.slice"),
        ]

    def test_findings_of_one_record_come_in_the_matchers_order_in_either_path(self) -> None:
        """One raw record holds an SXid header and a machine check, both held open for their
        further lines. The full path hands both on at the next record; the prefiltered one
        hands each on at the next record of its own matcher: the order must not depend on it."""
        lines = [
            "0,1,0,-;"
            + SXID
            + "Fatal, Link 12 ingress request context mismatch (First)\\x0a"
            + "mce: [Hardware Error]: CPU 3: Machine Check: 0 Bank 7: 9c00000000800400",
            "0,100,0,-;usb 1-1: new high-speed USB device number 2 using xhci_hcd",
            "0,101,0,-;mce: [Hardware Error]: RIP 10:<ffffffff8100a000> {intel_idle+0x5/0x10}",
            "0,102,0,-;nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 12028, Non-fatal, Link 3",
        ]
        fast, full = both_ways(lines)
        assert dicts(fast) == dicts(full)
        assert [(f.kind, f.line) for f in full] == [
            ("sxid", 1),
            ("machine_check", 1),
            ("sxid", 4),
        ]

    def test_findings_come_in_file_order_whatever_the_numbering(self) -> None:
        """A raw record's sequence number (5000) is no place in the file: its finding still
        comes before the dmesg line that follows it."""
        lines = [
            "0,5000,0,-;" + SXID + "Fatal, Link 12 ingress request context mismatch (First)",
            "[    0.000000] NVRM: Xid (PCI:0000:3b:00): 13, pid=4411, name=train.py, Graphics",
        ]
        fast, full = both_ways(lines)
        assert dicts(fast) == dicts(full)
        assert [(f.kind, f.line) for f in full] == [("sxid", 1), ("xid", 2)]
