"""Saved kernel-log shapes parse into one record type; malformed lines are counted, never fatal."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.program.commands.scan import scan_lines
from collectors.kernel_log.matchers import MatcherSet
from collectors.kernel_log.parse import (
    LogRecord,
    MalformedLine,
    ParseStats,
    parse_kmsg_record,
    parse_line,
    parse_lines,
)
from tests.support.klog_shapes import KERNEL_ONLY, SHAPES, Record, render
from tests.support.kmsg import H200_CAPTURE, capture_records, escape_kmsg, kmsg_record

XID = "NVRM: Xid (PCI:0000:3b:00): 79, pid=2314, name=python3, GPU has fallen off the bus."


class TestShapes:
    """Each saved shape gives the message, its stamp and (where the shape has one) the facility."""

    @pytest.mark.parametrize(
        ("line", "fmt", "facility", "level", "stamp"),
        [
            (f"4,1005,11172835,-;{XID}", "kmsg", 0, 4, "11.172835"),
            (f"[   11.172835] {XID}", "dmesg", None, None, "11.172835"),
            (
                f"[Sun Nov 29 17:42:14 2026] {XID}",
                "dmesg-T",
                None,
                None,
                "Sun Nov 29 17:42:14 2026",
            ),
            (
                f"[Mon Nov  9 07:02:04 2026] {XID}",
                "dmesg-T",
                None,
                None,
                "Mon Nov  9 07:02:04 2026",
            ),
            (
                f"kern  :warn  : 2026-11-29T17:42:14,172835+00:00 {XID}",
                "decode+dmesg-iso",
                0,
                4,
                "2026-11-29T17:42:14,172835+00:00",
            ),
            (f"kern  :err   : [   11.172835] {XID}", "decode+dmesg", 0, 3, "11.172835"),
            (
                f"2026-11-29T17:42:14,172835+00:00 {XID}",
                "dmesg-iso",
                None,
                None,
                "2026-11-29T17:42:14,172835+00:00",
            ),
            (f"Nov 29 17:42:14 gpu-host-17 kernel: {XID}", "journal", 0, None, "Nov 29 17:42:14"),
            (
                f"Nov  9 17:42:14.172835 gpu-host-17 kernel: {XID}",
                "journal",
                0,
                None,
                "Nov  9 17:42:14.172835",
            ),
            (
                f"2026-11-29T17:42:14+0000 gpu-host-17 kernel: {XID}",
                "journal",
                0,
                None,
                "2026-11-29T17:42:14+0000",
            ),
            (XID, "plain", None, None, ""),
        ],
    )
    def test_shape(
        self, line: str, fmt: str, facility: int | None, level: int | None, stamp: str
    ) -> None:
        """The message comes out whole whatever the prefix."""
        record = parse_line(line, 7)
        assert record is not None
        assert (record.message, record.format, record.facility, record.level, record.timestamp) == (
            XID,
            fmt,
            facility,
            level,
            stamp,
        )
        assert record.line == 7

    def test_user_space_lines_are_marked(self) -> None:
        """A raw record with facility 1, `user:` in dmesg --decode, a journal ident other than
        `kernel` are not from the kernel."""
        for line in (
            f"14,9,1,-;{XID}",
            f"user  :info  : 2026-11-29T17:42:14,1+00:00 {XID}",
            f"Nov 29 17:42:14 host root[4242]: {XID}",
            f"Nov 29 17:42:14 host logger: {XID}",
            f"2026-11-29T17:42:14+0000 host root[42]: {XID}",
        ):
            record = parse_line(line)
            assert record is not None, line
            assert not record.from_kernel, line

    def test_iso_dmesg_line_is_not_mistaken_for_a_journal_line(self) -> None:
        """`usb 1-1: ...` after an ISO stamp is a dmesg message, not host `usb`, ident `1-1`."""
        record = parse_line("2026-11-29T17:42:14,1+00:00 usb 1-1: new high-speed USB device")
        assert record is not None
        assert (record.format, record.message, record.from_kernel) == (
            "dmesg-iso",
            "usb 1-1: new high-speed USB device",
            True,
        )

    def test_blank_and_banner_lines_are_no_records(self) -> None:
        """Blank lines and journalctl's `-- ... --` banners are neither records nor malformed."""
        assert parse_line("") is None
        assert parse_line("   ") is None
        assert parse_line("-- Boot 0123456789abcdef --") is None
        assert parse_line("-- No entries --") is None

    @pytest.mark.parametrize(
        "line",
        [
            "6,notanumber,17,-;broken",
            "6,,17,-;no sequence number",
            "99999,1,1,-;priority too large",
            "2048,1,1,-;priority too large for a u8 facility",
            "a\x00b",
        ],
    )
    def test_malformed(self, line: str) -> None:
        """Lines that cannot carry a message raise MalformedLine: a raw record without its
        identity (sequence number) or with a priority the kernel cannot write; a NUL byte
        (`parse_lines` cuts lines at NULs first). A broken stamp is not among them: see
        TestUnreadableTimestamps."""
        with pytest.raises(MalformedLine):
            parse_line(line)


