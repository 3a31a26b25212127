"""Run a program without a shell, bounded in time, never blocking the loop.

The child gets its own process group (start_new_session), so a timeout kills it and whatever
it started (a hook that forks a `sleep` must not leave it behind, nor keep our pipes open).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

OUTPUT_LIMIT: Final = 4096
"""Bytes of standard output and error kept (a chatty program cannot fill memory)."""


@dataclass(frozen=True, slots=True)
class Outcome:
    returncode: int | None
    """None: it did not run to the end (not started, or killed at its timeout)."""
    stdout: str
    stderr: str
    timed_out: bool = False
    error: str = ""
    """Why it could not be started (no such program, not executable)."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def describe(self) -> str:
        if self.error:
            return self.error
        if self.timed_out:
            return "killed at its timeout"
        detail = (self.stderr or self.stdout).strip().splitlines()
        tail = f": {detail[-1][:200]}" if detail else ""
        return f"exit code {self.returncode}{tail}"


async def run(argv: Sequence[str], timeout: float, stdin: bytes | None = None) -> Outcome:
    """Run `argv`; its whole process group is killed at `timeout` seconds."""
    try:
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:
        return Outcome(None, "", "", error=f"cannot run {argv[0]}: {exc.strerror or exc}")
    try:
        out, err = await asyncio.wait_for(process.communicate(stdin), timeout)
    except TimeoutError:
        kill_group(process.pid)
        await _reap(process)
        return Outcome(None, "", "", timed_out=True)
    except asyncio.CancelledError:
        kill_group(process.pid)
        await asyncio.shield(_reap(process))
        raise
    return Outcome(process.returncode, _text(out), _text(err))


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


async def _reap(process: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        process.kill()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(process.wait(), 5.0)


def _text(data: bytes | None) -> str:
    return (data or b"")[-OUTPUT_LIMIT:].decode("utf-8", errors="replace")
