"""Kernel-log lines in the shapes they are saved in, parsed into one `LogRecord` type.

Shapes recognised, per line (a file may mix them; where each comes from is in
tests/fixtures/kernel_log/corpus/SOURCES.md):

- raw /dev/kmsg records: `priority,seq,usec,flags[,...];message`, followed by continuation
  lines ` KEY=value` (the record's device metadata);
- `dmesg`: `[   12.345678] message`, also with `-d` (`[ 12.3 <  0.000012>]`), `-e`
  (`[  +0.000123]`, `[Nov29 18:10]`) and a printk caller id after the stamp (`[  T1234]`);
- `dmesg -T`: `[Sun Nov 29 18:10:02 2026] message`;
- `dmesg -r`: `<priority>[   12.345678] message` (the priority carries the facility; `<-1>`,
  or `<-8>` to `<-1>`, for a facility dmesg has no name for: user space's, see `_prioritised`);
- `dmesg --decode` (optionally `--time-format iso`): `kern  :err   : 2026-11-29T18:10:02,123456+00:00 message`
  (a facility dmesg has no name for, 12 and up before util-linux 2.40, 24 and up since, gets
  no prefix: the line is plain dmesg's and taken as given);
- `journalctl -k` in its short output modes (short, -precise, -iso, -iso-precise, -full,
  -monotonic, -unix), with or without the host name (`--no-hostname`), and syslog files
  (rsyslog's traditional and RFC 3339 formats, the host redacted or not):
  `Nov 29 18:10:02 host kernel: message`;
- syslog files in the RFC 5424 protocol's form, with or without its `<PRI>`:
  `<4>1 2026-11-29T18:10:02.123456+00:00 host kernel - - - message`;
- anything else that is printable text: taken as a bare message (`dmesg -t` prints these).

A printk caller id (`[  T1234]`, `[    C4]`: CONFIG_PRINTK_CALLER) is taken off the message
wherever dmesg or the kernel's syslog text puts it: after any stamp, or alone (`dmesg -t`,
kern.log without printk times); a raw record carries it in its header (`,caller=T1234;`).
A terminal's colours (`dmesg --color=always`, `dmesg -H`) are taken off a line before it is read,
and so is a byte-order mark at its start (logs joined with `cat`).
Stamps that name months and days are read in any locale's words (`[Di Dez  1 18:10:02 2026]`,
`déc. 01 18:10:02 host kernel: ...`), the CJK locales' too (`[四 12月  3 05:58:20 2026]`,
`[木  1月  1 18:10:02 2026]`, `[12월 3 05:58]`, `12月 03 18:10:02 host kernel: ...`,
`木 2026-12-03 18:10:02 JST host kernel: ...`; ja_JP's and ko_KR's ` 1月 03 18:10:02 ...`
starts with the space glibc pads the months 1 to 9 with, and is a line of its own, not an
indented further line), and dmesg's reltime stamp on the days 1 to 9 (`[Dec 1 18:10]`). Given `--time-format` more than once, util-linux 2.38 prints the last
one's stamp alone (seen on this machine's dmesg); each is one of the shapes above.

A record's further lines, which dmesg and journalctl indent under its first, are records of
their own with the first line's facility and stamp (a process cannot make the second line of
its message pass for the kernel's). A stamp that cannot be read is a missing stamp: the
record keeps its message and says so (`unreadable_timestamp`). Only a line that cannot carry
a message at all (a raw record without a sequence number, a NUL byte given to `parse_line`)
is malformed: counted and skipped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final, NamedTuple

from agent.contracts.errors import GpuwardenError
from collectors.kernel_log.journal import json_entry, left_out
from collectors.kernel_log.syslog_names import (
    FACILITIES,
    KERNEL_FACILITY,
    LEVELS,
    USER_FACILITY,
)

MAX_PRIORITY: Final = 255 * 8 + 7
"""printk keeps the facility in a u8 (struct printk_info) and the level in 3 bits."""


NO_FIELDS: Final[Mapping[str, str]] = MappingProxyType({})


class LogRecord(NamedTuple):
    """One kernel-log message, whatever shape it was saved in.

    `line` is the 1-based line number in a file (the header line for a raw record), or the
    record's sequence number when read live from /dev/kmsg. `facility` is None when the shape
    does not carry one (dmesg, dmesg -T, bare lines): such lines are taken as given.

    A named tuple, not a frozen dataclass: as immutable, and one is made for every line of a
    log, which a frozen dataclass's __init__ made cost about three times as much.
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
    fields: Mapping[str, str] = NO_FIELDS
    unreadable_timestamp: str = ""
    """The stamp as written when it could not be read (then `timestamp` is empty)."""

    @property
    def from_kernel(self) -> bool:
        """False when the record says it came from user space (facility >= 1).

        Any root process can write into /dev/kmsg; what it writes arrives with the user
        facility (1) or above (kernel/printk/printk.c, devkmsg_write: a prefix asking for
        facility 0 is ignored), while the kernel and its drivers (NVRM among them) write with
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


# priority, seq, then the usec field: a number (3) or whatever else it holds (4); the text (5).
_KMSG = re.compile(
    r"(\d{1,4}),(\d{1,20}),(?:(\d{1,20})|([^,;]*)),[^,;]*(?:,[^;]*)?;(.*)", re.DOTALL | re.ASCII
)
_KMSG_LIKE = re.compile(r"\d+,[^;\s]*;", re.ASCII)
_CONTINUATION = re.compile(r" ([A-Z_][A-Z0-9_]*)=(.*)", re.DOTALL)

# dmesg's own stamp, the common case, tried first.
_DMESG = re.compile(r"\[ *(\d+\.\d+)\] ?(.*)", re.DOTALL | re.ASCII)
_DMESG_T = re.compile(
    r"\[([A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \d{4})\] ?(.*)", re.DOTALL | re.ASCII
)
# Any bracketed prefix; what is inside decides whether it is a stamp (64 characters is more
# than any dmesg stamp, and keeps an unclosed `[` from scanning a whole line).
_BRACKET = re.compile(r"\[([^\]\n]{0,64})\] ?(.*)", re.DOTALL)
_STAMPS = re.compile(
    # journalctl -o short-delta: `[  12.345678 <    0.000123 >]`, the first `[  12.345678    ]`
    r"(?P<dmesg> *\d+\.\d+(?: <\s*\d+\.\d+ ?>| *)?)"
    r"|(?P<ctime>[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \d{4}(?: <\s*\d+\.\d+>)?)"
    r"|(?P<delta> *[+-]\d+\.\d+|[A-Z][a-z]{2}\d\d \d\d:\d\d|<\s*\d+\.\d+>)",
    re.ASCII,
)
_FORMATS: Final = {"dmesg": "dmesg", "ctime": "dmesg-T", "delta": "dmesg-delta"}
# Starts like a dmesg stamp (`[  12.3`, `[123`, `[Sun Nov`, `[Nov29`) but is none of the above:
# an unreadable stamp, not a message that happens to start with `[word]`.
_STAMP_LIKE = re.compile(r"\[ *[\d.+<-]|\[[A-Z][a-z]{2}(?: [A-Z][a-z]{2} |\d\d )", re.ASCII)
_CALLER = re.compile(r"\[ *[TC]\d+\] ?", re.ASCII)
# dmesg -r writes `<-1>` (util-linux before 2.40) or `<-8>` to `<-1>` (2.40 on) for a facility
# it has no name for: see `_prioritised`.
_PRIORITY = re.compile(r"<(-?\d{1,10})>", re.ASCII)
_DECODE = re.compile(r"([a-z0-9]+)\s*:([a-z]+)\s*: ?(.*)", re.DOTALL)

_ISO = re.compile(
    r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[,.]\d+)?(?:Z|[+-]\d\d:?\d\d)?) (.*)",
    re.DOTALL | re.ASCII,
)
# A host as a syslog file names it: a name (never with a colon), or the sender's IPv6 address,
# which a central server writes where it has no name for the sender (syslog-ng's
# keep-hostname(no) with use-dns(no)): `2001:db8::5`, `fe80::1%eth0`, `::ffff:10.0.0.5`.
_HOST = r"(?:[^\s:\[\]]+|[0-9A-Fa-f]{0,4}(?::[0-9A-Fa-f.]{0,15}){2,7}(?:%[\w.-]{1,16})?)"
# journalctl short / short-precise, and syslog's traditional stamp.
_BSD = re.compile(r"([A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d(?:\.\d+)?) (.*)", re.DOTALL | re.ASCII)
_BSD_KERNEL = re.compile(
    rf"([A-Z][a-z]{{2}} [ \d]\d \d\d:\d\d:\d\d(?:\.\d+)?) (?:{_HOST} )?kernel: ?(.*)",
    re.DOTALL | re.ASCII,
)
# journalctl short-full: `Sun 2026-11-29 18:10:02 UTC`.
_FULL = re.compile(
    r"([A-Z][a-z]{2} \d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? [A-Za-z0-9+-]{1,8}) (.*)",
    re.DOTALL | re.ASCII,
)
# journalctl short-unix: `1764439802.123456`.
_UNIX = re.compile(r"(\d{9,12}\.\d{6}) (.*)", re.DOTALL | re.ASCII)
# What follows a journal/syslog stamp: `[host ]ident[[pid]]: message`. Neither a host name nor
# an identifier holds a colon (an address does, in its own form), so `kernel: NVRM: ...` is
# host-less (ident `kernel`), never host `kernel:` with ident `NVRM`.
_TAIL = re.compile(rf"(?:({_HOST}) )?([^\s:\[\]]+)(\[\d+\])?: ?(.*)", re.DOTALL | re.ASCII)
# The NVIDIA drivers' own message prefixes: after a stamp (the `kernel:` tag lost with the
# host), they start the driver's message; no program of that name logs without a pid.
_DRIVER_IDENT = re.compile(r"NVRM|nvidia(?:-[a-z]+\d*)?")
_DRIVER_SAYS = re.compile(r"(?:NVRM|nvidia(?:-[a-z]+\d*)?): ")
_JOURNAL_META = re.compile(r"-- .* --")
# The same stamps in the reader's locale (dmesg and journalctl write their month and day names
# with strftime after setlocale: `Mär`, `déc.`, `mié`, `дек`), and dmesg's reltime stamp on the
# days 1 to 9 (`%b%e`: `Dec 1 18:10`). Tried when the English forms above do not match.
_NAME = r"[^\W\d_]{2,5}\.?"
# dmesg's own stamps also in the CJK locales, whose names are one wide character (glibc's
# zh_CN, ja_JP, ko_KR abday: `四`, `木`, `목`) and whose months are a number and one (abmon:
# `12月`, `12월`; ja_JP and ko_KR pad 1 to 9 with a space, ` 1月`).
_DAY_NAME = r"[^\W\d_]{1,5}\.?"
_MONTH_NAME = rf"(?:{_NAME}| ?\d{{1,2}}[^\W\d_])"
_LOCAL_CTIME = re.compile(
    rf"\[({_DAY_NAME} {_MONTH_NAME} [ \d]\d \d\d:\d\d:\d\d \d{{4}})\] ?(.*)", re.DOTALL
)
_LOCAL_RELTIME = re.compile(rf"{_MONTH_NAME}[ \d]\d \d\d:\d\d")
# journalctl's short and short-full stamps in any locale, the CJK ones included (`12月 03
# 18:10:02`, ` 1월 03 18:10:02`, `木 2026-12-03 18:10:02 JST`).
_LOCAL_BSD = re.compile(rf"({_MONTH_NAME} [ \d]\d \d\d:\d\d:\d\d(?:\.\d{{1,9}})?) (.*)", re.DOTALL)
_LOCAL_FULL = re.compile(
    rf"({_DAY_NAME} \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d{{1,9}})? [A-Za-z0-9+-]{{1,8}}) (.*)",
    re.DOTALL,
)
# ja_JP's and ko_KR's months 1 to 9 (` 1月`) start a line with a space, as a record's further
# lines do; those are indented as deep as the stamp and what follows it (journalctl) or the
# stamp (dmesg), never by one space before a stamp.
_PADDED_MONTH = re.compile(r" \d[^\W\d_] [ \d]\d \d\d:\d\d:\d\d")
# A terminal's control sequences (CSI: ESC `[`, parameters, a final byte), which a saved
# coloured output holds (`dmesg --color=always`, `dmesg -H`, a terminal's log of journalctl).
_TERMINAL = re.compile(r"\x1b\[[0-?]{0,32}[ -/]{0,4}[@-~]")
TERMINAL_ESCAPE: Final = "\x1b"
BYTE_ORDER_MARK: Final = "\ufeff"
# RFC 5424 after its `<PRI>`: version 1, stamp, host, app name, process id, message id (each
# `-` when nil), structured data (`-` or `[id key="value"]...`, `\]` escaped in a value), then
# the message, which may start with a byte-order mark.
_SYSLOG_PROTOCOL = re.compile(
    r"1 (?P<stamp>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{1,9})?(?:Z|[+-]\d\d:\d\d)|-) "
    r"(?P<host>\S{1,255}) (?P<app>\S{1,48}) (?P<procid>\S{1,128}) \S{1,32} "
    r"(?:-|(?:\[(?:[^\]\\]|\\.)*\])+)(?: \ufeff?(?P<message>.*))?",
    re.DOTALL,
)


def parse_kmsg_header(text: str, line: int = 0) -> LogRecord:
    """One raw record's first line (`priority,seq,usec,flags;message`) -> LogRecord.

    The sequence number is the record's identity: without it the line is malformed. A
    timestamp field that is not a number is a missing timestamp."""
    match = _KMSG.match(text)
    if match is None:
        raise MalformedLine(f"not a kmsg record: {text[:60]!r}")
    priority, seq = int(match[1]), int(match[2])
    if priority > MAX_PRIORITY:
        raise MalformedLine(f"kmsg priority out of range: {priority} (at most {MAX_PRIORITY})")
    usec: int | None = None
    stamp, unreadable = "", match[4] or "(empty)"
    if match[3] is not None:
        usec = int(match[3])
        stamp, unreadable = f"{usec // 1_000_000}.{usec % 1_000_000:06d}", ""
    text = match[5]
    return LogRecord(
        unescape_kmsg(text),
        line or seq,
        "kmsg",
        priority >> 3,
        priority & 7,
        seq,
        usec,
        stamp,
        NO_FIELDS,
        unreadable,
    )


def parse_kmsg_record(data: bytes) -> LogRecord:
    """One record as one read() of /dev/kmsg returns it: header line plus ` KEY=value` lines."""
    text = data.decode("utf-8", errors="replace")
    head, *rest = text.rstrip("\n").split("\n")
    record = parse_kmsg_header(head)
    fields = {}
    for extra in rest:
        match = _CONTINUATION.fullmatch(extra)
        if match is not None:
            fields[match[1]] = unescape_kmsg(match[2])
    if fields:
        record = record._replace(fields=fields)
    return record


def _journal(stamp: str, rest: str, line: int, *, strict: bool) -> LogRecord | None:
    """A journal or syslog line's record from what follows its stamp; None when `strict` and
    the tail does not say `kernel:` or `host ident[pid]:` (monotonic and unix stamps can also
    start dmesg lines, whose `usb 1-1: ...` is not host `usb` and program `1-1`)."""
    match = _TAIL.match(rest)
    if match is None:
        return None if strict else LogRecord(rest, line, "journal", timestamp=stamp)
    host, ident, pid, message = match[1], match[2], match[3], match[4]
    if ident == "kernel" and pid is None:
        return LogRecord(_kernel_text(message), line, "journal", KERNEL_FACILITY, timestamp=stamp)
    if strict and (pid is None or host is None):
        if _DRIVER_SAYS.match(message) and not _DRIVER_IDENT.fullmatch(ident):
            # `[ 12.3] host program: NVRM: ...` (journalctl -o short-monotonic, -unix,
            # -delta): a program quoting the driver. The kernel's own line starts with the
            # driver's prefix, never with another word and a colon before it.
            return LogRecord(message, line, "journal", USER_FACILITY, timestamp=stamp)
        return None  # `IOAPIC[0]: ...`, `python3[42]: segfault at ...` are kernel messages
    if pid is None and _DRIVER_IDENT.fullmatch(ident):
        return LogRecord(rest[match.start(2) :], line, "journal", timestamp=stamp)
    # `kernel[42]:` is `logger -t kernel --id`: the kernel's own lines carry no pid.
    return LogRecord(message, line, "journal", USER_FACILITY, timestamp=stamp)


def _kernel_text(message: str) -> str:
    """rsyslog's kern.log keeps the kernel's stamp in the text: `kernel: [ 12.3] message`,
    and the caller id after it (or alone) on a kernel with CONFIG_PRINTK_CALLER."""
    if message[:1] == "[":
        inner = _DMESG.match(message)
        if inner is not None:
            return _uncalled(inner[2])
        return _uncalled(message)
    return message


def _uncalled(text: str) -> str:
    """`text` without the printk caller id (`[  T1234] `) it starts with, if any. dmesg writes
    one after whatever stamp its time format gives, none included (util-linux dmesg.c
    `print_record`); the kernel's syslog(2) text after its printk time."""
    if text[:1] == "[" and (caller := _CALLER.match(text)) is not None:
        return text[caller.end() :]
    return text