class TestKmsgRecord:
    """A raw record as one read() of /dev/kmsg returns it."""

    def test_fields_escapes_and_continuations(self) -> None:
        """Priority splits into facility and level; \\xNN unescapes; KEY=value lines become fields."""
        data = (
            b"14,42,1234567,-;hello\\x09tab \\x5c back\n SUBSYSTEM=pci\n DEVICE=+pci:0000:3b:00.0\n"
        )
        record = parse_kmsg_record(data)
        assert (record.facility, record.level, record.seq, record.monotonic_usec) == (
            1,
            6,
            42,
            1234567,
        )
        assert record.message == "hello\ttab \\ back"
        assert dict(record.fields) == {"SUBSYSTEM": "pci", "DEVICE": "+pci:0000:3b:00.0"}

    def test_h200_capture_parses_whole(self) -> None:
        """Every record of the real H200 capture parses, in sequence order."""
        records = [parse_kmsg_record(r) for r in capture_records()]
        seqs = [r.seq or 0 for r in records]
        assert len(records) > 300
        assert seqs == sorted(seqs)
        assert all(r.facility == 0 for r in records)
        with_fields = [r for r in records if r.fields]
        assert with_fields
        assert all("SUBSYSTEM" in r.fields for r in with_fields)


class TestParseLines:
    """A file of saved lines: continuation lines attach, malformed lines are counted."""

    def test_h200_capture_as_a_file(self) -> None:
        """The capture read as saved lines gives as many records as headers, none malformed."""
        stats = ParseStats()
        lines = H200_CAPTURE.read_text().splitlines()
        records = list(parse_lines(lines, stats))
        headers = [line for line in lines if not line.startswith(" ")]
        assert len(records) == len(headers) == stats.records
        assert stats.malformed == 0
        assert any(r.fields.get("DEVICE") == "+pci:0000:00:00.0" for r in records)

    def test_malformed_lines_are_skipped_and_counted(self) -> None:
        """Parsing goes on after a bad line; its number is kept for the report."""
        stats = ParseStats()
        records = list(parse_lines(["[   1.0] first", "6,x,1,-;bad", "[   2.0] second"], stats))
        assert [r.message for r in records] == ["first", "second"]
        assert (stats.lines, stats.records, stats.malformed) == (3, 2, 1)
        assert stats.malformed_examples[0][0] == 2

    def test_line_numbers_start_where_told(self) -> None:
        """A tail reader continues the numbering of the lines it read before."""
        records = list(parse_lines(["a", "b"], first_line=41))
        assert [r.line for r in records] == [41, 42]


_messages = st.text(st.characters(codec="utf-8", exclude_characters="\n\r"), max_size=120)


class TestProperties:
    """No input crashes the parsers; raw records round-trip."""

    @given(st.text(max_size=300))
    def test_parse_line_raises_only_malformed(self, text: str) -> None:
        """Any text is a record, nothing, or MalformedLine."""
        try:
            record = parse_line(text)
        except MalformedLine:
            return
        assert record is None or isinstance(record, LogRecord)

    @given(st.lists(st.text(max_size=120), max_size=30))
    def test_parse_lines_never_raises(self, lines: list[str]) -> None:
        """Every line is a record, skipped, malformed or a continuation: none is lost. A line
        with NUL bytes (a file-system hole) may hold one message on each side of them."""
        stats = ParseStats()
        records = list(parse_lines(lines, stats))
        assert stats.lines == len(lines)
        pieces = sum(max(1, len([p for p in line.split("\x00") if p.strip()])) for line in lines)
        assert len(records) == stats.records <= pieces - stats.malformed
        assert stats.holes == sum(1 for line in lines if "\x00" in line)

    @given(st.binary(max_size=300))
    def test_parse_kmsg_record_on_any_bytes(self, data: bytes) -> None:
        """Arbitrary bytes from the device give a record or MalformedLine."""
        try:
            record = parse_kmsg_record(data)
        except MalformedLine:
            return
        assert record.seq is not None
        assert record.facility is not None

    @given(
        facility=st.integers(0, 23),
        level=st.integers(0, 7),
        seq=st.integers(0, 2**63),
        usec=st.integers(0, 2**63),
        message=_messages,
    )
    def test_kmsg_round_trip(
        self, facility: int, level: int, seq: int, usec: int, message: str
    ) -> None:
        """What the kernel escapes comes back as written."""
        data = kmsg_record(seq, message, level=level, facility=facility, usec=usec)
        record = parse_kmsg_record(data)
        assert (record.facility, record.level, record.seq, record.monotonic_usec) == (
            facility,
            level,
            seq,
            usec,
        )
        assert record.message == message
        assert escape_kmsg(record.message).isascii()


LIVE = H200_CAPTURE.parent / "h200-live"


class TestRealH200Shapes:
    """The shapes util-linux printed on the real H200 parse whole and agree with the raw records."""

    @pytest.mark.parametrize(
        ("name", "shape"),
        [
            ("kmsg.txt", "kmsg"),
            ("dmesg.txt", "dmesg"),
            ("dmesg-T.txt", "dmesg-T"),
            ("dmesg-iso.txt", "decode+dmesg-iso"),
        ],
    )
    def test_same_messages_in_every_shape(self, name: str, shape: str) -> None:
        """Every line is recognised as its shape, none malformed, same messages as the raw
        records (dmesg prints the unescaped text, the raw records escape it)."""
        raw = list(parse_lines((LIVE / "kmsg.txt").read_text().splitlines()))
        stats = ParseStats()
        records = list(parse_lines((LIVE / name).read_text().splitlines(), stats))
        assert stats.malformed == 0
        assert {r.format for r in records} == {shape}
        assert [r.message.rstrip() for r in records] == [r.message.rstrip() for r in raw]
        nvrm = [r for r in raw if r.message.startswith("NVRM:")]
        assert nvrm
        assert all(r.facility == 0 for r in nvrm)


