"""The systemd journal's structured output modes, read as kernel-log records.

`journalctl -o json` (also `json-seq`, `json-sse`) writes one JSON object per record;
`-o json-pretty`, `-o verbose` and `-o export` spread a record over several lines. Each
record says who wrote it: journald sets `_TRANSPORT=kernel` on what it read from /dev/kmsg and
`SYSLOG_FACILITY` from the record's priority, so a program's line that quotes an Xid (a log
shipper, gpuwarden's own log) is not the kernel's. Formats: systemd's journal-export-formats
and journalctl(1) (systemd 252); tests/test_scan_journal.py reads what the real `journalctl`
writes for a journal made by `systemd-journal-remote`.

The multi-line modes are turned into the one-line JSON form before parsing (`assemble`), each
record's JSON on the line of its `MESSAGE` and blank lines for its other lines, so that line
numbers still point into the file.

A field journalctl did not print: `null` in JSON (a value over 4096 bytes without `--all`),
`[NNB blob data]` in the short and verbose modes (a value that is not printable text without
`--all`). Such a record is counted (`ParseStats.blobs`), not passed over in silence.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from itertools import chain
from typing import Final, NamedTuple

from collectors.kernel_log.syslog_names import FACILITIES, KERNEL_FACILITY, LEVELS, USER_FACILITY

BLOB_MARK: Final = "B blob data]"
LINE_WORDS: Final = ('"MESSAGE":[', '"MESSAGE": [', '"MESSAGE":null', '"MESSAGE": null', BLOB_MARK)
"""Words that make a saved line worth parsing whatever its trigger words: a message given
as bytes (its words are numbers), one left out."""

_BLOB: Final = re.compile(r"\[\d{1,12}(?:\.\d)?[KMGT]?B blob data\]$")
MAX_BINARY_FIELD: Final = 64 * 1024 * 1024
MAX_RECORD_LINES: Final = 70_000
"""A multi-line record longer than this is no journal record (a 64 KiB message in bytes is
65,536 lines of json-pretty): its lines are passed on as they are."""


def is_blob(message: str) -> bool:
    """Whether journalctl printed a placeholder for the message (`[68B blob data]`)."""
    return message.endswith(BLOB_MARK) and _BLOB.search(message) is not None


def _text(value: object) -> str | None:
    """A field's value: text, bytes as a list of numbers, several values as a list of those
    (the first is taken), or None for a value journalctl left out."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        if all(isinstance(b, int) and 0 <= b <= 255 for b in value):
            return bytes(value).decode("utf-8", errors="replace")
        return _text(value[0])
    return None


def _number(value: object) -> int | None:
    text = _text(value)
    return int(text) if text is not None and text.isdigit() and len(text) <= 20 else None


def _realtime(usec: int | None) -> str:
    if usec is None:
        return ""
    try:
        return datetime.fromtimestamp(usec / 1e6, UTC).isoformat(timespec="microseconds")
    except (OverflowError, OSError, ValueError):
        return ""


def _facility(fields: dict[str, object]) -> int | None:
    """The kernel's only when journald read it from /dev/kmsg with facility 0; a record that
    names no transport (`--output-fields=MESSAGE`) says nothing, like a dmesg line."""
    facility = _number(fields.get("SYSLOG_FACILITY"))
    if "_TRANSPORT" not in fields:
        return facility
    if _text(fields["_TRANSPORT"]) == "kernel" and not facility:
        return KERNEL_FACILITY
    return facility or USER_FACILITY


class Entry(NamedTuple):
    """What a journal object says of its record."""

    message: str
    """"" when journalctl left it out (null)."""
    facility: int | None
    level: int | None
    monotonic_usec: int | None
    """The kernel's own stamp of a kernel record (`_SOURCE_MONOTONIC_TIMESTAMP`)."""
    timestamp: str


def json_entry(text: str) -> Entry | None:
    """One `journalctl -o json` (`json-seq`, `json-sse`) line; None when the line is no
    journal object with a `MESSAGE` (it is then read as a bare line)."""
    body = text[5:] if text.startswith("data:") else text.lstrip("\x1e")
    try:
        fields = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(fields, dict) or "MESSAGE" not in fields:
        return None
    message = _text(fields["MESSAGE"])
    level = _number(fields.get("PRIORITY"))
    facility = _facility(fields)
    return Entry(
        message if message is not None else "",
        facility,
        level if level is not None and level <= 7 else None,
        _number(fields.get("_SOURCE_MONOTONIC_TIMESTAMP")) if facility == KERNEL_FACILITY else None,
        _realtime(_number(fields.get("__REALTIME_TIMESTAMP"))),
    )


def left_out(form: str, message: str) -> bool:
    """Whether journalctl left a record's message out (null, `[NNB blob data]`)."""
    if form == "journal-json" and not message:
        return True
    return is_blob(message)


# -- the multi-line modes ------------------------------------------------------------------------

