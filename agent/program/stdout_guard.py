"""A command's result that stdout does not take: said, with an exit code of its own.

`gpuwarden scan kern.log --json > findings.json` on a full disk leaves part of the findings,
or none, in the file. print() raised OSError, and the traceback ended the command with exit
1: what `scan` and `check` document as "warnings found", so a script that reads the code
took the cut file for a result. Here every write to stdout goes through `_Stdout`, which
turns a failed one (not a reader that left: that is BrokenPipeError, and each command
handles it) into `OutputNotWritten`; the command line catches it, says on stderr which
file did not take the output and why, and exits with EX_IOERR, 74 ("an error occurred while
doing I/O on some file", sysexits(3) of the BSDs, in glibc's <sysexits.h> too).

The daemons (`run`, `watch`) are left alone: their stdout is their log, not a result.
"""

from __future__ import annotations

import io
import os
import sys
from typing import TYPE_CHECKING, Final

from agent.contracts.errors import GpuwardenError

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

EX_IOERR: Final = 74


class OutputNotWritten(GpuwardenError):
    """Writing the command's output to stdout failed; `error` is the OS's reason."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error.strerror or str(error))
        self.error = error


class _Stdout(io.FileIO):
    def write(self, data: ReadableBuffer) -> int:
        try:
            return super().write(data)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OutputNotWritten(exc) from exc


def guard() -> None:
    """Send sys.stdout's writes through `_Stdout`, with its encoding and buffering kept. Only
    the process's own stdout: one a caller replaced (a test's capture) is not touched."""
    current = sys.__stdout__
    if current is None or sys.stdout is not current:
        return
    try:
        fd = current.fileno()
    except (OSError, ValueError):
        return
    current.flush()
    sys.stdout = io.TextIOWrapper(
        io.BufferedWriter(_Stdout(fd, "w", closefd=False)),
        encoding=current.encoding,
        errors=current.errors,
        line_buffering=current.line_buffering,
    )


def _where(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "stdout"


def not_written(exc: OutputNotWritten) -> int:
    """Say that the output was not written (what it went to and why) and give EX_IOERR.
    What is still buffered goes to /dev/null: the interpreter's flush at exit would fail on
    it again and print a traceback of its own."""
    fd = sys.stdout.fileno()
    where = _where(fd)
    os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
    print(
        f"gpuwarden: output not written: {exc} ({where}); what it holds is cut short",
        file=sys.stderr,
    )
    return EX_IOERR
