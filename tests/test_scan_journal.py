"""gpuwarden scan on what the real `journalctl` writes: every output mode of a journal file
made by `systemd-journal-remote`, and the journal file itself.

The journal holds the kernel's records (one with a byte that is not UTF-8, which journald
keeps as bytes; one over five lines) and records that quote the kernel's words from user
space: a program's log line, a root process's write to /dev/kmsg (facility 1) and a syslog
message that claims facility 0. The structured modes say who wrote each record; only the
kernel's may be findings.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Final, NamedTuple

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.program.cli import main as cli_main
from agent.program.commands.scan import scan_lines
from collectors.kernel_log.journal import ExportReader
from collectors.kernel_log.matchers import Finding, MatcherSet
from collectors.kernel_log.parse import ParseStats, parse_line
from collectors.kernel_log.saved import ReadNotes, saved_lines
from collectors.kernel_log.stamps import read_stamp
from collectors.kernel_log.syslog_names import KERNEL_FACILITY, USER_FACILITY
from tests.support.locales import compile_locales, environment
from tests.support.zones import local_zone

JOURNAL_REMOTE = Path("/lib/systemd/systemd-journal-remote")
XID = "NVRM: Xid (PCI:0000:17:00): 79, pid=1234, name=python3, GPU has fallen off the bus."
MISMATCH = (
    b"NVRM: API mismatch: the client 'nvidia-smi' (pid 4242)\n"
    b"NVRM: has the version 570.1, but this kernel module has\n"
    b"NVRM: the version 565.2.  Please\n"
    b"NVRM: make sure that this kernel module and all NVIDIA driver\n"
    b"NVRM: components have the same version."
)
KERNEL = {
    "_TRANSPORT": "kernel",
    "PRIORITY": "3",
    "SYSLOG_FACILITY": "0",
    "SYSLOG_IDENTIFIER": "kernel",
}
Field = str | bytes
RECORDS: list[dict[str, Field]] = [
    {**KERNEL, "_SOURCE_MONOTONIC_TIMESTAMP": "123456000", "MESSAGE": XID},
    {
        "_TRANSPORT": "stdout",
        "PRIORITY": "6",
        "SYSLOG_IDENTIFIER": "gpuwarden",
        "_PID": "99",
        "MESSAGE": "event text=" + XID,
    },
    {
        **KERNEL,
        "MESSAGE": b"Out of memory: Killed process 9876 (py\xfft) total-vm:1kB, anon-rss:1kB",
    },
    {**KERNEL, "MESSAGE": MISMATCH},
    {
        "_TRANSPORT": "kernel",
        "PRIORITY": "3",
        "SYSLOG_FACILITY": "1",
        "SYSLOG_IDENTIFIER": "forger",
        "MESSAGE": "NVRM: Xid (PCI:0000:18:00): 48, pid=1, name=x, DBE (Double Bit Error)",
    },
    {
        "_TRANSPORT": "syslog",
        "PRIORITY": "3",
        "SYSLOG_FACILITY": "0",
        "SYSLOG_IDENTIFIER": "kernel",
        "MESSAGE": "NVRM: Xid (PCI:0000:19:00): 48, pid=1, name=x, DBE (Double Bit Error)",
    },
    {**KERNEL, "MESSAGE": "INFO: task python3:4321 blocked for more than 120 seconds."},
]
USER_SPACE = 3
"""RECORDS from user space that hold a finding's words."""


class Seen(NamedTuple):
    kind: str
    what: object


EXPECTED = [
    Seen("xid", 79),
    Seen("oom_kill", "py\ufffdt"),
    Seen("driver_mismatch", "565.2"),
    Seen("hung_task", "python3"),
]
STRUCTURED = ("json", "json-seq", "json-sse", "json-pretty", "export", "verbose")
SHORT = (
    "short",
    "short-precise",
    "short-iso",
    "short-iso-precise",
    "short-full",
    "short-unix",
    "short-monotonic",
    "short-delta",
    "with-unit",
)


def _field(name: str, value: Field) -> bytes:
    if isinstance(value, bytes):  # the export format's binary form
        return name.encode() + b"\n" + struct.pack("<Q", len(value)) + value + b"\n"
    return f"{name}={value}\n".encode()


DECEMBER: Final = 1764650000000000
"""The first record's wall time, microseconds: 2025-12-02 04:33:20 UTC."""
JANUARY: Final = 1767450000000000
"""2026-01-03 14:20:00 UTC: a month that ja_JP and ko_KR pad with a space (` 1月`)."""


