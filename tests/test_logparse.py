"""Saved kernel-log shapes parse into one record type; malformed lines are counted, never fatal."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from collectors.kernel_log.parse import (
    LogRecord,
    MalformedLine,
    ParseStats,
    parse_kmsg_record,
    parse_line,
    parse_lines,
)
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
            "99999,1,1,-;priority too large",
            "[   17.5 never closes",
            "[Sun Nov 29 17:42 never closes",
            "a\x00b",
        ],
    )
    def test_malformed(self, line: str) -> None:
        """Lines that start like a shape but break it raise MalformedLine."""
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
        """Every line is a record, skipped, malformed or a continuation: none is lost."""
        stats = ParseStats()
        records = list(parse_lines(lines, stats))
        assert stats.lines == len(lines)
        assert len(records) == stats.records <= len(lines) - stats.malformed

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