def _bracketed(text: str, line: int) -> LogRecord | None:
    """A line that starts with `[`: a dmesg stamp (read, unreadable) or a bare message."""
    match = _DMESG.match(text)
    if match is not None:
        return _after_stamp(match[1], match[2], line, "dmesg")
    match = _DMESG_T.match(text) or _LOCAL_CTIME.match(text)
    if match is not None:
        return _after_stamp(match[1], match[2], line, "dmesg-T")
    match = _BRACKET.match(text)
    if match is None:
        if _STAMP_LIKE.match(text):
            # Unclosed: nothing says where the stamp ends, so the whole line is the message.
            return LogRecord(text, line, "dmesg", unreadable_timestamp=text[:24])
        return None
    inside, rest = match[1], match[2]
    stamp = _STAMPS.fullmatch(inside)
    if stamp is not None:
        return _after_stamp(inside.strip(), rest, line, _FORMATS[stamp.lastgroup or "dmesg"])
    if _LOCAL_RELTIME.fullmatch(inside) is not None:
        return _after_stamp(inside.strip(), rest, line, "dmesg-delta")
    if _STAMP_LIKE.match(text):
        return _after_stamp("", rest, line, "dmesg", unreadable=inside)
    if _CALLER.match(text) is not None:
        return LogRecord(rest, line, "plain")  # `dmesg -t`: the caller id is all its prefix
    return None


