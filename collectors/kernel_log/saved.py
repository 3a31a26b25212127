"""A saved kernel log's lines, whatever it was saved as: plain text, compressed (a rotated
`kern.log.2.gz`: gzip, bzip2, xz, zstd), the journal's export format, or a binary journal file
copied off a node.

What the content is, is known from its first bytes, never from the file's name. A compressed
file is decompressed as it is read, in bounded pieces (a small file that would decompress to
gigabytes is read like a large log, never held whole). zstd and journal files are read with
the `zstd` and `journalctl` programs when the host has them; without them, the error says
what to run. A compressed file that ends early (copied while being written) is read up to
there and the problem is reported: the findings before it are kept.
"""

from __future__ import annotations

import bz2
import codecs
import contextlib
import lzma
import shutil
import subprocess
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import BinaryIO, Final, Protocol

from agent.contracts.errors import GpuwardenError
from collectors.kernel_log.journal import ExportReader, assemble
from collectors.kernel_log.lines import CHUNK_BYTES, iter_lines

GZIP: Final = b"\x1f\x8b"
BZIP2: Final = b"BZh"
XZ: Final = b"\xfd7zXZ\x00"
ZSTD: Final = b"\x28\xb5\x2f\xfd"
JOURNAL: Final = b"LPKSHHRH"
"""The header signature of a systemd journal file (journal-def.h)."""
EXPORT_STARTS: Final = (b"__CURSOR=", b"__REALTIME_TIMESTAMP=", b"__MONOTONIC_TIMESTAMP=")


class SavedLogError(GpuwardenError, ValueError):
    """A saved log that cannot be read as it is; the message says what to run instead."""


@dataclass
class ReadNotes:
    """What reading the file saw beside its lines."""

    form: str = "text"
    """text, gzip, bzip2, xz, zstd, journal file; `+export` when it was in the export format."""
    problems: list[str] = field(default_factory=list)
    """Why the file was not read to its end (the findings before that are kept)."""


class _Decompressor(Protocol):
    @property
    def eof(self) -> bool: ...

    @property
    def unused_data(self) -> bytes: ...

    @property
    def needs_input(self) -> bool: ...

    def decompress(self, data: bytes, max_length: int = -1) -> bytes: ...


def _stream_chunks(stream: BinaryIO) -> Iterator[bytes]:
    while chunk := stream.read(CHUNK_BYTES):
        yield chunk


def _inflate(chunks: Iterable[bytes], notes: ReadNotes) -> Iterator[bytes]:
    """gzip, every member of it (concatenated members are one file to gunzip)."""
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    started = False
    try:
        for chunk in chunks:
            data = chunk
            while data:
                started = True
                out = inflater.decompress(data, CHUNK_BYTES)
                if out:
                    yield out
                data = inflater.unconsumed_tail
                if inflater.eof:
                    data = inflater.unused_data
                    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
                    started = False
        if rest := inflater.flush():  # what the last member's inflater still holds
            yield rest
    except zlib.error as exc:
        notes.problems.append(f"the gzip data is damaged ({exc}): read up to there")
        return
    if started and not inflater.eof:
        notes.problems.append("the gzip data ends before its end: read up to there")


def _unpack(
    chunks: Iterable[bytes], make: Callable[[], _Decompressor], what: str, notes: ReadNotes
) -> Iterator[bytes]:
    """bzip2 or xz, every stream of it, at most a chunk of output at a time."""
    decompressor = make()
    started = False
    try:
        for chunk in chunks:
            data = chunk
            while data or not (decompressor.needs_input or decompressor.eof):
                started = True
                out = decompressor.decompress(data, CHUNK_BYTES)
                data = b""
                if out:
                    yield out
                if decompressor.eof:
                    data = decompressor.unused_data
                    decompressor = make()
                    started = bool(data)
    except (OSError, EOFError, lzma.LZMAError) as exc:
        notes.problems.append(f"the {what} data is damaged ({exc}): read up to there")
        return
    if started and not decompressor.eof:
        notes.problems.append(f"the {what} data ends before its end: read up to there")


def _program_output(
    argv: list[str], feed: Iterable[bytes] | None, notes: ReadNotes, what: str
) -> Iterator[bytes]:
    """What a program writes for `argv`, `feed` written to its standard input by a thread."""
    process = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE if feed is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    stdout, stderr = process.stdout, process.stderr
    assert stdout is not None
    assert stderr is not None

    def write() -> None:
        stdin = process.stdin
        assert stdin is not None
        assert feed is not None
        with contextlib.suppress(OSError):  # the program stopped reading: its exit says why
            for chunk in feed:
                stdin.write(chunk)
        with contextlib.suppress(OSError):
            stdin.close()

    writer = threading.Thread(target=write, daemon=True) if feed is not None else None
    if writer is not None:
        writer.start()
    errors: list[bytes] = []
    reader = threading.Thread(target=lambda: errors.append(stderr.read()), daemon=True)
    reader.start()
    try:
        while chunk := stdout.read(CHUNK_BYTES):
            yield chunk
    finally:
        stdout.close()
        code = process.wait()
        reader.join()
        if writer is not None:
            writer.join()
        if code != 0:
            said = b"".join(errors).decode("utf-8", errors="replace").strip().splitlines()
            notes.problems.append(
                f"{what} failed (exit {code}{': ' + said[-1] if said else ''}): read up to there"
            )


