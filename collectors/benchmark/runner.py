"""Runs the benchmark child process and turns whatever it does into an outcome.

The child gets its own process group, a timeout (the whole group is killed on expiry: a CUDA call
can spawn helpers, and a hung one ignores SIGTERM), a bounded stdout and the tail of its stderr.
A record, an error object, a crash, a timeout or garbage all become a `ChildOutcome`; nothing the
child does raises in the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import structlog

log = structlog.get_logger(component="benchmark")

PACKAGE_ROOT: Final = Path(__file__).resolve().parents[2]
"""The directory that holds the `collectors` package (this file is collectors/benchmark/runner.py)."""
STDOUT_LIMIT: Final = 1 << 20
"""The child prints one short line; more than this is garbage and is not kept."""
STDERR_TAIL: Final = 4096
REAP_TIMEOUT: Final = 10.0
"""After SIGKILL a process stuck in the driver (state D) may not die; do not wait forever."""

FAILURE_MESSAGES: Final[dict[str, str]] = {
    "timeout": "the benchmark did not finish in time and was killed",
    "crash": "the benchmark process crashed",
    "bad_output": "the benchmark process printed no result",
    "out_of_memory": "the GPU ran out of memory during the benchmark",
    "cuda_unavailable": "torch in the benchmark's Python cannot use CUDA",
    "driver_too_old": "the NVIDIA driver is too old for the CUDA runtime of the installed torch",
    "torch_missing": "torch is not installed for the benchmark's Python",
    "device_not_found": "the benchmark could not see the GPU it was pointed at",
    "wrong_device": "the benchmark ran on another GPU than the one it was pointed at",
    "invalid_argument": "the benchmark rejected its arguments",
    "error": "the benchmark failed",
}


@dataclass(frozen=True)
class ChildOutcome:
    record: dict[str, Any] | None
    """The child's record (exit 0 and a JSON object with the record fields), else None."""
    failure: str
    """"" on success, else a key of FAILURE_MESSAGES."""
    message: str
    exit_code: int | None
    """None when the child was killed on timeout or could not be started."""
    stderr_tail: str
    wall_seconds: float

    @property
    def ok(self) -> bool:
        return self.record is not None and not self.failure


def default_command(python: str = "") -> list[str]:
    return [python or sys.executable, "-m", "collectors.benchmark.child"]


def parse_child_output(stdout: bytes) -> dict[str, Any] | None:
    """The last line of stdout that is a JSON object; None if there is none."""
    for raw in reversed(stdout.decode("utf-8", errors="replace").splitlines()):
        line = raw.strip()
        if not line.startswith("{"):
            continue
        try:
            value = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            continue
        if isinstance(value, dict):
            return value
    return None


async def _read_head(stream: asyncio.StreamReader, limit: int) -> bytes:
    kept = bytearray()
    while chunk := await stream.read(65536):
        if len(kept) < limit:
            kept += chunk[: limit - len(kept)]
    return bytes(kept)


async def _read_tail(stream: asyncio.StreamReader, limit: int) -> bytes:
    kept = bytearray()
    while chunk := await stream.read(65536):
        kept += chunk
        del kept[:-limit]
    return bytes(kept)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


class LiveChildren:
    """The children a process's runners started that have not ended yet.

    A child killed (a reload that restarts the collector, a pause, its timeout) and stuck in
    the driver is not dead at SIGKILL: it stays in state D until the driver lets go, which
    may take long or never happen, and it still holds its GPU. The runner waits for it only
    up to REAP_TIMEOUT, and a reload's cancellation may cut that wait short; a child is
    known dead only once its exit is seen (asyncio reaps it, awaited or not). Shared by the
    benchmark collectors of one process (the runtime's SharedServices), so that the instance
    a reload makes knows the child of the one it replaced."""

    def __init__(self) -> None:
        self._processes: set[asyncio.subprocess.Process] = set()

    def add(self, process: asyncio.subprocess.Process) -> None:
        self._processes.add(process)

    def alive(self) -> list[int]:
        """The pids of the children not seen to exit yet."""
        self._processes = {p for p in self._processes if p.returncode is None}
        return sorted(p.pid for p in self._processes)