def _after_stamp(
    stamp: str, rest: str, line: int, fmt: str, unreadable: str = ""
) -> LogRecord | None:
    rest = _uncalled(rest)  # CONFIG_PRINTK_CALLER's `[  T1234]`
    if fmt == "dmesg" and (
        rest.find("kernel: ", 0, 80) >= 0
        or rest.find("]: ", 0, 100) >= 0
        or rest.find(": NVRM: ", 0, 100) > 0
        or rest.find(": nvidia", 0, 100) > 0
    ):
        journal = _journal(stamp, rest, line, strict=True)  # journalctl -o short-monotonic
        if journal is not None:
            return journal
    return LogRecord(rest, line, fmt, timestamp=stamp, unreadable_timestamp=unreadable)


def _timed(text: str, line: int) -> LogRecord | None:
    """What `dmesg --decode` writes after its facility and level: a stamp and the message."""
    first = text[:1]
    if first == "[":
        return _bracketed(text, line)
    if first.isdigit() and (iso := _ISO.match(text)) is not None:
        return LogRecord(_uncalled(iso[2]), line, "dmesg-iso", timestamp=iso[1])
    return None


def _syslog_protocol(text: str, line: int) -> LogRecord | None:
    """An RFC 5424 line (`1 2026-11-29T18:10:02Z host kernel - - - message`): the kernel's
    when its app name is `kernel` with no process id (rsyslog's imklog), else a program's."""
    match = _SYSLOG_PROTOCOL.match(text)
    if match is None:
        return None
    message, stamp = match["message"] or "", "" if match["stamp"] == "-" else match["stamp"]
    if match["app"] == "kernel" and match["procid"] == "-":
        return LogRecord(_kernel_text(message), line, "syslog", KERNEL_FACILITY, timestamp=stamp)
    return LogRecord(message, line, "syslog", USER_FACILITY, timestamp=stamp)