class TestLinesWithoutHostName:
    """Class 2: `journalctl --no-hostname` and syslog with the host redacted. The identifier
    right after the stamp is the program ("kernel"), never the host, and a driver's own prefix
    ("NVRM:") after the stamp is the driver's message, not a program name."""

    @pytest.mark.parametrize(
        "line",
        [
            f"May 18 19:02:39 kernel: {XID}",
            f"Nov  9 17:42:14.172835 kernel: {XID}",
            f"2026-11-29T17:42:14+0000 kernel: {XID}",
            f"2026-11-29T17:42:14.172835+00:00 kernel: {XID}",
            f"Sun 2026-11-29 17:42:14 UTC kernel: {XID}",
            f"[   11.172835] kernel: {XID}",
            f"1764438134.172835 kernel: {XID}",
            f"Sun 2026-11-29 17:42:14 UTC gpu-host-17 kernel: {XID}",
            f"[   11.172835] gpu-host-17 kernel: {XID}",
            f"1764438134.172835 gpu-host-17 kernel: {XID}",
            f"Jun 17 02:44:10 gpu-host-17 kernel: [ 4007.321459] {XID}",
            f"May 18 19:02:39 kernel: [ 4007.321459] {XID}",
        ],
    )
    def test_kernel_line_is_the_kernels_message(self, line: str) -> None:
        """Host or not, every journal/syslog output mode: the message is the driver's line,
        marked as the kernel's (rsyslog's kern.log keeps the kernel's own stamp in the text)."""
        record = parse_line(line, 3)
        assert record is not None
        assert (record.message, record.facility, record.from_kernel) == (XID, 0, True)

    @pytest.mark.parametrize(
        "line",
        [
            f"May 18 19:02:39 {XID}",
            f"May 18 19:02:39 gpu-host-17 {XID}",
            "May 18 19:02:39 nvidia-nvswitch3: SXid (PCI:0000:c7:00.0): 20034, Fatal, Link 44",
        ],
    )
    def test_driver_prefix_is_not_a_program_name(self, line: str) -> None:
        """With the `kernel:` tag lost, `NVRM:` (or the NVSwitch driver's prefix) still starts
        the message; such a line is taken as given, like a bare dmesg line."""
        record = parse_line(line)
        assert record is not None
        message = line.split(" ", 3)[3]
        if message.startswith("gpu-host-17 "):
            message = message.split(" ", 1)[1]
        assert (record.message, record.from_kernel) == (message, True)

    @pytest.mark.parametrize(
        "line",
        [
            f"May 18 19:02:39 python3[4242]: {XID}",
            f"May 18 19:02:39 logger: {XID}",
            f"2026-11-29T17:42:14+0000 root[42]: {XID}",
            f"May 18 19:02:39 gpu-host-17 kernel[42]: {XID}",
        ],
    )
    def test_user_space_line_without_host_is_counted_not_trusted(self, line: str) -> None:
        """A program's line is a record, not from the kernel, and keeps the driver's words, so
        the matchers count it as ignored instead of losing it (`kernel[pid]` is `logger -t
        kernel --id`: the kernel's lines never carry a pid)."""
        record = parse_line(line)
        assert record is not None
        assert (record.message, record.from_kernel) == (XID, False)
        matchers = MatcherSet()
        assert matchers.feed(record) == []
        assert matchers.ignored["xid"] == 1


# A central syslog server writes the sender's address where it has no name for it
# (syslog-ng's default keep-hostname(no) with use-dns(no), rsyslog without DNS for a message
# that named no host): on an IPv6 network the host holds colons.
ADDRESS_HOSTS = ["2001:db8::5", "fe80::1%eth0", "::1", "2001:db8:0:1:2:3:4:a", "::ffff:10.0.0.5"]
ADDRESS_STAMPS = [
    "Nov 29 18:10:02",
    "Nov  9 18:10:02.123456",
    "2026-11-29T18:10:02.123456+00:00",
    "Sun 2026-11-29 18:10:02 UTC",
]


class TestAddressHosts:
    """A host named by its IPv6 address is a host: the kernel's lines stay the kernel's (their
    Xids raised, not counted as a program's), a program's stay a program's."""

    @pytest.mark.parametrize("stamp", ADDRESS_STAMPS)
    @pytest.mark.parametrize("host", ADDRESS_HOSTS)
    def test_kernel_line(self, stamp: str, host: str) -> None:
        for line in (
            f"{stamp} {host} kernel: {XID}",
            f"{stamp} {host} kernel: [ 4007.321459] {XID}",
        ):
            record = parse_line(line)
            assert record is not None
            assert (record.message, record.facility, record.timestamp) == (XID, 0, stamp), line
            assert len(MatcherSet().feed(record)) == 1

    @pytest.mark.parametrize("stamp", ADDRESS_STAMPS)
    @pytest.mark.parametrize("host", ADDRESS_HOSTS)
    def test_a_programs_line(self, stamp: str, host: str) -> None:
        for line in (f"{stamp} {host} python3[4242]: {XID}", f"{stamp} {host} kernel[42]: {XID}"):
            record = parse_line(line)
            assert record is not None
            assert (record.message, record.from_kernel) == (XID, False), line


class TestByteOrderMarkInside:
    """A byte-order mark at the start of a line inside a file (logs joined with `cat`, the
    second written by a tool that starts its files with one): the line reads as without it,
    in every shape, and a program's line stays a program's."""

    @pytest.mark.parametrize("shape", SHAPES)
    def test_every_shape(self, shape: str) -> None:
        for record in (Record(XID), Record(XID, facility=1, pid=42)):
            if shape in KERNEL_ONLY and not record.from_kernel:
                continue
            text = render(shape, record)
            plain, marked = parse_line(text), parse_line("\ufeff" + text)
            assert marked == plain, shape
            assert plain is not None and plain.from_kernel is record.from_kernel, shape