def _raw_chunks(stream: BinaryIO, name: str, notes: ReadNotes) -> Iterator[bytes]:
    """The file's bytes as the log they hold: decompressed, a journal file exported."""
    head = stream.read(8)
    chunks = chain([head], _stream_chunks(stream))
    if head.startswith(GZIP):
        notes.form = "gzip"
        return _inflate(chunks, notes)
    if head.startswith(BZIP2):
        notes.form = "bzip2"
        return _unpack(chunks, bz2.BZ2Decompressor, "bzip2", notes)
    if head.startswith(XZ):
        notes.form = "xz"
        return _unpack(chunks, lzma.LZMADecompressor, "xz", notes)
    if head.startswith(ZSTD):
        notes.form = "zstd"
        zstd = shutil.which("zstd")
        if zstd is None:
            raise SavedLogError(
                f"{name} is zstd-compressed and this host has no zstd program: run "
                f"`zstd -dc {name} | gpuwarden scan -`"
            )
        return _program_output([zstd, "-dcq"], chunks, notes, "zstd")
    if head.startswith(JOURNAL):
        notes.form = "journal file"
        journalctl = shutil.which("journalctl")
        command = f"journalctl --file {name} _TRANSPORT=kernel -o export --all"
        if name == "-" or journalctl is None:
            raise SavedLogError(
                f"{name} is a binary systemd journal file: run `{command} | gpuwarden scan -`"
                if name != "-"
                else "standard input is a binary systemd journal file: scan the file itself "
                "(gpuwarden scan FILE) or its export (journalctl --file FILE "
                "_TRANSPORT=kernel -o export --all | gpuwarden scan -)"
            )
        stream.close()
        argv = [journalctl, "--file", str(Path(name)), "_TRANSPORT=kernel", "-o", "export"]
        return _program_output([*argv, "--all", "--no-pager"], None, notes, "journalctl")
    return chunks


class _Chunks:
    """Chunks as a stream `iter_lines` can read, the first few bytes looked at first."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._head = b""

    def head(self, size: int) -> bytes:
        while len(self._head) < size:
            chunk = next(self._chunks, b"")
            if not chunk:
                break
            self._head += chunk
        return self._head[:size]

    def drop(self, size: int) -> None:
        """Leave out the first `size` bytes (looked at with `head`)."""
        self.head(size)
        self._head = self._head[size:]

    def read(self, size: int = -1, /) -> bytes:
        if self._head:
            out, self._head = self._head, b""
            return out
        return next(self._chunks, b"")

    def __iter__(self) -> Iterator[bytes]:
        while chunk := self.read():
            yield chunk


def _utf16(chunks: Iterable[bytes], codec: str) -> Iterator[bytes]:
    """A UTF-16 file (PowerShell's `>` writes one) as UTF-8, a chunk at a time."""
    decoder = codecs.getincrementaldecoder(codec)(errors="replace")
    for chunk in chunks:
        if text := decoder.decode(chunk):
            yield text.encode("utf-8")
    if tail := decoder.decode(b"", final=True):
        yield tail.encode("utf-8")


def _text_chunks(chunks: _Chunks, notes: ReadNotes) -> _Chunks:
    """Text whatever its encoding's mark: a UTF-8 one is dropped, UTF-16 (with its mark, or
    known without one) is read as UTF-8: its lines would hold a NUL byte after each letter and
    match nothing."""
    head = chunks.head(4)
    if head.startswith(codecs.BOM_UTF8):
        chunks.drop(len(codecs.BOM_UTF8))
    elif head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        notes.form += "+utf-16"
        return _Chunks(_utf16(chunks, "utf-16"))
    elif (codec := _unmarked_utf16(chunks.head(64))) is not None:
        notes.form += "+utf-16"
        return _Chunks(_utf16(chunks, codec))
    return chunks


def _unmarked_utf16(head: bytes) -> str | None:
    """UTF-16 without a mark, known from its first bytes: every other one NUL (a kernel log
    holds NUL bytes only where a crash left a hole, never in every second place)."""
    if len(head) < 16:
        return None
    even, odd = head[0::2], head[1::2]
    if odd.count(0) == len(odd) and 0 not in even:
        return "utf-16-le"
    if even.count(0) == len(even) and 0 not in odd:
        return "utf-16-be"
    return None


def saved_lines(
    stream: BinaryIO, name: str, notes: ReadNotes | None = None
) -> Iterator[str | None]:
    """The lines of the saved log in `stream` (`name` for messages; `-` is standard input),
    cut as collectors/kernel_log/lines.py cuts them, the journal's multi-line modes made one
    line per record (collectors/kernel_log/journal.py). Raises SavedLogError, before any
    line, for a file that can be read only with a program this host lacks."""
    notes = notes if notes is not None else ReadNotes()
    chunks = _text_chunks(_Chunks(_raw_chunks(stream, name, notes)), notes)
    if chunks.head(32).startswith(EXPORT_STARTS):
        notes.form += "+export"
        return ExportReader(chunks).lines()
    return assemble(iter_lines(chunks))
