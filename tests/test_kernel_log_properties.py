"""Properties of the kernel-log parser over every saved shape and every record kind.

A log is generated as a tool would write it (tests/support/klog_shapes.py: raw /dev/kmsg,
dmesg and its -T/-t/-r/-x/iso forms, journalctl -k in its short modes with and without the
host, syslog files), one record of any kind per entry, from the kernel or from a process,
with messages that hold the characters splitlines() would break at and messages of several
lines. Read back through the parser alone, through scan's chunked reader and through the
collector's followed-file reader, it must give the same records; no read raises; every kernel
message is a record, on the line number its `\\n` count says, as trusted as its writer.
"""

from __future__ import annotations

import io
import tempfile
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.contracts.collector import MemoryKeyValueStore
from agent.program.commands.scan import scan_lines
from collectors.kernel_log import lines as line_reader
from collectors.kernel_log.kmsg import FileLogReader
from collectors.kernel_log.matchers import MatcherSet
from collectors.kernel_log.parse import LogRecord, ParseStats, parse_lines
from tests.support.klog_shapes import KERNEL_ONLY, SHAPES, Record, render

# One message of every kind a matcher looks for (and the noise around them), as the kernel
# and the drivers print them: the corpus (tests/fixtures/kernel_log/corpus/) has each in
# context, with its source.
KINDS = (
    "NVRM: Xid (PCI:0000:3b:00): 79, pid=2314, name=python3, GPU has fallen off the bus.",
    "NVRM: Xid (PCI:0000:3b:00 GPU-I:01 GPU-CI:00): 13, pid=4411, name=train.py, Graphics SM "
    "Warp Exception on (GPC 1, TPC 2, SM 0): Out Of Range Address",
    "NVRM: Xid (PCI:0000:3b:00 GPU-I:05): 94, pid=7194, Contained: CE User Channel (0x9).",
    "NVRM: Xid (PCI:0000:02:00): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 00 (0x025001c6 0x0)",
    "NVRM: Xid (PCI:0000:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 "
    "(GPU Reset Required)",
    "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 11011, Fatal, Link 12 ingress request context "
    "mismatch (First)",
    "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 11011, Severity 5 Engine instance 12 Sub-engine "
    "instance 00",
    "NVRM: The NVIDIA GPU 0000:18:00.0",
    "NVRM: (PCI ID: 10de:2335) installed in this system has",
    "NVRM: fallen off the bus and is not responding to commands.",
    "NVRM: GPU at 0000:86:00.0 has fallen off the bus.",
    "oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,mems_allowed=0-1,global_oom,"
    "task_memcg=/user.slice,task=python3,pid=4321,uid=1000",
    "Out of memory: Killed process 612 ((resolved)) total-vm:20000kB, anon-rss:1000kB",
    "Killed process 2491, UID 0, (mysqld) total-vm:2012345kB, anon-rss:1012345kB",
    "md/raid1:md0: Disk failure on sdb1, disabling device.\nmd/raid1:md0: Operation continuing "
    "on 1 devices.",
    "EXT4-fs (sda2): Remounting filesystem read-only",
    "XFS (dm-3): log I/O error -5",
    "BTRFS info (device sde1): forced readonly",
    "block nvme0n1: no available path - failing I/O",
    "blk_update_request: I/O error, dev sdb, sector 2048 op 0x1:(WRITE) flags 0x800",
    "Kernel panic - not syncing: Fatal exception",
    "Oops: 0002 [#1] SMP PTI",
    "watchdog: BUG: soft lockup - CPU#3 stuck for 23s! [python3:4321]",
    "mce: [Hardware Error]: Machine check events logged",
    "INFO: task python3:55012 blocked for more than 245 seconds.",
    "nvidia 0000:41:00.0: AER: PCIe Bus Error: severity=Uncorrected (Fatal), type=Transaction "
    "Layer, (Receiver ID)",
    "nvidia 0000:41:00.0: AER:   device [10de:2335] error status/mask=00000020/00000000",
    "NVRM: GPU 0000:62:00.0: RmInitAdapter failed! (0x24:0x1c:1603)",
    "EDAC MC0: 1 CE memory read error on CPU_SrcID#0_Ha#0_Chan#1_DIMM#0 (channel:1 slot:0)",
    "usb 1-1: new high-speed USB device number 2 using xhci_hcd",
    "IOAPIC[0]: apic_id 0, version 17, address 0xfec00000, GSI 0-23",
    "python3[1234]: segfault at 0 ip 00007f00 sp 00007ffc error 4 in libc.so.6",
)
SEPARATORS = ("\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029")