def _record_fields(
    index: int, record: dict[str, Field], start: int = DECEMBER
) -> list[tuple[str, bytes]]:
    head: dict[str, Field] = {
        "__REALTIME_TIMESTAMP": str(start + index * 1_000_000),
        "__MONOTONIC_TIMESTAMP": str(123456789 + index),
        "_BOOT_ID": "0123456789abcdef0123456789abcdef",
        "_HOSTNAME": "gpu1",
    }
    return [(k, _field(k, v)) for k, v in {**head, **record}.items()]


def export_bytes(records: list[dict[str, Field]], start: int = DECEMBER) -> bytes:
    return b"".join(
        b"".join(data for _, data in _record_fields(i, r, start)) + b"\n"
        for i, r in enumerate(records)
    )


def _make_journal(where: Path, start: int) -> Path:
    for program in (str(JOURNAL_REMOTE), "journalctl"):
        if shutil.which(program) is None:
            pytest.fail(f"{program} is missing: `make test` installs systemd-journal-remote")
    (where / "in.export").write_bytes(export_bytes(RECORDS, start))
    path = where / "node.journal"
    subprocess.run(
        [str(JOURNAL_REMOTE), f"--output={path}", str(where / "in.export")],
        check=True,
        capture_output=True,
    )
    return path


