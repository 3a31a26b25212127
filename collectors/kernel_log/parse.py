"""Kernel-log lines in the shapes they are saved in, parsed into one `LogRecord` type.

Shapes recognised, per line (a file may mix them):

- raw /dev/kmsg records: `priority,seq,usec,flags[,...];message`, followed by continuation
  lines ` KEY=value` (the record's device metadata);
- `dmesg`: `[   12.345678] message`;
- `dmesg -T`: `[Sun Nov 29 18:10:02 2026] message`;
- `dmesg --decode` (optionally `--time-format iso`): `kern  :err   : 2026-11-29T18:10:02,123456+00:00 message`;
- `journalctl -k` (short, short-precise, short-iso): `Nov 29 18:10:02 host kernel: message`;
- anything else that is printable text: taken as a bare message (`dmesg -t` prints these).

A line that starts like one of the structured shapes but breaks it (a raw record with a
non-numeric sequence, an unclosed `[` timestamp, a NUL byte) is malformed: counted and skipped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Final

from agent.contracts.errors import GpuwardenError

# syslog(3) facility names as `dmesg --decode` prints them, in facility-number order.
FACILITIES: Final = (
    "kern",
    "user",
    "mail",
    "daemon",
    "auth",
    "syslog",
    "lpr",
    "news",
    "uucp",
    "cron",
    "authpriv",
    "ftp",
    "res0",
    "res1",
    "res2",
    "res3",
    "local0",
    "local1",
    "local2",
    "local3",
    "local4",
    "local5",
    "local6",
    "local7",
)
LEVELS: Final = ("emerg", "alert", "crit", "err", "warn", "notice", "info", "debug")

KERNEL_FACILITY: Final = 0
USER_FACILITY: Final = 1


@dataclass(frozen=True, slots=True)
class LogRecord:
    """One kernel-log message, whatever shape it was saved in.

    `line` is the 1-based line number in a file (the header line for a raw record), or the
    record's sequence number when read live from /dev/kmsg. `facility` is None when the shape
    does not carry one (dmesg, dmesg -T, bare lines): such lines are taken as given.
    """

    message: str
    line: int = 0
    format: str = "plain"
    facility: int | None = None
    level: int | None = None
    seq: int | None = None
    monotonic_usec: int | None = None
    """Microseconds since boot (raw records), as the kernel stamped the record."""
    timestamp: str = ""
    """The time as the saved line wrote it, unparsed."""
    fields: Mapping[str, str] = field(default_factory=dict)

    @property
    def from_kernel(self) -> bool:
        """False when the record says it came from user space (facility >= 1).

        Any root process can write into /dev/kmsg; what it writes arrives with the user
        facility (1) or above, while the kernel and its drivers (NVRM among them) write with
        facility 0. A record without a facility is taken as given.
        """
        return self.facility is None or self.facility == KERNEL_FACILITY


class MalformedLine(GpuwardenError, ValueError):
    """A line that starts like a structured kernel-log shape but does not follow it."""


# /dev/kmsg escapes every byte outside printable ASCII (and the backslash) as \xNN, so a
# UTF-8 character arrives as a run of escapes that must be decoded together.
_ESCAPE = re.compile(r"\\x([0-9a-fA-F]{2})")


def unescape_kmsg(text: str) -> str:
    if "\\x" not in text:
        return text
    out: list[str] = []
    pending = bytearray()
    position = 0
    for match in _ESCAPE.finditer(text):
        if match.start() > position:
            out.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            out.append(text[position : match.start()])
        pending.append(int(match[1], 16))
        position = match.end()
    out.append(pending.decode("utf-8", errors="replace"))
    out.append(text[position:])
    return "".join(out)


_KMSG = re.compile(r"^(\d{1,4}),(\d{1,20}),(\d{1,20}),([^,;]*)(?:,[^;]*)?;(.*)$", re.DOTALL)
_KMSG_LIKE = re.compile(r"^\d+,[^;\s]*;")
_CONTINUATION = re.compile(r"^ ([A-Z_][A-Z0-9_]*)=(.*)$")
_DMESG = re.compile(r"^\[\s*(\d+\.\d+)\] ?(.*)$", re.DOTALL)
_DMESG_T = re.compile(
    r"^\[([A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \d{4})\] ?(.*)$", re.DOTALL
)
# Starts like a dmesg stamp (`[  12.3`, `[Sun Nov`) but did not parse as one.
_BRACKET_LIKE = re.compile(r"^\[\s*\d|^\[[A-Z][a-z]{2} [A-Z][a-z]{2} ")
_DECODE = re.compile(r"^([a-z0-9]+)\s*:([a-z]+)\s*: ?(.*)$", re.DOTALL)
_ISO = re.compile(
    r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[,.]\d+)?(?:Z|[+-]\d\d:?\d\d)?) (.*)$", re.DOTALL
)
# journalctl short / short-precise: `Nov 29 18:10:02[.123456] host ident[pid]: message`.
_JOURNAL = re.compile(
    r"^([A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d(?:\.\d+)?) (\S+) ([^\s:\[]+)(?:\[\d+\])?: ?(.*)$",
    re.DOTALL,
)
# journalctl short-iso. An ISO stamp also starts `dmesg --time-format iso` lines, so the
# journal reading needs `kernel:` or an `ident[pid]:` to be sure (`usb 1-1: ...` is dmesg).
_JOURNAL_ISO = re.compile(
    r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[,.]\d+)?(?:Z|[+-]\d\d:?\d\d)?) (\S+) "
    r"(kernel|[^\s:\[]+(?=\[\d+\]))(?:\[\d+\])?: ?(.*)$",
    re.DOTALL,
)
_JOURNAL_META = re.compile(r"^-- .* --$|^-- No entries --$")


def parse_kmsg_header(text: str, line: int = 0) -> LogRecord:
    """One raw record's first line (`priority,seq,usec,flags;message`) -> LogRecord."""
    match = _KMSG.match(text)
    if match is None:
        raise MalformedLine(f"not a kmsg record: {text[:60]!r}")
    priority, seq, usec = int(match[1]), int(match[2]), int(match[3])
    if priority > 1023:  # facility fits in 7 bits, level in 3
        raise MalformedLine(f"kmsg priority out of range: {priority}")
    return LogRecord(
        message=unescape_kmsg(match[5]),
        line=line or seq,
        format="kmsg",
        facility=priority >> 3,
        level=priority & 7,
        seq=seq,
        monotonic_usec=usec,
        timestamp=f"{usec // 1_000_000}.{usec % 1_000_000:06d}",
    )