class TestUnreadableTimestamps:
    """Class 3: a stamp that cannot be read is a missing stamp; the message is still a message."""

    @pytest.mark.parametrize(
        "line",
        [
            f"[123] {XID}",
            f"[  240.] {XID}",
            f"[  .5] {XID}",
            f"[ 12:30] {XID}",
            f"[Sun Nov 29 17:42 2026] {XID}",
            f"[Sun Nov 29 17:42:14] {XID}",
            f"kern  :err   : [123] {XID}",
            f"<4>[  240.] {XID}",
            f"4,1005,,-;{XID}",
            f"4,1005,12.5,-;{XID}",
        ],
    )
    def test_message_survives_a_broken_stamp(self, line: str) -> None:
        """The record carries the message whole, no timestamp, and says the stamp was bad."""
        stats = ParseStats()
        [record] = list(parse_lines([line], stats))
        assert (record.message, record.timestamp, record.monotonic_usec) == (XID, "", None)
        assert record.unreadable_timestamp
        assert (stats.records, stats.malformed, stats.bad_timestamps) == (1, 0, 1)

    @pytest.mark.parametrize(
        "line", [f"[   17.5 {XID}", f"[Sun Nov 29 17:42 {XID}", f"[  +0.5 <1.0 {XID}"]
    )
    def test_unclosed_stamp_keeps_the_whole_line(self, line: str) -> None:
        """No `]`: nothing says where the stamp ends, so the line is the message."""
        stats = ParseStats()
        [record] = list(parse_lines([line], stats))
        assert record.message == line
        assert (stats.malformed, stats.bad_timestamps) == (0, 1)

    @pytest.mark.parametrize(
        ("line", "stamp"),
        [
            (f"[   12.345678 <    0.000012>] {XID}", "12.345678 <    0.000012>"),
            (f"[<    0.000012>] {XID}", "<    0.000012>"),
            (f"[  +0.000123] {XID}", "+0.000123"),
            (f"[Nov29 18:10] {XID}", "Nov29 18:10"),
            (
                f"[Sun Nov 29 17:42:14 2026 <    0.000012>] {XID}",
                "Sun Nov 29 17:42:14 2026 <    0.000012>",
            ),
        ],
    )
    def test_other_dmesg_stamps_are_read(self, line: str, stamp: str) -> None:
        """`dmesg -d`, `-e` and `-T -d` stamps are stamps, not damage."""
        stats = ParseStats()
        [record] = list(parse_lines([line], stats))
        assert (record.message, record.timestamp, stats.bad_timestamps) == (XID, stamp, 0)

    @pytest.mark.parametrize(
        ("line", "stamp"),
        [
            (f"[  123.456000                ] gpu1 kernel: {XID}", "123.456000"),
            (f"[  123.456790 <    0.000790 >] gpu1 kernel: {XID}", "123.456790 <    0.000790 >"),
        ],
    )
    def test_journal_short_delta_stamps_are_read(self, line: str, stamp: str) -> None:
        """`journalctl -o short-delta` pads its first stamp and spaces its `>`."""
        stats = ParseStats()
        [record] = list(parse_lines([line], stats))
        assert (record.message, record.timestamp, record.facility) == (XID, stamp, 0)
        assert stats.bad_timestamps == 0

    @pytest.mark.parametrize("line", ["[drm] Initialized nvidia-drm 0.0.0", "[Firmware Bug]: TSC"])
    def test_bracketed_words_are_messages(self, line: str) -> None:
        """A message that starts with `[word]` has no stamp to be broken."""
        stats = ParseStats()
        [record] = list(parse_lines([line], stats))
        assert (record.message, stats.bad_timestamps) == (line, 0)

    def test_printk_caller_id_is_not_part_of_the_message(self) -> None:
        """CONFIG_PRINTK_CALLER adds `[  T1234]` after the stamp; the message follows it."""
        record = parse_line(f"[10163.739261] [   T9326] {XID}")
        assert record is not None
        assert (record.message, record.timestamp) == (XID, "10163.739261")


# util-linux dmesg.c `print_record` writes the caller id (`[%*s] `, CONFIG_PRINTK_CALLER) after
# whatever stamp the time format gives, none included; the kernel's syslog(2) text (/proc/kmsg,
# what rsyslog's imklog reads into kern.log) puts it after the printk time, or alone.
CALLERS = ["[  T1234] ", "[     C4] ", "[T4194304] "]
CALLER_SHAPES = {
    "dmesg": "[ 5123.456789] {caller}{message}",
    "dmesg -T": "[Sun Nov 29 18:10:02 2026] {caller}{message}",
    "dmesg -t": "{caller}{message}",
    "dmesg -r": "<4>[ 5123.456789] {caller}{message}",
    "dmesg -r -t": "<4>{caller}{message}",
    "dmesg -x": "kern  :warn  : [ 5123.456789] {caller}{message}",
    "dmesg -x -t": "kern  :warn  : {caller}{message}",
    "dmesg --time-format iso": "2026-11-29T18:10:02,123456+00:00 {caller}{message}",
    "dmesg -x --time-format iso": "kern  :warn  : 2026-11-29T18:10:02,123456+00:00 {caller}{message}",
    "kern.log": "Nov 29 18:10:02 gpu-host-17 kernel: [ 5123.456789] {caller}{message}",
    "kern.log without printk time": "Nov 29 18:10:02 gpu-host-17 kernel: {caller}{message}",
    "kern.log RFC 3339": (
        "2026-11-29T18:10:02.123456+00:00 gpu-host-17 kernel: [ 5123.456789] {caller}{message}"
    ),
}
# Messages that patterns read from their first character: the caller id must not stay in front.
CALLER_MESSAGES = [
    XID,
    "python3[4242]: segfault at 0 ip 00007f0000001234 sp 00007ffc00000000 error 4 in "
    "libcuda.so.1[7f0000000000+1000000]",
    "traps: python3[4242] general protection fault ip:7f0000001234 sp:7ffc00000000 error:0 in "
    "libc.so.6[7f0000000000+1000]",
    "nfs: server nas01 not responding, still trying",
    "Clocksource tsc unstable (delta = -123456789 ns)",
]