_VERBOSE_HEAD: Final = re.compile(
    r"^\w{3} \d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d{1,6})? \S{1,64} \[s=[0-9a-f]{32};"
)
_VERBOSE_FIELD: Final = re.compile(r"^    ([A-Z0-9_]{1,64})=(.*)$", re.DOTALL)
_PRETTY_FIELD: Final = re.compile(r'^\t"([A-Z0-9_]{1,64})" : (.*?),?$')
_EXPORT_FIELD: Final = re.compile(r"^([A-Z0-9_]{1,64})=(.*)$", re.DOTALL)


def _compact(fields: dict[str, object]) -> str:
    return json.dumps(fields, separators=(",", ":"), ensure_ascii=False)


def _emit(lines: list[str], fields: dict[str, object], message_at: int | None) -> Iterator[str]:
    """The record's lines: its JSON where its MESSAGE was, blank lines for the rest. A record
    without a MESSAGE is blank lines only: its other fields (a command line, a unit's name)
    are no kernel message, whatever words they hold."""
    at = message_at if message_at is not None and "MESSAGE" in fields else -1
    for index in range(len(lines)):
        yield _compact(fields) if index == at else ""


def _verbose(lines: Iterator[str | None], first: str) -> Iterator[str | None]:
    """`-o verbose`: a head line, then `    NAME=value`, a value's further lines indented
    under its first."""
    record: list[str] = [first]
    fields: dict[str, object] = {}
    message_at: int | None = None
    name, indent = "", ""
    for text in lines:
        if text is not None and name and text.startswith(indent) and text.strip():
            fields[name] = f"{fields[name]}\n{text[len(indent) :]}"
            record.append(text)
            continue
        name = ""
        head = text is not None and _VERBOSE_HEAD.match(text) is not None
        if text is None or head or len(record) >= MAX_RECORD_LINES:
            yield from _emit(record, fields, message_at)
            record, fields, message_at = [], {}, None
            if text is not None and head:
                record = [text]
            else:
                yield text
            continue
        match = _VERBOSE_FIELD.match(text)
        if match is None or not record:
            if record:
                yield from _emit(record, fields, message_at)
                record, fields, message_at = [], {}, None
            yield text
            continue
        if match[1] not in fields:
            fields[match[1]] = match[2]
            name, indent = match[1], " " * (5 + len(match[1]))
            if match[1] == "MESSAGE":
                message_at = len(record)
        record.append(text)
    if record:
        yield from _emit(record, fields, message_at)


def _depth(text: str) -> int:
    """How many more brackets `text` opens than it closes, outside its strings."""
    depth, quoted, escaped = 0, False, False
    for char in text:
        if escaped:
            escaped = False
        elif quoted:
            escaped, quoted = char == "\\", char != '"'
        elif char == '"':
            quoted = True
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
    return depth


def _pretty(lines: Iterator[str | None], first: str) -> Iterator[str | None]:
    """`-o json-pretty`: `{`, a field a line (a byte array over many), `}`."""
    record: list[str] = [first]
    fields: dict[str, object] = {}
    message_at: int | None = None
    value: list[str] = []  # a value over several lines, and its field
    name, depth = "", 0
    for text in lines:
        if not record:
            if text == "{":
                record = [text]
            else:
                yield text
            continue
        if text is None or len(record) >= MAX_RECORD_LINES:
            yield from record
            yield text
            record, fields, message_at, value = [], {}, None, []
            continue
        record.append(text)
        if value:
            value.append(text.strip())
            depth += _depth(text)
            if depth <= 0:
                _keep(fields, name, "".join(value).rstrip(","))
                value = []
            continue
        if text == "}":
            yield from _emit(record, fields, message_at)
            record, fields, message_at = [], {}, None
            continue
        match = _PRETTY_FIELD.match(text)
        if match is None:
            continue
        if match[1] == "MESSAGE" and message_at is None:
            message_at = len(record) - 1
        depth = _depth(match[2])
        if depth > 0:
            name, value = match[1], [match[2]]
        else:
            _keep(fields, match[1], match[2])
    yield from record


def _keep(fields: dict[str, object], name: str, text: str) -> None:
    try:
        fields.setdefault(name, json.loads(text))
    except (ValueError, RecursionError):
        return


_DMESG_FIELD: Final = re.compile(r'^\s*"(pri|fac|time|msg|caller)": (.*?),?$')


def _dmesg_entry(fields: dict[str, object]) -> dict[str, object]:
    """A `dmesg --json` record as the journal's fields: the facility only where dmesg gave it
    (`-x` names it; a number over 7 holds it); else, like a dmesg line, nothing is said."""
    out: dict[str, object] = {"MESSAGE": fields.get("msg")}
    facility, level = fields.get("fac"), fields.get("pri")
    if isinstance(facility, str) and facility in FACILITIES:
        out["SYSLOG_FACILITY"] = str(FACILITIES.index(facility))
    if isinstance(level, str) and level in LEVELS:
        out["PRIORITY"] = str(LEVELS.index(level))
    elif isinstance(level, int) and level >= 0:
        out["PRIORITY"] = str(level & 7)
        if level > 7:
            out["SYSLOG_FACILITY"] = str(level >> 3)
    stamp = fields.get("time")
    if (
        isinstance(stamp, int | float)
        and "SYSLOG_FACILITY" in out
        and out["SYSLOG_FACILITY"] == "0"
    ):
        out["_TRANSPORT"] = "kernel"
        out["_SOURCE_MONOTONIC_TIMESTAMP"] = str(int(stamp * 1_000_000))
    return out