def _digit_first(text: str, line: int) -> LogRecord:
    if _KMSG_LIKE.match(text):
        return parse_kmsg_header(text, line)
    if text[:2] == "1 " and (protocol := _syslog_protocol(text, line)) is not None:
        return protocol
    stamped = _ISO.match(text)
    if stamped is not None:
        # dmesg writes its ISO stamps with a comma before the microseconds; journalctl and
        # syslog daemons never do.
        if "," not in stamped[1]:
            journal = _journal(stamped[1], stamped[2], line, strict=False)
            if journal is not None:
                return journal
        return LogRecord(_uncalled(stamped[2]), line, "dmesg-iso", timestamp=stamped[1])
    stamped = _UNIX.match(text)
    if stamped is not None:
        journal = _journal(stamped[1], stamped[2], line, strict=True)
        if journal is not None:
            return journal
    return _localised(text, line)  # `12月 03 18:10:02 host kernel: ...` (zh_CN, ja_JP, ko_KR)


def _upper_first(text: str, line: int) -> LogRecord:
    kernel = _BSD_KERNEL.match(text)
    if kernel is not None:  # the common journal line, in one expression
        message = _kernel_text(kernel[2])
        return LogRecord(message, line, "journal", KERNEL_FACILITY, None, None, None, kernel[1])
    stamped = _BSD.match(text) or _FULL.match(text)
    if stamped is not None:
        record = _journal(stamped[1], stamped[2], line, strict=False)
        if record is not None:
            return record
    return _localised(text, line)