class TestPrintkCaller:
    """A kernel built with CONFIG_PRINTK_CALLER: every saved shape gives the message the raw
    record gives (its caller id is in the header there, `,caller=T1234;`), and the same
    findings."""

    @pytest.mark.parametrize("caller", CALLERS)
    @pytest.mark.parametrize("shape", CALLER_SHAPES)
    @pytest.mark.parametrize("message", CALLER_MESSAGES, ids=[m[:24] for m in CALLER_MESSAGES])
    def test_the_message_and_findings_are_the_raw_records(
        self, shape: str, caller: str, message: str
    ) -> None:
        raw = parse_line(f"4,1005,5123456789,-,caller={caller.strip(' []')};{message}")
        saved = parse_line(CALLER_SHAPES[shape].format(caller=caller, message=message))
        assert raw is not None and saved is not None
        assert saved.message == raw.message == message, shape
        assert saved.from_kernel
        live = [(f.kind, f.device, f.pid, f.process) for f in MatcherSet().scan([raw])]
        read = [(f.kind, f.device, f.pid, f.process) for f in MatcherSet().scan([saved])]
        assert read == live != []


# RFC 5424 (the syslog protocol) as a file holds it: rsyslog's RSYSLOG_SyslogProtocol23Format
# (`<%PRI%>1 %TIMESTAMP:::date-rfc3339% %HOSTNAME% %APP-NAME% %PROCID% %MSGID%
# %STRUCTURED-DATA% %msg%`), syslog-ng's syslog-protocol files, a collector's archive (with or
# without the `<PRI>`). `-` is the nil value; structured data is `-` or `[id key="value"]...`
# (`\]` escaped inside a value); the message may start with a byte-order mark. The kernel's
# records are APP-NAME `kernel` with no PROCID (rsyslog's imklog; the kernel's own stamp may
# stay in the text, as in kern.log).
SYSLOG_PROTOCOL_KERNEL = [
    "<4>1 2026-11-29T18:10:02.123456+00:00 gpu-host-17 kernel - - - {message}",
    '<4>1 2026-11-29T18:10:02Z gpu-host-17 kernel - - [timeQuality tzKnown="1" isSynced="1"] '
    "{message}",
    "<4>1 2026-11-29T18:10:02.123+01:00 gpu-host-17 kernel - - - \ufeff{message}",
    "1 2026-11-29T18:10:02.123456+00:00 gpu-host-17 kernel - - - {message}",
    "<4>1 - - kernel - - - {message}",
    '<4>1 2026-11-29T18:10:02.123456+00:00 gpu-host-17 kernel - - [meta note="a \\] b"][x@1 y="2"] '
    "{message}",
    "<4>1 2026-11-29T18:10:02.123456+00:00 gpu-host-17 kernel - - - [ 5123.456789] {message}",
]
SYSLOG_PROTOCOL_USER = [
    "<14>1 2026-11-29T18:10:02.123456+00:00 gpu-host-17 python3 4242 - - {message}",
    "1 2026-11-29T18:10:02.123456+00:00 gpu-host-17 python3 4242 - - {message}",
    "1 2026-11-29T18:10:02.123456+00:00 gpu-host-17 kernel 4242 - - {message}",
    "1 2026-11-29T18:10:02.123456+00:00 gpu-host-17 nvidia-smi - - - {message}",
]
SYSLOG_PROTOCOL_MESSAGES = [
    XID,
    "python3[4242]: segfault at 0 ip 00007f0000001234 sp 00007ffc00000000 error 4 in "
    "libcuda.so.1[7f0000000000+1000000]",
]


class TestSyslogProtocol:
    """RFC 5424 lines: the kernel's give the message and findings the raw record gives; a
    program's are not trusted, with or without the `<PRI>` that says so."""

    @pytest.mark.parametrize("shape", SYSLOG_PROTOCOL_KERNEL)
    @pytest.mark.parametrize("message", SYSLOG_PROTOCOL_MESSAGES, ids=["xid", "segfault"])
    def test_kernel_line(self, shape: str, message: str) -> None:
        raw = parse_line(f"4,1005,5123456789,-;{message}")
        saved = parse_line(shape.format(message=message))
        assert raw is not None and saved is not None
        assert (saved.message, saved.from_kernel) == (message, True)
        assert saved.timestamp == ("" if " - - kernel" in shape else shape.split(" ")[1])
        live = [(f.kind, f.code, f.pid, f.process) for f in MatcherSet().scan([raw])]
        read = [(f.kind, f.code, f.pid, f.process) for f in MatcherSet().scan([saved])]
        assert read == live != []

    @pytest.mark.parametrize("shape", SYSLOG_PROTOCOL_USER)
    @pytest.mark.parametrize("message", SYSLOG_PROTOCOL_MESSAGES, ids=["xid", "segfault"])
    def test_a_programs_line_is_counted_not_trusted(self, shape: str, message: str) -> None:
        saved = parse_line(shape.format(message=message))
        assert saved is not None
        assert (saved.message, saved.from_kernel) == (message, False)
        matchers = MatcherSet()
        assert matchers.feed(saved) == []
        assert sum(matchers.ignored.values()) == 1