class ChildRunner:
    def __init__(
        self,
        command: Sequence[str] | None = None,
        timeout: float = 120.0,
        env: Mapping[str, str] | None = None,
        children: LiveChildren | None = None,
    ) -> None:
        self.command = list(command or default_command())
        self.timeout = timeout
        self.env = dict(env or {})
        self.children = children or LiveChildren()
        """Every child this runner started and that has not ended: the collector starts no
        other beside one (shared with the other runners of the process)."""
        self._running: asyncio.subprocess.Process | None = None
        self.stopped = False
        """While True (a pause), no child runs: one that starts is killed at once."""

    async def stop_children(self) -> bool:
        """Kill the running child's process group (a pause wants the GPU now), wait for it,
        and kill any that starts until `allow`; that run returns a failure. True when a child
        was running."""
        self.stopped = True
        process = self._running
        if process is None or process.returncode is not None:
            return False
        await self._kill_group(process)
        return True

    def allow(self) -> None:
        self.stopped = False

    def _environment(self, extra: Mapping[str, str]) -> dict[str, str]:
        env = {**os.environ, **self.env, **extra}
        # `-m collectors.benchmark.child` must import from this installation, whatever the cwd.
        path = env.get("PYTHONPATH", "")
        env["PYTHONPATH"] = f"{PACKAGE_ROOT}{os.pathsep}{path}" if path else str(PACKAGE_ROOT)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    async def run(
        self, arguments: Sequence[str], extra_env: Mapping[str, str] | None = None
    ) -> ChildOutcome:
        started = time.monotonic()
        try:
            process = await asyncio.create_subprocess_exec(
                *self.command,
                *arguments,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=self._environment(extra_env or {}),
                start_new_session=True,
            )
        except OSError as exc:
            return ChildOutcome(
                None,
                "crash",
                f"cannot start {self.command[0]}: {exc}",
                None,
                "",
                time.monotonic() - started,
            )
        assert process.stdout is not None
        assert process.stderr is not None
        self.children.add(process)
        self._running = process
        if self.stopped:  # stopped while it was being started
            await self._kill_group(process)
        try:
            return await self._wait(process, started)
        finally:
            self._running = None

    async def _wait(self, process: asyncio.subprocess.Process, started: float) -> ChildOutcome:
        assert process.stdout is not None
        assert process.stderr is not None
        out_task = asyncio.ensure_future(_read_head(process.stdout, STDOUT_LIMIT))
        err_task = asyncio.ensure_future(_read_tail(process.stderr, STDERR_TAIL))
        timed_out = False
        try:
            await asyncio.wait_for(process.wait(), self.timeout)
        except TimeoutError:
            timed_out = True
        except asyncio.CancelledError:  # the agent stops mid-run: the child must not outlive it
            await self._kill_group(process)
            out_task.cancel()
            err_task.cancel()
            raise
        if process.returncode is None:
            await self._kill_group(process)
        stdout, stderr = await self._collect(out_task, err_task)
        wall = time.monotonic() - started
        tail = stderr.decode("utf-8", errors="replace")
        if timed_out:
            return ChildOutcome(
                None,
                "timeout",
                f"no result within {self.timeout:g} s; its process group was killed",
                None,
                tail,
                wall,
            )
        return self._judge(process.returncode, parse_child_output(stdout), tail, wall)

    async def _kill_group(self, process: asyncio.subprocess.Process) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        try:
            await asyncio.wait_for(process.wait(), REAP_TIMEOUT)
        except TimeoutError:
            log.error(
                "benchmark child does not die after SIGKILL (stuck in the driver?)", pid=process.pid
            )

    @staticmethod
    async def _collect(
        out_task: asyncio.Future[bytes], err_task: asyncio.Future[bytes]
    ) -> tuple[bytes, bytes]:
        # A grandchild that escaped the group could hold the pipes open: bound the wait.
        done, pending = await asyncio.wait({out_task, err_task}, timeout=REAP_TIMEOUT)
        for task in pending:
            task.cancel()
        stdout = out_task.result() if out_task in done else b""
        stderr = err_task.result() if err_task in done else b""
        return stdout, stderr

    @staticmethod
    def _judge(
        code: int | None, output: dict[str, Any] | None, tail: str, wall: float
    ) -> ChildOutcome:
        if output is not None and "error" in output:
            kind = str(output.get("error"))
            kind = kind if kind in FAILURE_MESSAGES else "error"
            message = str(output.get("message", ""))[:1000]
            return ChildOutcome(None, kind, message, code, tail, wall)
        if code != 0:
            return ChildOutcome(None, "crash", _describe_exit(code or 0), code, tail, wall)
        if output is None or "median_seconds" not in output:
            return ChildOutcome(None, "bad_output", "no JSON record on stdout", code, tail, wall)
        return ChildOutcome(output, "", "", code, tail, wall)