def _localised(text: str, line: int) -> LogRecord:
    """A journal line whose stamp names the month or day in the reader's locale, or a bare
    line."""
    stamped = _LOCAL_BSD.match(text) or _LOCAL_FULL.match(text)
    if stamped is not None:
        record = _journal(stamped[1], stamped[2], line, strict=False)
        if record is not None:
            return record
    return LogRecord(text, line, "plain")


def _decoded(text: str, line: int) -> LogRecord:
    match = _DECODE.match(text)
    if match is None or match[1] not in FACILITIES or match[2] not in LEVELS:
        return _localised(text, line)  # `déc. 01 18:10:02 host kernel: ...`
    facility, level = FACILITIES.index(match[1]), LEVELS.index(match[2])
    rest = _uncalled(match[3])  # `dmesg -x -t` on a kernel with CONFIG_PRINTK_CALLER
    inner = _timed(rest, line)
    if inner is None:
        return LogRecord(rest, line, "decode", facility, level)
    return inner._replace(format="decode+" + inner.format, facility=facility, level=level)


def _prioritised(text: str, line: int) -> LogRecord:
    """`dmesg -r`: `<priority>` (facility << 3 | level) before the stamp. A facility the inner
    shape gives (a journal identifier other than `kernel`) can only make it less trusted.

    What dmesg writes there is not always the record's priority (util-linux sys-utils/dmesg.c,
    `parse_faclev` and `print_record`): it reads the facility with libc's `LOG_FAC`, which
    keeps 7 bits (a process's facility 128 to 255 prints as 0 to 127); before 2.40 it wrote
    `facility | level` unshifted (commit fa6ac102d), so a process's facility 1 to 7 prints as
    `<0>` to `<7>`, the kernel's own numbers. Those cannot be told apart from the kernel's in
    this shape; only the raw record can (the live reader reads it)."""
    match = _PRIORITY.match(text)
    if match is None:
        return LogRecord(text, line, "plain")
    priority, rest = int(match[1]), text[match.end() :]
    inner = _body(rest, line) if rest.strip() else None
    if inner is None:
        inner = LogRecord(rest, line, "plain")
    facility, level = priority >> 3, priority & 7
    known_level: int | None = level
    if priority < 0:
        # dmesg names the facilities 0 to 11 (util-linux before 2.40) or 0 to 23, and writes
        # a negative number for any other: the kernel's own (0) is always named, so such a
        # record is user space's. `<-1>` before 2.40 is `-1 | level` and keeps no level.
        facility, known_level = USER_FACILITY, (None if priority == -1 else level)
    if inner.facility is not None and inner.facility != KERNEL_FACILITY:
        facility = inner.facility
    return inner._replace(format="prio+" + inner.format, facility=facility, level=known_level)