def _dmesg_json(lines: Iterator[str | None], first: str) -> Iterator[str | None]:
    """`dmesg --json` (util-linux 2.38+): `{ "dmesg": [ {"pri": ..., "time": ..., "msg":
    ...},{ ... } ] }`, a field a line (`fac` too with `-x`). Each record becomes a journal JSON
    line on the line of its `msg`."""
    yield from ("", "")  # the opening `{` and `"dmesg": [`
    record: list[str] = []
    fields: dict[str, object] = {}
    message_at: int | None = None
    for text in lines:
        if text is None:
            yield from record
            yield None
            record, fields, message_at = [], {}, None
            continue
        record.append(text)
        match = _DMESG_FIELD.match(text)
        if match is not None:
            _keep(fields, match[1], match[2])
            if match[1] == "msg":
                message_at = len(record) - 1
        elif "}" in text or len(record) >= MAX_RECORD_LINES:
            if "msg" in fields:
                yield from _emit(record, _dmesg_entry(fields), message_at)
            else:
                yield from ("" for _ in record)
            record, fields, message_at = [], {}, None
    if "msg" in fields:
        yield from _emit(record, _dmesg_entry(fields), message_at)
    else:
        yield from ("" for _ in record)


def assemble(lines: Iterable[str | None]) -> Iterator[str | None]:
    """`lines` with the records of `journalctl -o verbose`, `-o json-pretty` or `dmesg
    --json` made one JSON line each (the mode is known from the first lines that are not
    blank); other lines as they are."""
    it = iter(lines)
    for text in it:
        if text is None or not text.strip():
            yield text
            continue
        if _VERBOSE_HEAD.match(text):
            yield from _verbose(it, text)
        elif text == "{":
            second = next(it, None)
            if second is not None and second.strip() == '"dmesg": [':
                yield from _dmesg_json(it, text)
                return
            yield from _pretty(chain([] if second is None else [second], it), text)
        else:
            yield text
            yield from it
        return


class ExportReader:
    """`journalctl -o export` as JSON lines: one per record, on the line of its MESSAGE, and a
    blank line for each of the record's other lines. A binary field (`NAME\\n`, its length in
    8 bytes little-endian, the bytes, `\\n`) may hold newlines and any byte; it is read by its
    length. A stream that stops following the format is passed on as lines from there."""

    def __init__(self, stream: Iterable[bytes]) -> None:
        self._chunks = iter(stream)
        self._data = b""
        self._at = 0
        """Where the unread bytes of `_data` start (slicing it per line would copy it)."""
        self._done = False

    def _fill(self, need: int) -> bool:
        """At least `need` unread bytes, unless the stream ends first."""
        while len(self._data) - self._at < need and not self._done:
            chunk = next(self._chunks, b"")
            if not chunk:
                self._done = True
            self._data = self._data[self._at :] + chunk
            self._at = 0
        return len(self._data) - self._at >= need

    def _take(self, size: int) -> bytes:
        taken = self._data[self._at : self._at + size]
        self._at += size
        return taken

    def _line(self) -> bytes | None:
        while True:
            end = self._data.find(b"\n", self._at)
            if end >= 0:
                line = self._data[self._at : end]
                self._at = end + 1
                return line
            if self._done:
                if self._at >= len(self._data):
                    return None
                return self._take(len(self._data) - self._at)
            self._fill(len(self._data) - self._at + 1)

    def lines(self) -> Iterator[str | None]:
        fields: dict[str, object] = {}
        count = 0
        message_at: int | None = None
        while (raw := self._line()) is not None:
            if not raw:
                if count:
                    yield from _emit([""] * count, fields, message_at)
                yield ""  # the blank line that ends a record
                fields, count, message_at = {}, 0, None
                continue
            text = raw.decode("utf-8", errors="replace")
            match = _EXPORT_FIELD.match(text)
            if match is not None:
                name, value = match[1], match[2]
                lines = 1
            elif re.fullmatch(r"[A-Z0-9_]{1,64}", text) and self._fill(8):
                size = int.from_bytes(self._data[self._at : self._at + 8], "little")
                if size > MAX_BINARY_FIELD or not self._fill(8 + size + 1):
                    # Not the format (or cut short): the rest is lines as they are.
                    if count:
                        yield from _emit([""] * count, fields, message_at)
                    yield text
                    while (rest := self._line()) is not None:
                        yield rest.decode("utf-8", errors="replace")
                    return
                length, blob = self._take(8), self._take(size)
                self._take(1)
                name, value = text, list(blob)
                lines = 2 + length.count(b"\n") + blob.count(b"\n")
            else:
                if count:
                    yield from _emit([""] * count, fields, message_at)
                    fields, count, message_at = {}, 0, None
                yield text
                continue
            fields.setdefault(name, value)
            if name == "MESSAGE" and message_at is None:
                message_at = count
            count += lines
        if count:
            yield from _emit([""] * count, fields, message_at)