@pytest.fixture(scope="module")
def journal(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make_journal(tmp_path_factory.mktemp("journal"), DECEMBER)


def journalctl(journal: Path, *args: str, env: dict[str, str] | None = None) -> bytes:
    return subprocess.run(
        ["journalctl", "--file", str(journal), "--no-pager", *args],
        check=True,
        capture_output=True,
        env=env,
    ).stdout


def scan_bytes(data: bytes, tmp_path: Path) -> tuple[list[Finding], ParseStats, MatcherSet]:
    path = tmp_path / "saved"
    path.write_bytes(data)
    stats, matchers = ParseStats(), MatcherSet()
    with path.open("rb") as handle:
        findings = scan_lines(saved_lines(handle, str(path)), stats, matchers)
    return findings, stats, matchers


def _kinds(findings: list[Finding]) -> list[Seen]:
    return [
        Seen(f.kind, f.code or f.process or f.attributes.get("module_version")) for f in findings
    ]


@pytest.mark.parametrize("mode", STRUCTURED)
def test_structured_modes_find_the_kernels_records_and_no_others(
    journal: Path, mode: str, tmp_path: Path
) -> None:
    """Every record whole (the bytes, the five lines of the mismatch); the three that quote the
    kernel from user space are ignored and counted; each finding's line is its MESSAGE's."""
    data = journalctl(journal, "-o", mode, "--all")
    findings, stats, matchers = scan_bytes(data, tmp_path)
    assert _kinds(findings) == EXPECTED
    assert sum(matchers.ignored.values()) == USER_SPACE
    assert stats.lines == data.count(b"\n")
    lines = data.split(b"\n")
    for finding in findings:
        assert b"MESSAGE" in lines[finding.line - 1], (mode, finding.line)
    assert stats.left_out == 0


@pytest.mark.parametrize("mode", SHORT)
def test_short_modes_find_the_kernels_records(journal: Path, mode: str, tmp_path: Path) -> None:
    """The short modes carry only the identifier: a program's own line (with its pid) is
    not the kernel's; the kernel's records are all found, the bytes decoded by journalctl."""
    findings, _, matchers = scan_bytes(journalctl(journal, "-o", mode, "--all"), tmp_path)
    _assert_the_kernels_findings(findings, matchers, mode)


CJK = ("zh_CN", "ja_JP", "ko_KR")


class CjkJournals(NamedTuple):
    locpath: Path
    """The CJK locales compiled (LOCPATH)."""
    journals: dict[str, Path]
    """The same records in December, and in January, whose month ja_JP and ko_KR pad."""


@pytest.fixture(scope="module")
def cjk(tmp_path_factory: pytest.TempPathFactory) -> CjkJournals:
    return CjkJournals(
        compile_locales(CJK, tmp_path_factory.mktemp("locales")),
        {
            "december": _make_journal(tmp_path_factory.mktemp("december"), DECEMBER),
            "january": _make_journal(tmp_path_factory.mktemp("january"), JANUARY),
        },
    )


CJK_MONTHS = {
    ("zh_CN", "december"): "12月 02",
    ("zh_CN", "january"): "\n1月 03",
    ("ja_JP", "december"): "12月 02",
    ("ja_JP", "january"): "\n 1月 03",
    ("ko_KR", "december"): "12월 02",
    ("ko_KR", "january"): "\n 1월 03",
}
"""How each locale writes the journals' month and day (`%b %d`), UTC."""


@pytest.mark.parametrize("mode", ["short", "short-precise", "short-full", "with-unit"])
@pytest.mark.parametrize(("locale", "month"), sorted(CJK_MONTHS))
def test_short_modes_in_a_cjk_locale_find_the_kernels_records(
    cjk: CjkJournals, locale: str, month: str, mode: str, tmp_path: Path
) -> None:
    """journalctl under zh_CN, ja_JP, ko_KR writes the month as its number and 月 or 월 (ja_JP
    and ko_KR pad 1 to 9 with a space, which starts the line): the same findings as in
    English, a program's line still not the kernel's, and every finding has its stamp's time
    (systemd 252 writes short-full's and with-unit's day in English whatever the locale)."""
    env = {**environment(locale, cjk.locpath), "TZ": "UTC"}
    data = journalctl(cjk.journals[month], "-o", mode, "--all", env=env)
    if mode in ("short", "short-precise"):
        assert CJK_MONTHS[locale, month].encode() in b"\n" + data
    findings, stats, matchers = scan_bytes(data, tmp_path)
    _assert_the_kernels_findings(findings, matchers, mode)
    assert stats.bad_timestamps == 0
    with local_zone("UTC0"):
        times = [read_stamp(f.record) for f in findings]
    assert None not in times, [f.record.timestamp for f in findings]


def _assert_the_kernels_findings(findings: list[Finding], matchers: MatcherSet, mode: str) -> None:
    kinds = _kinds(findings)
    for seen in (Seen("xid", 79), Seen("oom_kill", "py\ufffdt"), Seen("hung_task", "python3")):
        assert seen in kinds, (mode, kinds)
    assert [s.kind for s in kinds].count("driver_mismatch") == 1
    assert kinds.count(Seen("xid", 79)) == 1  # the program's quote of it is not a finding
    assert sum(matchers.ignored.values()) >= 1


def test_a_message_journalctl_left_out_is_counted_and_scan_warns(
    journal: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --all the short modes print `[68B blob data]` for the record in bytes: it
    cannot be read, so scan says so and does not exit clean, however clean the rest."""
    data = journalctl(journal, "-o", "short-precise")
    assert b"blob data]" in data
    findings, stats, _ = scan_bytes(data, tmp_path)
    assert stats.left_out == 1
    assert Seen("oom_kill", "py\ufffdt") not in _kinds(findings)
    only_blob = b"\n".join(line for line in data.split(b"\n") if b"blob data" in line) + b"\n"
    path = tmp_path / "blob.log"
    path.write_bytes(only_blob)
    code = cli_main(["scan", str(path)])
    err = capsys.readouterr().err
    assert code == 1
    assert "journalctl --all" in err.replace("\n", " ")


def test_a_journal_file_is_read_through_journalctl(
    journal: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli_main(["scan", "--json", str(journal)])
    out, _ = capsys.readouterr()
    found = [json.loads(line) for line in out.splitlines()]
    assert [
        (f["kind"], f.get("xid") or f.get("process") or f.get("module_version")) for f in found
    ] == [tuple(s) for s in EXPECTED]
    assert code == 2


def test_a_journal_file_without_journalctl_says_what_to_run(
    journal: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    code = cli_main(["scan", str(journal)])
    err = capsys.readouterr().err.replace("\n", " ")
    assert code == 2
    assert f"journalctl --file {journal} _TRANSPORT=kernel -o export --all" in err


# -- the JSON objects, alone ---------------------------------------------------------------------


def _json(**fields: object) -> str:
    return json.dumps({"MESSAGE": XID, **fields}, separators=(",", ":"))


@pytest.mark.parametrize(
    ("fields", "facility"),
    [
        ({"_TRANSPORT": "kernel", "SYSLOG_FACILITY": "0"}, KERNEL_FACILITY),
        ({"_TRANSPORT": "kernel"}, KERNEL_FACILITY),
        ({"_TRANSPORT": "kernel", "SYSLOG_FACILITY": "1"}, USER_FACILITY),
        ({"_TRANSPORT": "kernel", "SYSLOG_FACILITY": "3"}, 3),
        ({"_TRANSPORT": "syslog", "SYSLOG_FACILITY": "0"}, USER_FACILITY),
        ({"_TRANSPORT": "stdout"}, USER_FACILITY),
        ({"_TRANSPORT": "journal", "SYSLOG_FACILITY": "4"}, 4),
        ({}, None),  # --output-fields=MESSAGE: nothing said, taken as given like dmesg
        ({"SYSLOG_FACILITY": "0"}, KERNEL_FACILITY),
    ],
)
def test_who_wrote_a_json_record(fields: dict[str, str], facility: int | None) -> None:
    record = parse_line(_json(**fields))
    assert record is not None
    assert record.format == "journal-json"
    assert record.facility == facility
    assert record.message == XID


@pytest.mark.parametrize("prefix", ["", "\x1e", "data: "], ids=["json", "json-seq", "json-sse"])
@pytest.mark.parametrize(
    ("message", "text"),
    [
        (XID, XID),
        (list(XID.encode()), XID),
        (list(b"caf\xc3\xa9 \xff"), "caf\u00e9 \ufffd"),
        ([XID, "second"], XID),  # a field with two values: the first
        ([list(XID.encode()), "second"], XID),
        (None, ""),
    ],
    ids=["text", "bytes", "not utf-8", "two values", "two values, bytes", "null"],
)
def test_a_json_message_in_each_form(prefix: str, message: object, text: str) -> None:
    line = prefix + json.dumps(
        {"MESSAGE": message, "_TRANSPORT": "kernel", "PRIORITY": "3"}, separators=(",", ":")
    )
    record = parse_line(line, 7)
    assert record is not None
    assert (record.message, record.line, record.level, record.facility) == (text, 7, 3, 0)


@pytest.mark.parametrize(
    "line",
    [
        '{"MESSAGE": "NVRM: Xid (PCI:0000:17:00): 79',  # cut short
        '{"__CURSOR":"s=1"}',  # no MESSAGE
        '{"a": [1, 2, 3]}',
        "{" + "[" * 100_000,
    ],
)
def test_a_broken_json_line_is_read_as_a_bare_line(line: str) -> None:
    record = parse_line(line)
    assert record is not None
    assert (record.format, record.message, record.facility) == ("plain", line, None)


def test_a_bytes_message_is_scanned_although_its_words_are_numbers(tmp_path: Path) -> None:
    """The prefilter looks for trigger words in the saved line: in bytes there are none."""
    line = json.dumps({"MESSAGE": list(XID.encode()), "_TRANSPORT": "kernel"})
    findings, _, _ = scan_bytes((line + "\n").encode(), tmp_path)
    assert _kinds(findings) == [Seen("xid", 79)]


def test_the_stamps_of_a_kernel_json_record() -> None:
    record = parse_line(
        _json(
            _TRANSPORT="kernel",
            __REALTIME_TIMESTAMP="1764650000123456",
            _SOURCE_MONOTONIC_TIMESTAMP="42000001",
        )
    )
    assert record is not None
    assert record.timestamp == "2025-12-02T04:33:20.123456+00:00"
    assert record.monotonic_usec == 42000001


# -- the export format, by its bytes -------------------------------------------------------------

_NAMES = st.sampled_from(["MESSAGE", "PRIORITY", "_TRANSPORT", "SYSLOG_IDENTIFIER", "X_Y"])
_VALUES = st.one_of(
    st.text(st.characters(blacklist_characters="\n", blacklist_categories=["Cs"]), max_size=40),
    st.binary(max_size=300),
)


@given(st.lists(st.dictionaries(_NAMES, _VALUES, min_size=1, max_size=5), max_size=6))
def test_export_records_keep_their_line_numbers(records: list[dict[str, Field]]) -> None:
    """One line out per `\\n` in (a binary field's length and bytes may hold any), each
    record's JSON on the line where its MESSAGE starts, its fields whole."""
    data = export_bytes(records)
    out = list(ExportReader([data[i : i + 7] for i in range(0, len(data), 7)]).lines())
    assert len(out) == data.count(b"\n")
    at = 0
    for index, record in enumerate(records):
        fields_bytes = _record_fields(index, record)
        names = [name for name, _ in fields_bytes]
        size = sum(data.count(b"\n") for _, data in fields_bytes) + 1
        if "MESSAGE" not in names:  # nothing of it is a message
            assert out[at : at + size] == [""] * size
            at += size
            continue
        before = names.index("MESSAGE")
        line = at + sum(data.count(b"\n") for _, data in fields_bytes[:before])
        fields = json.loads(out[line] or "{}")
        for name, value in record.items():
            assert fields[name] == (list(value) if isinstance(value, bytes) else value)
        at += size
    assert at == len(out)


def test_a_stream_that_is_not_the_export_format_is_passed_on_as_lines() -> None:
    data = b"__CURSOR=x\nMESSAGE\n\xff\xff\xff\xff\xff\xff\xff\x7f\nNVRM: rest\nmore\n"
    out = list(ExportReader([data]).lines())
    assert "NVRM: rest" in out
    assert "more" in out


def test_read_notes_say_what_the_file_was(journal: Path, tmp_path: Path) -> None:
    path = tmp_path / "saved.export"
    path.write_bytes(journalctl(journal, "-o", "export", "--all"))
    notes = ReadNotes()
    with path.open("rb") as handle:
        assert len(list(saved_lines(handle, str(path), notes))) > 0
    assert (notes.form, notes.problems) == ("text+export", [])


# -- dmesg --json (util-linux 2.38 and later) ------------------------------------------------------


def _dmesg(*args: str) -> bytes | None:
    """What this machine's dmesg writes, or None where it cannot (no --json, no access)."""
    done = subprocess.run(["dmesg", *args], capture_output=True, check=False)
    return done.stdout if done.returncode == 0 and done.stdout else None


def _found(data: bytes, tmp_path: Path) -> tuple[list[tuple[str, str]], int]:
    findings, _, matchers = scan_bytes(data, tmp_path)
    return [(f.kind, f.record.message) for f in findings], sum(matchers.ignored.values())


def test_dmesg_json_reads_as_dmesg_decode(tmp_path: Path) -> None:
    """This machine's own ring buffer: `dmesg --json -x` gives the findings `dmesg -x` gives,
    user-space records ignored alike (the `fac` field says who wrote each)."""
    as_json, decoded = _dmesg("--json", "-x"), _dmesg("-x")
    if as_json is None or decoded is None:
        pytest.skip("this dmesg cannot write JSON, or the ring buffer cannot be read")
    assert _found(as_json, tmp_path) == _found(decoded, tmp_path)


DMESG_JSON = """{
   "dmesg": [
      {
         "fac": "kern",
         "pri": "err",
         "time":    12.345678,
         "msg": "NVRM: Xid (PCI:0000:17:00): 79, pid=1234, name=python3, GPU has fallen off the bus."
      },{
         "fac": "user",
         "pri": "warn",
         "time":    13.000000,
         "msg": "NVRM: Xid (PCI:0000:18:00): 48, pid=1, name=x, DBE (Double Bit Error)"
      },{
         "pri": 3,
         "time":    14.000000,
         "msg": "INFO: task \\"py thon\\":4321 blocked for more than 120 seconds."
      },{
         "pri": 12,
         "time":    15.000000,
         "msg": "NVRM: Xid (PCI:0000:19:00): 48, pid=1, name=x, DBE (Double Bit Error)"
      }
   ]
}
"""


def test_dmesg_json_records_and_who_wrote_them(tmp_path: Path) -> None:
    """`fac` (with -x) or a `pri` over 7 names the facility; a bare level says nothing, as a
    dmesg line says nothing. Each finding is on its record's `msg` line; escapes are read."""
    data = DMESG_JSON.encode()
    findings, stats, matchers = scan_bytes(data, tmp_path)
    assert [(f.kind, f.line) for f in findings] == [("xid", 7), ("hung_task", 16)]
    assert findings[1].process == '"py thon"'
    assert sum(matchers.ignored.values()) == 2
    assert stats.lines == data.count(b"\n")


@pytest.mark.parametrize("mode", ["export", "verbose", "json-pretty"])
def test_a_record_without_a_message_says_nothing(journal: Path, mode: str, tmp_path: Path) -> None:
    """`--output-fields` without MESSAGE: a field that holds the driver's words (a program's
    command line) is no kernel message."""
    data = journalctl(journal, "-o", mode, "--all", "--output-fields=_TRANSPORT,_CMDLINE")
    data = data.replace(b"_TRANSPORT=kernel", b"_CMDLINE=echo " + XID.encode())
    data = data.replace(b'"_TRANSPORT" : "kernel"', b'"_CMDLINE" : "echo ' + XID.encode() + b'"')
    assert XID.encode() in data
    findings, _, _ = scan_bytes(data, tmp_path)
    assert findings == []
