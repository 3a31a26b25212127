"""gpuwarden scan on rotated, compressed logs (`kern.log.2.gz`): what the real gzip, bzip2,
xz and zstd programs write reads as the log itself, in bounded pieces; a file cut short or
damaged keeps the findings before the fault and does not exit clean."""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.program.cli import main as cli_main
from agent.program.commands.scan import scan_lines
from collectors.kernel_log.lines import CHUNK_BYTES
from collectors.kernel_log.matchers import MatcherSet
from collectors.kernel_log.parse import ParseStats
from collectors.kernel_log.saved import ReadNotes, _inflate, _unpack, saved_lines
from tests.support.kmsg import FIXTURES

SHAPES = ("kmsg.txt", "dmesg.txt", "dmesg-T.txt", "dmesg-decode-iso.txt", "journalctl-k.txt")
PROGRAMS = {"gzip": "gzip", "bzip2": "bzip2", "xz": "xz", "zstd": "zstd"}


def compress(program: str, data: bytes) -> bytes:
    if shutil.which(program) is None:
        pytest.fail(f"{program} is missing: `make test` installs it")
    return subprocess.run([program, "-c"], input=data, check=True, capture_output=True).stdout


def scan_file(path: Path) -> tuple[list[tuple[object, ...]], ParseStats, ReadNotes]:
    stats, notes = ParseStats(), ReadNotes()
    with path.open("rb") as handle:
        findings = scan_lines(saved_lines(handle, str(path), notes), stats, MatcherSet())
    return [(f.kind, f.code, f.line, f.record.message) for f in findings], stats, notes


@pytest.mark.parametrize("program", PROGRAMS)
@pytest.mark.parametrize("shape", SHAPES)
def test_a_compressed_log_reads_as_the_log(program: str, shape: str, tmp_path: Path) -> None:
    plain = FIXTURES / shape
    packed = tmp_path / f"{shape}.{program}"
    packed.write_bytes(compress(program, plain.read_bytes()))
    expected, expected_stats, _ = scan_file(plain)
    found, stats, notes = scan_file(packed)
    assert expected
    assert found == expected
    assert stats.lines == expected_stats.lines
    assert (notes.form, notes.problems) == (program, [])


@pytest.mark.parametrize("program", PROGRAMS)
def test_every_member_of_a_concatenated_file_is_read(program: str, tmp_path: Path) -> None:
    """`cat a.gz b.gz > c.gz` is one file to gunzip (and to bzip2, xz and zstd)."""
    first = b"[    1.000000] nvme nvme0: I/O 12 QID 3 timeout, aborting\n"
    second = b"[    2.000000] NVRM: Xid (PCI:0000:17:00): 79, pid=1, name=x, GPU has fallen off the bus.\n"
    path = tmp_path / "two"
    path.write_bytes(compress(program, first) + compress(program, second))
    found, _, notes = scan_file(path)
    assert [(kind, line) for kind, _, line, _ in found] == [("nvme_error", 1), ("xid", 2)]
    assert notes.problems == []


def _log(lines: int) -> bytes:
    noise = b"[    1.000000] eth0: renamed from veth1234 and some words to make it longer\n"
    xid = b"[    2.000000] NVRM: Xid (PCI:0000:17:00): 79, pid=1, name=x, GPU has fallen off the bus.\n"
    return xid + noise * lines + xid