# Coloured output saved to a file (`dmesg --color=always`, `dmesg -H`, a terminal's log of
# `journalctl -k`): util-linux dmesg.c `print_record` colours the stamp (green, bold green at a
# time break), the message's subsystem prefix up to its `: ` (`get_subsys_delimiter`; older
# versions up to the colon alone) and the rest by level (`set_level_color`: bold for warn, red
# for err); journalctl colours the message by priority (`\x1b[0;1;31m` for err and worse).
_ESC = "\x1b"
_OFF = f"{_ESC}[0m"


def _dmesg_coloured(stamp: str, message: str, *, old: bool = False, lead: str = "") -> str:
    subsys, colon, rest = message.partition(": ")
    head = f"{_ESC}[33m{subsys}:{_OFF} " if old else f"{_ESC}[33m{subsys}: {_OFF}"
    if not colon or " " in subsys:  # no prefix: the whole message in its level's colour
        head, rest = "", message
    return f"{lead}{_ESC}[32m{stamp} {_OFF}{head}{_ESC}[1m{rest}{_OFF}"


COLOURED_SHAPES = {
    "dmesg": lambda m: _dmesg_coloured("[ 5123.456789]", m),
    "dmesg, older subsystem colour": lambda m: _dmesg_coloured("[ 5123.456789]", m, old=True),
    "dmesg -T": lambda m: _dmesg_coloured("[Sun Nov 29 18:10:02 2026]", m),
    "dmesg -H": lambda m: _dmesg_coloured("[Nov29 18:10]", m).replace("[32m", "[1;32m", 1),
    "dmesg -x": lambda m: _dmesg_coloured("[ 5123.456789]", m, lead="kern  :warn  : "),
    "journalctl -k": lambda m: f"Nov 29 18:10:02 gpu-host-17 kernel: {_ESC}[0;1;31m{m}{_OFF}",
}
COLOURED_MESSAGES = [
    XID,
    "python3[4242]: segfault at 0 ip 00007f0000001234 sp 00007ffc00000000 error 4 in "
    "libcuda.so.1[7f0000000000+1000000]",
    "nfs: server nas01 not responding, still trying",
    "nvme nvme0: I/O 123 QID 4 timeout, aborting",
]


class TestColouredOutput:
    """A saved log with the terminal's colours in it reads as the raw record: the same
    message, stamp and findings, through `gpuwarden scan`'s path (whose prefilter looks at
    the line before it is parsed)."""

    @pytest.mark.parametrize("shape", COLOURED_SHAPES)
    @pytest.mark.parametrize("message", COLOURED_MESSAGES, ids=[m[:20] for m in COLOURED_MESSAGES])
    def test_the_message_and_findings_are_the_raw_records(self, shape: str, message: str) -> None:
        raw = parse_line(f"4,1005,5123456789,-;{message}")
        line = COLOURED_SHAPES[shape](message)
        saved = parse_line(line)
        assert raw is not None and saved is not None
        assert _ESC not in saved.message and _ESC not in saved.timestamp
        assert saved.message == raw.message, shape
        live = [(f.kind, f.code, f.device, f.pid) for f in MatcherSet().scan([raw])]
        read = [(f.kind, f.code, f.device, f.pid) for f in scan_lines([line + "\n"])]
        assert read == live != []