def _body(text: str, line: int) -> LogRecord | None:
    """Every shape but `<priority>`, dispatched on the first character (most lines of a log
    are one shape, and each test below is one regular expression at most)."""
    first = text[0]
    if first == "[":
        return _bracketed(text, line) or LogRecord(text, line, "plain")
    if first.isdigit():
        return _digit_first(text, line)
    if first.isupper():
        return _upper_first(text, line)
    if first in "{\x1e" or (first == "d" and text.startswith("data: {")):
        return _journal_object(text, line) or LogRecord(text, line, "plain")
    if first.islower():
        return _decoded(text, line)
    if first.isalpha():  # neither case: a CJK day name (`木 2026-12-03 18:10:02 JST host ...`)
        return _localised(text, line)
    if first == "-" and _JOURNAL_META.fullmatch(text):
        return None
    if first.isspace() and not text.strip():
        return None
    if first == " ":
        return _localised(text, line)  # ja_JP's, ko_KR's padded month: ` 1月 03 18:10:02 ...`
    return LogRecord(text, line, "plain")


def _journal_object(text: str, line: int) -> LogRecord | None:
    entry = json_entry(text)
    if entry is None:
        return None
    return LogRecord(
        message=entry.message,
        line=line,
        format="journal-json",
        facility=entry.facility,
        level=entry.level,
        monotonic_usec=entry.monotonic_usec,
        timestamp=entry.timestamp,
    )