@pytest.mark.parametrize("program", PROGRAMS)
def test_a_file_cut_short_keeps_what_came_before(
    program: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Copied while logrotate was writing it: the first Xid is read, the reader says the file
    ends early, and scan does not exit clean even without a finding."""
    packed = compress(program, _log(200_000))
    path = tmp_path / "cut"
    path.write_bytes(packed[: len(packed) // 2])
    found, _, notes = scan_file(path)
    assert [line for _, _, line, _ in found] == [1]
    assert len(notes.problems) == 1
    code = cli_main(["scan", str(path)])
    err = capsys.readouterr().err.replace("\n", " ")
    assert code == 2
    assert "read up to there" in err


@pytest.mark.parametrize("program", ["gzip", "bzip2", "xz"])
def test_damaged_data_is_reported(program: str, tmp_path: Path) -> None:
    packed = bytearray(compress(program, _log(50_000)))
    middle = len(packed) // 2
    packed[middle : middle + 64] = bytes(64)
    path = tmp_path / "damaged"
    path.write_bytes(bytes(packed))
    found, _, notes = scan_file(path)
    assert notes.problems, notes
    assert [line for _, _, line, _ in found][:1] == [1]


def _bounded(chunks: Iterator[bytes]) -> int:
    largest = 0
    for chunk in chunks:
        largest = max(largest, len(chunk))
    return largest


@pytest.mark.parametrize("form", ["gzip", "bzip2", "xz"])
def test_a_small_file_that_inflates_to_much_is_read_a_chunk_at_a_time(form: str) -> None:
    """64 MiB of zeros packs into tens of kilobytes: each piece given out stays a chunk."""
    data = bytes(64 * 1024 * 1024)
    notes = ReadNotes()
    if form == "gzip":
        packed = gzip.compress(data, compresslevel=9)
        largest = _bounded(_inflate(iter([packed]), notes))
    elif form == "bzip2":
        packed = bz2.compress(data)
        largest = _bounded(_unpack(iter([packed]), bz2.BZ2Decompressor, form, notes))
    else:
        packed = lzma.compress(data)
        largest = _bounded(_unpack(iter([packed]), lzma.LZMADecompressor, form, notes))
    assert len(packed) < 1024 * 1024
    assert 0 < largest <= CHUNK_BYTES
    assert notes.problems == []


def test_standard_input_may_be_compressed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    data = gzip.compress((FIXTURES / "dmesg.txt").read_bytes())

    class Stdin:
        buffer = io.BytesIO(data)

    monkeypatch.setattr("sys.stdin", Stdin)
    code = cli_main(["scan", "--json", "-"])
    out, _ = capsys.readouterr()
    assert code == 2
    assert [json.loads(line)["kind"] for line in out.splitlines()][:1] == ["xid"]


def test_zstd_without_the_program_says_what_to_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "kern.log.zst"
    path.write_bytes(compress("zstd", b"[ 1.0] hello\n"))
    monkeypatch.setattr(shutil, "which", lambda name: None)
    code = cli_main(["scan", str(path)])
    assert code == 2
    assert f"zstd -dc {path} | gpuwarden scan -" in capsys.readouterr().err.replace("\n", " ")


# -- encodings ------------------------------------------------------------------------------------

XID = "NVRM: Xid (PCI:0000:17:00): 79, pid=1, name=x, GPU has fallen off the bus."


@pytest.mark.parametrize(
    ("data", "form"),
    [
        (f"<3>[    1.000000] {XID}\n<14>[    2.000000] {XID}\n".encode("utf-8-sig"), "text"),
        (
            f"<3>[    1.000000] {XID}\r\n<14>[    2.000000] {XID}\r\n".encode("utf-16"),
            "text+utf-16",
        ),
        (
            f"<3>[    1.000000] {XID}\n<14>[    2.000000] {XID}\n".encode("utf-16-be"),
            "text+utf-16",
        ),
    ],
    ids=["utf-8 with a byte-order mark", "utf-16 with one (PowerShell)", "utf-16 without one"],
)
def test_a_byte_order_mark_says_how_to_read_the_file(
    data: bytes, form: str, tmp_path: Path
) -> None:
    """A mark before the first line no longer hides its shape (`<3>` read as the kernel's,
    `<14>` as user space); UTF-16 with its mark, or known by its NUL bytes without one,
    reads as the log."""
    path = tmp_path / "saved.log"
    path.write_bytes(data)
    found, _, notes = scan_file(path)
    assert notes.form == form
    assert [(kind, line) for kind, _, line, _ in found] == [("xid", 1)]


def test_a_log_with_holes_is_not_taken_for_utf16(tmp_path: Path) -> None:
    """NUL bytes where a crash left a hole are text's, not every second byte."""
    path = tmp_path / "holes.log"
    path.write_bytes(b"\x00" * 64 + f"[    1.000000] {XID}\n".encode())
    found, stats, notes = scan_file(path)
    assert notes.form == "text"
    assert [kind for kind, *_ in found] == ["xid"]
    assert stats.holes == 1