# Stamps as dmesg and journalctl write them in the reader's locale: dmesg -T `%a %b %e
# %H:%M:%S %Y`, dmesg -e/-H `%b%e %H:%M` (the day space-padded: `Dec 1`), journalctl short
# `%b %d %H:%M:%S` (short-precise with `.%06u`, short-full `%a %Y-%m-%d %H:%M:%S %Z`), each
# through strftime after setlocale(LC_ALL, ""). The month and day names below are glibc's
# (de_DE, fr_FR, es_ES, ru_RU: `Mär`, `déc.`, `mié`, `дек`).
LOCAL_STAMPS = [
    ("[Dec 1 18:10] {message}", "Dec 1 18:10"),
    ("[Nov 9 08:05] {message}", "Nov 9 08:05"),
    ("[Dez 1 18:10] {message}", "Dez 1 18:10"),
    ("[déc.29 18:10] {message}", "déc.29 18:10"),
    ("[Di Dez  1 18:10:02 2026] {message}", "Di Dez  1 18:10:02 2026"),
    ("[mar. déc.  1 18:10:02 2026] {message}", "mar. déc.  1 18:10:02 2026"),
    ("[mié dic  2 18:10:02 2026] {message}", "mié dic  2 18:10:02 2026"),
    ("[Вт дек  1 18:10:02 2026] {message}", "Вт дек  1 18:10:02 2026"),
    ("Mär 01 18:10:02 gpu-host-17 kernel: {message}", "Mär 01 18:10:02"),
    ("déc. 01 18:10:02 gpu-host-17 kernel: {message}", "déc. 01 18:10:02"),
    ("févr. 28 18:10:02.123456 gpu-host-17 kernel: {message}", "févr. 28 18:10:02.123456"),
    ("дек 01 18:10:02 kernel: {message}", "дек 01 18:10:02"),
    ("Di 2026-12-01 18:10:02 CET gpu-host-17 kernel: {message}", "Di 2026-12-01 18:10:02 CET"),
    ("mar. 2026-12-01 18:10:02 CET gpu-host-17 kernel: {message}", "mar. 2026-12-01 18:10:02 CET"),
]
LOCAL_PROGRAM_LINES = [
    "Mär 01 18:10:02 gpu-host-17 python3[42]: {message}",
    "déc. 01 18:10:02 gpu-host-17 python3[42]: {message}",
    "дек 01 18:10:02 python3[42]: {message}",
    "mar. 2026-12-01 18:10:02 CET gpu-host-17 python3[42]: {message}",
]
# The CJK locales' journal stamps as glibc writes them (zh_CN, ja_JP, ko_KR abmon and abday,
# checked against `date` in tests/test_kernel_log_file_time.py): `%b` is the month's number
# and 月 or 월, which ja_JP and ko_KR pad to two with a space (` 1月`, so the line starts with
# one), `%a` one wide character. journalctl short `%b %d %H:%M:%S`, short-precise `.%06u`
# after it, short-full `%a %Y-%m-%d %H:%M:%S %Z` (systemd 252 writes its day in English
# whatever the locale, `Thu`; the locale's day is read too). 2026-12-03 is a Thursday.
CJK_NAMES = {
    "zh_CN": ("1月", "12月", "四"),
    "ja_JP": (" 1月", "12月", "木"),
    "ko_KR": (" 1월", "12월", "목"),
}
CJK_STAMPS = [
    stamp
    for jan, dec, day in CJK_NAMES.values()
    for stamp in (
        f"{jan} 03 18:10:02",
        f"{dec} 03 18:10:02",
        f"{jan} 03 18:10:02.123456",
        f"{dec} 03 18:10:02.123456",
        f"{day} 2026-12-03 18:10:02 JST",
    )
]
CJK_KERNEL_LINES = [
    (f"{stamp}{host} kernel: {{message}}", stamp)
    for stamp in CJK_STAMPS
    for host in (" gpu-host-17", "")  # --no-hostname
]
CJK_PROGRAM_LINES = [
    f"{stamp}{host} python3[42]: {{message}}" for stamp in CJK_STAMPS for host in (" gpu-1", "")
]
# Those that start with the padding space, kernel's and program's.
CJK_PADDED_LINES = [
    (f"{stamp}{host} {ident}: {{message}}", stamp, ident == "kernel")
    for stamp in CJK_STAMPS
    if stamp[0] == " "
    for host in (" gpu-host-17", "")
    for ident in ("kernel", "python3[42]")
]
LOCAL_STAMPS += CJK_KERNEL_LINES
LOCAL_PROGRAM_LINES += CJK_PROGRAM_LINES
LOCAL_MESSAGES = [XID, "nfs: server nas01 not responding, still trying"]


class TestLocalisedStamps:
    """A stamp in any locale's words, and dmesg's reltime stamp on days 1 to 9, is a stamp:
    the message and findings are the raw record's, and a program's line stays a program's."""

    @pytest.mark.parametrize(("shape", "stamp"), LOCAL_STAMPS)
    @pytest.mark.parametrize("message", LOCAL_MESSAGES, ids=["xid", "nfs"])
    def test_kernel_line(self, shape: str, stamp: str, message: str) -> None:
        raw = parse_line(f"4,1005,5123456789,-;{message}")
        stats = ParseStats()
        [saved] = list(parse_lines([shape.format(message=message)], stats))
        assert raw is not None
        assert (saved.message, saved.timestamp, stats.bad_timestamps) == (message, stamp, 0)
        assert saved.from_kernel
        live = [(f.kind, f.code, f.device, f.pid) for f in MatcherSet().scan([raw])]
        read = [(f.kind, f.code, f.device, f.pid) for f in MatcherSet().scan([saved])]
        assert read == live != []

    @pytest.mark.parametrize("shape", LOCAL_PROGRAM_LINES)
    def test_a_programs_line_is_counted_not_trusted(self, shape: str) -> None:
        saved = parse_line(shape.format(message=XID))
        assert saved is not None
        assert (saved.message, saved.from_kernel) == (XID, False)
        matchers = MatcherSet()
        assert matchers.feed(saved) == []
        assert matchers.ignored["xid"] == 1

    @pytest.mark.parametrize(("shape", "stamp", "kernel"), CJK_PADDED_LINES)
    @pytest.mark.parametrize(
        "before",
        [
            "Nov 29 17:42:14 gpu-host-17 python3[42]: hello",
            "Nov 29 17:42:14 gpu-host-17 kernel: hello",
            "12月 02 17:42:14 gpu-host-17 kernel: hello",
        ],
    )
    def test_a_month_padded_with_a_space_starts_a_record(
        self, shape: str, stamp: str, kernel: bool, before: str
    ) -> None:
        """ja_JP's and ko_KR's ` 1月` starts the line with a space, as a further line of the
        record before it is indented: the line is a record of its own, with its own stamp and
        trust, read alone, after another record, and through `gpuwarden scan`'s path."""
        line = shape.format(message=XID)
        stats = ParseStats()
        records = list(parse_lines([before, line], stats))
        assert [(r.line, r.message, r.timestamp, r.from_kernel) for r in records[1:]] == [
            (2, XID, stamp, kernel)
        ]
        assert (stats.records, stats.bad_timestamps) == (2, 0)
        assert [f.kind for f in scan_lines([before + "\n", line + "\n"])] == (
            ["xid"] if kernel else []
        )