def parse_line(text: str, line: int = 0) -> LogRecord | None:
    """One saved line -> a record; None for blank lines and journal banners.

    Raises MalformedLine for a line that cannot carry a message (a broken raw record header,
    a NUL byte: `parse_lines` cuts a line at its NUL bytes before it comes here).
    """
    text = text.rstrip("\r\n")
    if text[:1] == BYTE_ORDER_MARK:
        text = text[1:]  # a file's start inside a file (logs joined with `cat`)
    if TERMINAL_ESCAPE in text:
        text = _TERMINAL.sub("", text)  # the colours of a saved terminal's output
    if not text:
        return None
    if "\x00" in text:
        raise MalformedLine("NUL byte in line")
    if text[0] == "<":
        return _prioritised(text, line)
    return _body(text, line)


@dataclass
class ParseStats:
    """What parsing a saved log saw, beside its records."""

    lines: int = 0
    records: int = 0
    malformed: int = 0
    malformed_examples: list[tuple[int, str]] = field(default_factory=list)
    bad_timestamps: int = 0
    """Records whose stamp could not be read (kept, without a timestamp)."""
    left_out: int = 0
    """Kernel records whose message journalctl did not print (`[68B blob data]`, `null`):
    saved without `journalctl --all`, they cannot be read."""
    holes: int = 0
    """Lines holding NUL bytes (a file-system hole left by a crash): the text around them
    was parsed."""
    open_record: LogRecord | None = None
    """At the end: the record an indented line after the last one would continue (None when
    the last line ended it), for a reader that goes on with the next lines later."""

    def count_malformed(self, line: int, why: str) -> None:
        self.malformed += 1
        if len(self.malformed_examples) < 5:
            self.malformed_examples.append((line, why))


TOO_LONG: Final = "line too long to be a kernel record, skipped"
UNKNOWN_RECORD: Final = LogRecord(message="", format="continued", facility=USER_FACILITY)
"""What came before a read position when it is not known (a reader restarted in the middle
of a file): the indented lines that continue it are counted but not trusted."""


def _continued(previous: LogRecord, text: str, line: int) -> LogRecord:
    """An indented line under `previous`: a further line of the same message."""
    if TERMINAL_ESCAPE in text:
        text = _TERMINAL.sub("", text)
    return LogRecord(
        message=text.lstrip(" ").rstrip("\r\n"),
        line=line,
        format=previous.format,
        facility=previous.facility,
        level=previous.level,
        seq=previous.seq,
        monotonic_usec=previous.monotonic_usec,
        timestamp=previous.timestamp,
        unreadable_timestamp=previous.unreadable_timestamp,
    )


