"""Saved kernel-log files cut into lines: on `\\n` only, in bounded pieces.

Only `\\n` ends a line. `str.splitlines()` (and text-mode files, which end a line at `\\r`) also
split on `\\r`, `\\x0b`, `\\x0c`, `\\x1c`-`\\x1e`, `\\x85` and U+2028/9, which dmesg writes raw
inside a message (util-linux prints what `isspace()` accepts as it is): one record would
become several and every later line number would drift.

A line longer than `MAX_LINE_BYTES` cannot be a kernel record (the kernel's longest is 8 KiB
escaped, a journal line 48 KiB by default): it comes out as None, once, and the reader skips
to its end without keeping it, however long it grows.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final, Protocol

MAX_LINE_BYTES: Final = 64 * 1024
CHUNK_BYTES: Final = 1024 * 1024
"""What `iter_lines` reads at a time."""


@dataclass(frozen=True, slots=True)
class Split:
    lines: list[str | None]
    """Complete lines, decoded; None for a line longer than the limit."""
    consumed: int
    """Bytes of the input the lines took: the rest starts the next line."""
    skipping: bool
    """The input ended inside a line too long to keep: skip to its `\\n` next time."""
    cut: bool = False
    """Stopped at `max_lines`, not at the end of the complete lines."""


def _nth_newline(data: bytes, start: int, count: int) -> int:
    position = start - 1
    for _ in range(count):
        position = data.index(b"\n", position + 1)
    return position


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def split_lines(
    data: bytes,
    *,
    skipping: bool = False,
    final: bool = False,
    max_lines: int | None = None,
    max_line: int | None = None,
) -> Split:
    """The complete lines at the start of `data`.

    `skipping`: `data` starts inside a line too long to keep (already counted). `final`: the
    end of `data` is the end of the file, so an unterminated last line is a line too.
    Otherwise an unterminated tail is left for the next call (a writer may be half-way
    through it), unless it is already too long, when it is reported and skipped.
    """
    max_line = MAX_LINE_BYTES if max_line is None else max_line
    start = 0
    if skipping:
        newline = data.find(b"\n")
        if newline < 0:
            return Split([], len(data), skipping=True)
        start = newline + 1
    end = max(start, data.rfind(b"\n") + 1)
    cut = max_lines is not None and data.count(b"\n", start, end) > max_lines
    if cut:
        assert max_lines is not None
        end = _nth_newline(data, start, max_lines) + 1
    lines: list[str | None] = []
    if end > start:
        # One decode and one split for the whole slice: the common case, and fast. (UTF-8
        # never makes a "\n" out of other bytes, so the lines are the same as the bytes'.)
        lines = list(_decode(data[start:end]).split("\n"))
        lines.pop()  # what follows the last "\n" of the slice: nothing
        # A character is 1 to 4 bytes: only with a line over a quarter of the limit can one
        # be too long; then measure them as bytes.
        if max(map(len, lines)) > max_line // 4:  # type: ignore[arg-type]
            parts = data[start:end].split(b"\n")[:-1]
            lines = [None if len(p) > max_line else _decode(p) for p in parts]
    if cut:
        return Split(lines, end, skipping=False, cut=True)
    tail = len(data) - end
    if tail > max_line:
        lines.append(None)
        return Split(lines, len(data), skipping=True)
    if final and tail:
        lines.append(_decode(data[end:]))
        return Split(lines, len(data), skipping=False)
    return Split(lines, end, skipping=False)


class Readable(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


def iter_lines(stream: Readable, chunk_bytes: int = CHUNK_BYTES) -> Iterator[str | None]:
    """Every line of a stream read to its end (a saved log, standard input), holding at most
    one chunk and one unfinished line in memory."""
    carry = b""
    skipping = False
    while chunk := stream.read(chunk_bytes):
        data = carry + chunk if carry else chunk
        split = split_lines(data, skipping=skipping)
        yield from split.lines
        skipping = split.skipping
        carry = data[split.consumed :]
    if carry:
        yield from split_lines(carry, final=True).lines