def parse_kmsg_record(data: bytes) -> LogRecord:
    """One record as one read() of /dev/kmsg returns it: header line plus ` KEY=value` lines."""
    text = data.decode("utf-8", errors="replace")
    head, *rest = text.rstrip("\n").split("\n")
    record = parse_kmsg_header(head)
    fields = {}
    for extra in rest:
        match = _CONTINUATION.match(extra)
        if match is not None:
            fields[match[1]] = unescape_kmsg(match[2])
    if fields:
        record = _with_fields(record, fields)
    return record


def _with_fields(record: LogRecord, fields: Mapping[str, str]) -> LogRecord:
    return LogRecord(
        message=record.message,
        line=record.line,
        format=record.format,
        facility=record.facility,
        level=record.level,
        seq=record.seq,
        monotonic_usec=record.monotonic_usec,
        timestamp=record.timestamp,
        fields=dict(fields),
    )


def _parse_timed(text: str, line: int, fmt_prefix: str = "") -> LogRecord | None:
    """dmesg, dmesg -T and ISO-stamped text; None when `text` has none of these stamps."""
    for pattern, name in ((_DMESG, "dmesg"), (_DMESG_T, "dmesg-T"), (_ISO, "dmesg-iso")):
        match = pattern.match(text)
        if match is not None:
            return LogRecord(
                message=match[2], line=line, format=fmt_prefix + name, timestamp=match[1]
            )
    if _BRACKET_LIKE.match(text):
        raise MalformedLine(f"unclosed or broken [timestamp]: {text[:60]!r}")
    return None


def _parse_decoded(match: re.Match[str], line: int) -> LogRecord:
    facility, level = FACILITIES.index(match[1]), LEVELS.index(match[2])
    rest = match[3]
    inner = _parse_timed(rest, line, "decode+")
    record = inner or LogRecord(message=rest, line=line, format="decode")
    return LogRecord(
        message=record.message,
        line=line,
        format=record.format,
        facility=facility,
        level=level,
        timestamp=record.timestamp,
    )


def parse_line(text: str, line: int = 0) -> LogRecord | None:
    """One saved line -> a record; None for blank lines and journal banners.

    Raises MalformedLine for a line that starts like a structured shape but breaks it.
    """
    text = text.rstrip("\r\n")
    if "\x00" in text:
        raise MalformedLine("NUL byte in line")
    if not text.strip() or _JOURNAL_META.match(text):
        return None
    if _KMSG_LIKE.match(text):
        return parse_kmsg_header(text, line)
    journal = _JOURNAL.match(text) or _JOURNAL_ISO.match(text)
    if journal is not None:
        # journalctl -k shows the kernel's own lines as `kernel:`; any other identifier was
        # written from user space and is marked so (it cannot be trusted as a driver message).
        facility = KERNEL_FACILITY if journal[3] == "kernel" else USER_FACILITY
        return LogRecord(
            message=journal[4], line=line, format="journal", facility=facility, timestamp=journal[1]
        )
    timed = _parse_timed(text, line)
    if timed is not None:
        return timed
    decoded = _DECODE.match(text)
    if decoded is not None and decoded[1] in FACILITIES and decoded[2] in LEVELS:
        return _parse_decoded(decoded, line)
    return LogRecord(message=text, line=line, format="plain")


@dataclass
class ParseStats:
    """What parsing a saved log saw, beside its records."""

    lines: int = 0
    records: int = 0
    malformed: int = 0
    malformed_examples: list[tuple[int, str]] = field(default_factory=list)

    def count_malformed(self, line: int, why: str) -> None:
        self.malformed += 1
        if len(self.malformed_examples) < 5:
            self.malformed_examples.append((line, why))


def parse_lines(
    lines: Iterable[str], stats: ParseStats | None = None, first_line: int = 1
) -> Iterator[LogRecord]:
    """Records from saved lines in any mix of shapes; malformed lines are counted in `stats`.

    Continuation lines (` KEY=value`) attach to the raw record just before them; a raw
    record is yielded once its continuation lines are complete.
    """
    stats = stats if stats is not None else ParseStats()
    pending: LogRecord | None = None
    pending_fields: dict[str, str] = {}
    for number, text in enumerate(lines, start=first_line):
        stats.lines += 1
        continuation = _CONTINUATION.match(text.rstrip("\r\n"))
        if continuation is not None and pending is not None:
            pending_fields[continuation[1]] = unescape_kmsg(continuation[2])
            continue
        if pending is not None:
            yield _with_fields(pending, pending_fields) if pending_fields else pending
            pending, pending_fields = None, {}
        try:
            record = parse_line(text, number)
        except MalformedLine as exc:
            stats.count_malformed(number, str(exc))
            continue
        if record is None:
            continue
        stats.records += 1
        if record.format == "kmsg":
            pending = record
        else:
            yield record
    if pending is not None:
        yield _with_fields(pending, pending_fields) if pending_fields else pending