# Free text in a message: no `[`/`]` (a `host prog[pid]:` look-alike after a monotonic stamp
# is a journal line by design), no NUL (a hole), no newline (a line of its own), no surrogates.
_text = st.text(
    st.one_of(
        st.characters(codec="utf-8", exclude_characters="\n\x00[]"),
        st.sampled_from(SEPARATORS),
    ),
    max_size=60,
)
_part = st.one_of(st.sampled_from(KINDS), _text.map(lambda t: f"msg {t}."))
_message = st.lists(_part, min_size=1, max_size=3).map("\n".join)


@dataclass(frozen=True)
class Entry:
    shape: str
    record: Record


@st.composite
def entries(draw: st.DrawFn) -> Entry:
    shape = draw(st.sampled_from(sorted(SHAPES)))
    message = draw(_message)
    user = shape not in KERNEL_ONLY and draw(st.booleans())
    journal = shape.startswith(("journal", "syslog"))
    record = Record(
        message=message,
        seq=draw(st.integers(0, 2**40)),
        usec=draw(st.integers(0, 10**12)),
        facility=draw(st.integers(1, 3)) if user and not journal else 0,
        level=draw(st.integers(0, 7)),
        pid=draw(st.integers(1, 4_000_000)) if user and journal else None,
    )
    return Entry(shape, record)


def expected(entries: list[Entry]) -> list[tuple[int, str, bool]]:
    """(line, message, from_kernel) of every record the log must give, in order."""
    out = []
    line = 0
    for entry in entries:
        parts = entry.record.message.split("\n")
        if entry.shape == "kmsg":  # the kernel escapes the newline: one line, one record
            line += 1
            out.append((line, entry.record.message, entry.record.from_kernel))
            continue
        trusted = entry.shape == "dmesg-t" or entry.record.from_kernel
        for part in parts:
            line += 1
            out.append((line, part.rstrip("\r"), trusted))
    return out


def as_text(entries: list[Entry]) -> str:
    return "".join(render(e.shape, e.record) + "\n" for e in entries)


def seen(records: list[LogRecord]) -> list[tuple[int, str, bool]]:
    return [(r.line, r.message, r.from_kernel) for r in records]