class TestForgedLines:
    """Class 9: what user space wrote into the kernel log, saved by `dmesg -r`, `dmesg -x`, the
    journal or as raw records, is counted and never trusted."""

    @pytest.mark.parametrize(
        "line",
        [
            f"[  123.456789] gpu1 forger: {XID}",
            f"[  123.456789] forger: {XID}",
            f"[  123.456000                ] gpu1 forger: {XID}",
            f"1764650000.123456 gpu1 forger: {XID}",
        ],
    )
    def test_a_program_quoting_the_driver_after_a_monotonic_stamp(self, line: str) -> None:
        """journalctl -o short-monotonic (-delta, -unix) writes a program's line that has no
        pid as `host program: ...`: when it quotes the driver it is the program's, not the
        kernel's (which starts with the driver's prefix)."""
        record = parse_line(line)
        assert record is not None
        assert (record.message, record.facility) == (XID, 1)

    @pytest.mark.parametrize(
        "line",
        [
            f"[  123.456789] {XID}",
            "[  123.456789] nvidia-nvswitch2: SXid (PCI:0000:07:00.0): 20034, Fatal",
            "[  123.456789] nvidia-modeset: Loading NVIDIA Kernel Mode Setting Driver",
            "[  123.456789] usb 1-1: new high-speed USB device number 2 using xhci_hcd",
        ],
    )
    def test_the_drivers_own_lines_after_a_monotonic_stamp_stay_the_kernels(
        self, line: str
    ) -> None:
        record = parse_line(line)
        assert record is not None
        assert record.facility is None  # a dmesg line: taken as given
        assert record.message == line.split("] ", 1)[1]

    @pytest.mark.parametrize(
        ("line", "facility", "level"),
        [
            (f"<14>[   12.345678] {XID}", 1, 6),
            (f"<12>{XID}", 1, 4),
            (f"<191>[   12.345678] {XID}", 23, 7),
            (f"2047,9,1,-;{XID}", 255, 7),
            (f"1030,9,1,-;{XID}", 128, 6),
            # dmesg -r for a facility it has no name for: util-linux before 2.40 (`<-1>`,
            # no level kept) and 2.40 on (`(-1 << 3) | level`).
            (f"<-1>[   12.345678] {XID}", 1, None),
            (f"<-8>[   12.345678] {XID}", 1, 0),
            (f"<-5>[   12.345678] {XID}", 1, 3),
            (f"<-2>{XID}", 1, 6),
        ],
    )
    def test_user_space_facility_is_not_trusted(
        self, line: str, facility: int, level: int | None
    ) -> None:
        """`dmesg -r`'s `<N>` prefix and a raw record's priority carry the facility; anything
        above 0 came from a process (the kernel keeps up to 255: printk's facility is a u8)."""
        stats = ParseStats()
        [record] = list(parse_lines([line], stats))
        assert (record.message, record.facility, record.level) == (XID, facility, level)
        assert not record.from_kernel
        assert stats.malformed == 0

    def test_kernel_facility_in_raw_dmesg_is_trusted(self) -> None:
        """`<4>`: facility 0, the kernel's own record."""
        record = parse_line(f"<4>[   12.345678] {XID}")
        assert record is not None
        assert (record.message, record.facility, record.level, record.timestamp) == (
            XID,
            0,
            4,
            "12.345678",
        )

    @pytest.mark.parametrize(
        "first",
        [
            "<14>[   12.345678] hello",
            "user  :info  : [   12.345678] hello",
            "Nov 29 17:42:14 gpu-host-17 python3[42]: hello",
        ],
    )
    def test_indented_line_under_a_user_record_is_that_record(self, first: str) -> None:
        """dmesg and journalctl write a message's further lines indented under its first; a
        process that embeds a newline and a driver line cannot make that line the kernel's."""
        forged = " " * 20 + XID
        stats = ParseStats()
        records = list(parse_lines([first, forged], stats))
        assert [(r.line, r.message, r.from_kernel) for r in records] == [
            (1, "hello", False),
            (2, XID, False),
        ]
        matchers = MatcherSet()
        assert list(matchers.scan(records)) == []
        assert matchers.ignored["xid"] == 1

    def test_indented_line_under_a_kernel_record_stays_the_kernels(self) -> None:
        """md's `Disk failure ... / Operation continuing ...` is one printk of two lines."""
        records = list(
            parse_lines(
                [
                    "[   12.345678] md/raid1:md0: Disk failure on sdb1, disabling device.",
                    "               md/raid1:md0: Operation continuing on 1 devices.",
                ]
            )
        )
        assert [(r.message, r.from_kernel, r.timestamp) for r in records] == [
            ("md/raid1:md0: Disk failure on sdb1, disabling device.", True, "12.345678"),
            ("md/raid1:md0: Operation continuing on 1 devices.", True, "12.345678"),
        ]


class TestHoles:
    """A log file written through a crash can hold a run of NUL bytes where unwritten blocks
    were: what is before and after them on that line is still text."""

    def test_text_around_a_hole_is_parsed(self) -> None:
        stats = ParseStats()
        line = "May 18 19:02:39 gpu-host-17 kernel: NVRM: Xid (PCI:0000:3b:00): 79, pi"
        line += "\x00" * 4096 + f"May 18 19:09:01 gpu-host-17 kernel: {XID}"
        records = list(parse_lines(["[  1.0] before", line, "[  2.0] after"], stats))
        assert [(r.line, r.message) for r in records] == [
            (1, "before"),
            (2, "NVRM: Xid (PCI:0000:3b:00): 79, pi"),
            (2, XID),
            (3, "after"),
        ]
        assert (stats.lines, stats.records, stats.malformed, stats.holes) == (3, 4, 0, 1)