def indented(text: str) -> bool:
    """Whether `text` is a further line of the record before it: indented (a raw record's
    ` KEY=value`, a message's further lines under its first), and not a line whose own
    stamp starts with a space (ja_JP's and ko_KR's months 1 to 9: ` 1月 03 18:10:02`)."""
    return text[:1] == " " and _PADDED_MONTH.match(text) is None


def last_record_lines(lines: Sequence[str | None]) -> int:
    """How many lines at the end of `lines` are the last record: its first line and the
    indented lines after it (a raw record's ` KEY=value`, a message's further lines), which
    may go on in lines not read yet. 0 when the last line is no record's."""
    index = len(lines) - 1
    while index >= 0 and (text := lines[index]) is not None and indented(text):
        index -= 1
    if index < 0 or lines[index] is None:
        return 0
    return len(lines) - index


def _fields(text: str) -> tuple[str, str] | None:
    """A raw record's ` KEY=value` line, or None."""
    match = _CONTINUATION.fullmatch(text.rstrip("\r\n"))
    return None if match is None else (match[1], unescape_kmsg(match[2]))


def _with_fields(record: LogRecord, fields: dict[str, str] | None) -> LogRecord:
    return record if not fields else record._replace(fields=fields)


def _parse_counted(text: str, number: int, stats: ParseStats) -> LogRecord | None:
    try:
        record = parse_line(text, number)
    except MalformedLine as exc:
        stats.count_malformed(number, str(exc))
        return None
    if record is not None:
        stats.records += 1
        if record.unreadable_timestamp:
            stats.bad_timestamps += 1
        ends = record.message[-1:]
        if ends in ("]", "") and record.from_kernel and left_out(record.format, record.message):
            stats.left_out += 1
            return None
    return record


def _records(text: str | None, number: int, stats: ParseStats) -> list[LogRecord]:
    """The records on a line that is no plain line: too long (None), or cut by NUL bytes (a
    hole) into up to two messages."""
    if text is None:
        stats.count_malformed(number, TOO_LONG)
        return []
    stats.holes += 1
    parts = (_parse_counted(part, number, stats) for part in text.split("\x00") if part.strip())
    return [record for record in parts if record is not None]


def parse_lines(
    lines: Iterable[str | None],
    stats: ParseStats | None = None,
    first_line: int = 1,
    previous: LogRecord | None = None,
) -> Iterator[LogRecord]:
    """Records from saved lines in any mix of shapes; malformed lines are counted in `stats`.

    `lines` are the text between two `\\n` (a line reader gives None for a line too long to
    keep: counted as malformed, and it still takes its line number). Continuation lines
    (` KEY=value`) attach to the raw record just before them, which is yielded once they are
    complete; other indented lines continue the record before them (see `_continued`).
    `previous`: the record before the first line (`stats.open_record` of the lines before).
    """
    stats = stats if stats is not None else ParseStats()
    pending: LogRecord | None = None  # a raw record, until its KEY=value lines are complete
    fields: dict[str, str] | None = None
    for number, text in enumerate(lines, start=first_line):
        stats.lines += 1
        if (
            text is not None
            and text[:1] == " "
            and previous is not None
            and text.strip()
            and _PADDED_MONTH.match(text) is None  # not `indented`'s call: the common path
        ):
            if pending is not None and (field_ := _fields(text)) is not None:
                fields = fields or {}
                fields[field_[0]] = field_[1]
                continue
            if pending is not None:
                yield _with_fields(pending, fields)
                pending, fields = None, None
            stats.records += 1
            yield _continued(previous, text, number)
            continue
        if pending is not None:
            yield _with_fields(pending, fields)
            pending, fields = None, None
        if text is not None and "\x00" not in text:  # a plain line: the common case
            record = _parse_counted(text, number, stats)
            found: Sequence[LogRecord] = () if record is None else (record,)
        else:
            found = _records(text, number, stats)
        previous = None
        for record in found:
            if pending is not None:
                yield pending
            previous = record
            pending = record if record.format == "kmsg" else None
            if pending is None:
                yield record
    stats.open_record = previous
    if pending is not None:
        yield _with_fields(pending, fields)