class TestEveryShapeAndKind:
    @settings(max_examples=300, deadline=None)
    @given(st.lists(entries(), min_size=1, max_size=12))
    def test_every_kernel_message_is_a_record_on_its_line(self, log: list[Entry]) -> None:
        """Parse never raises; each message (each line of a message of several) is a record
        on its own `\\n`-counted line, as trusted as its writer; nothing is malformed."""
        text = as_text(log)
        stats = ParseStats()
        records = list(parse_lines(text.split("\n")[:-1], stats))
        assert seen(records) == expected(log)
        assert (stats.lines, stats.malformed) == (text.count("\n"), 0)
        assert stats.records == len(records)

    @settings(max_examples=150, deadline=None)
    @given(st.lists(entries(), min_size=1, max_size=12), st.integers(1, 97))
    def test_scan_reader_in_any_chunks_reads_the_same(self, log: list[Entry], chunk: int) -> None:
        """scan's reader, in chunks of any size, gives the records the lines give."""
        data = as_text(log).encode()
        records = list(parse_lines(line_reader.iter_lines(io.BytesIO(data), chunk)))
        assert seen(records) == expected(log)

    @settings(max_examples=150, deadline=None)
    @given(st.lists(entries(), min_size=1, max_size=12))
    def test_scan_prefilter_finds_and_ignores_what_parsing_everything_does(
        self, log: list[Entry]
    ) -> None:
        """scan skips lines without a trigger word before parsing; what it finds, and the
        user-space look-alikes it counts, are those of every line parsed and matched."""
        lines = as_text(log).split("\n")[:-1]
        fast = MatcherSet()
        found = scan_lines(lines, ParseStats(), fast)
        full = MatcherSet(prefilter=False)
        expected_findings = list(full.scan(parse_lines(lines)))
        assert [f.to_dict() for f in found] == [f.to_dict() for f in expected_findings]
        assert +fast.ignored == +full.ignored

    @settings(max_examples=60, deadline=None)
    @given(st.lists(entries(), min_size=1, max_size=12), st.integers(0, 300))
    def test_followed_file_in_small_reads_reads_the_same(
        self, log: list[Entry], extra: int
    ) -> None:
        """The collector's reader, with reads just longer than the longest line, gives the
        same records and the same findings, whatever falls at a read's edge."""
        data = as_text(log).encode()
        longest = max(len(line) for line in data.split(b"\n"))
        with (
            tempfile.TemporaryDirectory() as tmp,
            mock.patch("collectors.kernel_log.kmsg.FILE_READ_BYTES", longest + 2 + extra),
        ):
            path = Path(tmp) / "kern.log"
            path.write_bytes(data)
            reader = FileLogReader(path, MemoryKeyValueStore())
            records: list[LogRecord] = []
            while True:
                batch = reader.read()
                reader.commit(batch)
                records += batch.records
                if not batch.more:
                    break
        assert seen(records) == expected(log)
        whole = list(parse_lines(data.decode().split("\n")[:-1]))
        assert records == whole
        assert [f.to_dict() for f in MatcherSet().scan(records)] == [
            f.to_dict() for f in MatcherSet().scan(whole)
        ]


class TestLineReader:
    """The byte-level line reader on any bytes."""

    @settings(max_examples=400, deadline=None)
    @given(
        st.lists(
            st.one_of(st.binary(max_size=40), st.sampled_from([b"\r", b"\x85", "\u2028".encode()])),
            max_size=20,
        ).map(b"".join),
        st.integers(1, 50),
    )
    def test_lines_are_the_newline_split(self, data: bytes, chunk: int) -> None:
        """Lines are exactly `data.split(b"\\n")` (the last one only if not empty), decoded;
        a line over the limit is None, once; any chunk size gives the same."""
        with mock.patch.object(line_reader, "MAX_LINE_BYTES", 24):
            got = list(line_reader.iter_lines(io.BytesIO(data), chunk))
        parts = data.split(b"\n")
        if parts[-1] == b"":
            parts.pop()
        want = [None if len(p) > 24 else p.decode("utf-8", errors="replace") for p in parts]
        assert got == want

    @settings(max_examples=200, deadline=None)
    @given(st.binary(max_size=400), st.integers(0, 30), st.booleans())
    def test_split_consumes_whole_lines(self, data: bytes, cap: int, skipping: bool) -> None:
        """What a split consumes ends at a newline (or is all of a line too long to keep),
        and what it leaves starts a line: a reader that goes on from `consumed` misses
        nothing and reads nothing twice."""
        split = line_reader.split_lines(data, skipping=skipping, max_lines=cap, max_line=16)
        assert len(split.lines) <= cap + 1
        assert split.consumed <= len(data)
        if split.consumed and not split.skipping:
            assert data[split.consumed - 1 : split.consumed] == b"\n"
        if split.skipping:
            assert split.consumed == len(data)
