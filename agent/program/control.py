"""The running agent's control socket: `gpuwarden pause`, `resume` and `repairs` reach it here.

A Unix stream socket, `control.sock` in the state directory. Why this and not a signal or
the HTTP endpoint:

- who may use it is the file system's and the kernel's say, twice: the state directory is
  0700 and the socket 0600, both the agent's user's (systemd's StateDirectory=), and each
  connection's peer credentials (SO_PEERCRED) must be root's or the agent's own uid. The HTTP
  endpoint listens on the network for scrapes; a command that blinds the node's GPU
  monitoring does not belong there, whatever its password;
- it works under the hardened unit as it is: AF_UNIX is allowed, the state directory is
  writable under ProtectSystem=strict, and root reaches it without joining any group;
- it answers: the command learns whether NVML was really shut down and the device files
  closed (or why not), and what the first round after a resume found. A signal carries no
  duration, no reason and no answer, and needs the agent's pid.

One request per connection: a JSON object on one line, `{"op": "pause", "seconds": 600,
"reason": "..."}`, `{"op": "resume"}`, `{"op": "repairs"}` (the requirements held) or
`{"op": "clear_repairs", "subject": "...", "reason": "..."}` (`gpuwarden repairs clear`);
one JSON object back.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import pwd
import socket
import stat
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import structlog

from agent.contracts.errors import CallStillHung, CallTimedOut, ModelError
from agent.contracts.json_text import parse_json
from agent.contracts.model import (
    ActiveRepair,
    MetricFamily,
    MetricType,
    RepairAction,
    Sample,
    Severity,
)
from agent.program.control_client import reachable
from agent.runtime.blocking import CallPool, PooledCaller
from agent.runtime.core import Runtime
from agent.runtime.pause import PauseRefused
from exporters.listener import ACCEPT_FAILURES, AcceptFailures, Listener

log = structlog.get_logger(component="control")

REQUEST_LIMIT: Final = 4096
"""Bytes a request may have: a reason of a line, not a file."""
READ_TIMEOUT: Final = 5.0
CHECK_INTERVAL: Final = 2.0
"""Seconds between looks at the socket file (one lstat), and between binds tried while it is
not there: an operator who frees the disk, or removes what took its place, can pause within
that."""
LOOK_TIMEOUT: Final = 2.0
"""Seconds a look at the socket file (or a bind) may take in its thread: the state dir on a
file server that stopped answering leaves it hung there, and the loop goes on."""
BACKLOG: Final = 64
"""Connections the kernel queues while the agent cannot accept (out of files, a busy loop)."""


ACCEPT_FAILED = MetricFamily(
    "gpuwarden_control_accept_failed_total",
    MetricType.COUNTER,
    "Connections to the control socket that could not be accepted: out_of_files (EMFILE and "
    "the like), aborted, other",
    ("reason",),
)


SOCKET_UP = MetricFamily(
    "gpuwarden_control_socket_up",
    MetricType.GAUGE,
    "1 while the control socket (gpuwarden pause, resume, repairs) is bound at its path and "
    "the agent's; 0 while it is not (a bind that failed, the file removed or replaced): the "
    "health problem says why",
)


def _peer(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end, as the kernel saw it connect."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", raw)
    return pid, uid


def _listener(path: Path) -> str | None:
    """Who listens on the socket at `path` ("pid N, user U"), or None when nobody does (a
    stale socket: refused). Never waits: a listener whose queue is full is still one."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)
    try:
        with reachable(path) as name:
            probe.connect(name)
        pid, uid = _peer(probe)
    except (BlockingIOError, InterruptedError):
        return "a process whose queue is full"
    except (ConnectionRefusedError, FileNotFoundError):
        return None
    except OSError as exc:  # cannot tell: not this agent's to take
        return f"one this agent cannot reach: {exc.strerror or exc}"
    finally:
        probe.close()
    return f"pid {pid}, user {_user(uid)}"


def _identity(found: os.stat_result) -> tuple[int, int, int]:
    """A file's identity: its inode, and when it was made (a file removed and another made
    may get the same inode number; the ctime tells them apart)."""
    return found.st_dev, found.st_ino, found.st_ctime_ns


def _said(exc: OSError) -> str:
    """The problem as `_bind` put it (its strerror), or the error itself."""
    return exc.strerror if isinstance(exc.strerror, str) and exc.strerror else str(exc)


def _file_kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISLNK(mode):
        return "symbolic link"
    if stat.S_ISREG(mode):
        return "regular file"
    return "file of another kind"


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


class ControlServer:
    def __init__(
        self, runtime: Runtime, path: Path, hangs: Callable[[], bool] = lambda: False
    ) -> None:
        """`hangs`: whether the state dir hangs now (then nothing at the path is touched)."""
        self.runtime = runtime
        self.path = path
        self._server: Listener | None = None
        self._hangs = hangs
        self._bound: tuple[int, int, int] | None = None
        """The socket file this agent bound (`_identity`): another at the path is not its."""
        self._keeper: asyncio.Task[None] | None = None
        self._dir_fd: int | None = None
        # Every look at the file system (lstat, bind, unlink) runs in a thread of its own:
        # the state dir may hang (a file server gone) after the store's probe answered.
        self._pool = CallPool(1, "gpuwarden-control")
        self._caller = PooledCaller(self._pool, LOOK_TIMEOUT)
        self.problem: str | None = None
        """Why the socket is not there (with its path and the cause), for health; None: it is."""
        self.accept_failures = AcceptFailures(
            "control",
            "control socket cannot accept connections; retrying",
            "out of files: raise LimitNOFILE= in the unit, or find what holds them",
        )

    def families(self) -> Sequence[MetricFamily]:
        return (ACCEPT_FAILED, SOCKET_UP)

    def samples(self) -> Sequence[Sample]:
        # Every reason, from 0 (a rate() over a series that appears late misses its start).
        counts = self.accept_failures.counts
        return [
            *(ACCEPT_FAILED.sample(counts[r], r) for r in ACCEPT_FAILURES),
            SOCKET_UP.sample(0.0 if self._server is None or self.problem else 1.0),
        ]

    def _protocol(self) -> asyncio.StreamReaderProtocol:
        return asyncio.StreamReaderProtocol(asyncio.StreamReader(limit=REQUEST_LIMIT), self._client)

    def _cannot_accept(self, exc: OSError) -> bool:
        """Out of files (or another failed accept): counted, said at most once a minute; the
        listener retries shortly. Nothing is given up for room: a control connection is a
        local operator's, and is done within READ_TIMEOUT."""
        self.accept_failures.note(exc)
        return False

    def attach(self) -> None:
        """Hand the runtime this socket's series and its health problem (once): from the start
        on, whether it binds or not."""
        if self not in self.runtime.metrics.sources:
            self.runtime.metrics.sources.append(self)
        if self.problems not in self.runtime.problem_sources:
            self.runtime.problem_sources = (*self.runtime.problem_sources, self.problems)

    def _hold_dir(self) -> None:
        """Hold the state dir open (O_PATH: no read, no lock): the command line tells from
        it that this agent runs while its socket is not there (control_client.running_agent)."""
        if self._dir_fd is None:
            with contextlib.suppress(OSError):
                self._dir_fd = os.open(self.path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)

    def problems(self) -> Sequence[str]:
        return () if self.problem is None else (self.problem,)

    async def start(self) -> None:
        """Bind the socket, and keep it bound: every CHECK_INTERVAL seconds (`keep`) the
        file at the path is looked at, and a socket that is not there (a bind that failed,
        the file removed or replaced) is bound again once it can be. Raises OSError, with the
        problem health says, when the first bind fails; the keeping goes on regardless."""
        self.attach()
        try:
            await self.check()
        finally:
            self.keep()
        if self.problem is not None:
            raise OSError(self.problem)
        log.info("control socket ready", path=str(self.path))

    def keep(self) -> None:
        """Start looking after the socket (`start` does; a state dir that hangs at start is
        looked at only once it is on the disk again)."""
        self.attach()
        if self._keeper is None:
            self._keeper = asyncio.get_running_loop().create_task(self._keep())

    async def _keep(self) -> None:
        while True:
            await asyncio.sleep(CHECK_INTERVAL)
            try:
                await self.check()
            except Exception as exc:  # nothing ends the keeping: said, and looked at again
                self._unavailable(
                    f"control socket {self.path} not available ({type(exc).__name__}: {exc}): "
                    "pause and resume cannot reach this agent"
                )

    async def check(self) -> None:
        """One look: the socket still there and ours, or bound again, or the problem said."""
        if self._hangs():
            # Its socket is in the state dir, which hangs: a bind there would hold a thread.
            self._unavailable(
                f"control socket {self.path} not available (the state dir hangs): pause and "
                "resume cannot reach this agent; bound once the state dir answers"
            )
            return
        try:
            bound = await self._caller.call("control:look", self._look)
        except (CallTimedOut, CallStillHung):
            self._unavailable(
                f"control socket {self.path} not looked at: the state dir did not answer "
                f"within {LOOK_TIMEOUT:g} s (a hung file server or disk); pause and resume "
                "may not reach this agent"
            )
            return
        except OSError as exc:
            self._unavailable(_said(exc))
            return
        if bound is not None:
            sock, identity = bound
            if self._server is not None:
                # Removed (tmpfiles, an operator's rm) or replaced: ours listened on a name
                # that no longer led to it.
                log.warning("control socket gone from its path; bound again", path=str(self.path))
                self._server.close()
            try:
                # Not asyncio's start_unix_server: out of files, its listener logged a
                # traceback for every accept it tried, hundreds a second (exporters/listener.py).
                self._server = Listener(
                    [sock], self._protocol, self._cannot_accept, self.accept_failures.aborted
                )
            except BaseException:
                sock.close()
                self._server, self._bound = None, None
                raise
            self._bound = identity
        if self.problem is not None:
            log.info("control socket ready again", path=str(self.path), was=self.problem)
        self.problem = None

    def _look(self) -> tuple[socket.socket, tuple[int, int, int]] | None:
        """In the caller's thread: None while the socket at the path is still ours; else a
        new one bound and listening there (`_bind`), or the OSError that says why not."""
        self._hold_dir()
        if self._server is not None and self._still_ours():
            return None
        return self._bind()

    def _still_ours(self) -> bool:
        try:
            found = os.lstat(self.path)
        except FileNotFoundError:
            return False
        except OSError:  # cannot tell (a transient error): what listens is left as it is
            return True
        return _identity(found) == self._bound

    def _unavailable(self, problem: str) -> None:
        if problem != self.problem:
            log.error("control socket not available", path=str(self.path), problem=problem)
        self.problem = problem

    def _bind(self) -> tuple[socket.socket, tuple[int, int, int]]:
        """Bind and listen (in the caller's thread): the socket and its file's identity. What is at the path: nothing, or a stale socket (an agent killed
        before it removed it), replaced; a socket another process listens on (a second agent
        on this state dir), or anything else, is left alone and the OSError says so."""
        path = self.path
        unreachable = "pause and resume cannot reach this agent"
        try:
            found = os.lstat(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise OSError(
                exc.errno, f"control socket {path} not available ({exc.strerror}): {unreachable}"
            ) from None
        else:
            if not stat.S_ISSOCK(found.st_mode):
                raise OSError(
                    errno.EEXIST,
                    f"control socket {path} not available (a {_file_kind(found.st_mode)} is "
                    f"there, not a socket; left alone): {unreachable}; remove it and the agent "
                    f"binds within {CHECK_INTERVAL:g} s",
                )
            holder = _listener(path)
            if holder is not None:
                raise OSError(
                    errno.EADDRINUSE,
                    f"control socket {path} held by another process ({holder}): pause and "
                    f"resume reach that one, not this agent (pid {os.getpid()}); is a second "
                    "agent running on this state dir? bound once it is gone",
                )
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise OSError(
                    exc.errno,
                    f"control socket {path} not available (its stale socket cannot be "
                    f"removed: {exc.strerror}): {unreachable}; tried again every "
                    f"{CHECK_INTERVAL:g} s",
                ) from None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with reachable(path) as name:
                sock.bind(name)
            os.chmod(path, 0o600)
            bound = os.lstat(path)
            sock.listen(BACKLOG)
        except OSError as exc:
            sock.close()
            with contextlib.suppress(OSError):  # what this bind made, if it got that far
                if stat.S_ISSOCK(os.lstat(path).st_mode) and _listener(path) is None:
                    os.unlink(path)
            raise OSError(
                exc.errno,
                f"control socket {path} not available ({exc.strerror or exc}): {unreachable}; "
                f"tried again every {CHECK_INTERVAL:g} s",
            ) from None
        except BaseException:
            sock.close()
            raise
        return sock, _identity(bound)

    async def stop(self) -> None:
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
        dir_fd, self._dir_fd = self._dir_fd, None
        if dir_fd is not None:
            os.close(dir_fd)
        server, self._server = self._server, None
        if server is None:  # never bound (a state dir that hangs): nothing of ours is there
            self._pool.shutdown(wait=False, cancel_futures=True)
            return
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 1.0)
        # Only our own: a socket that replaced it (another agent's) is not this stop's. In
        # a thread: a state dir that hangs holds that thread, never the stop.
        if not self._caller.hung:  # its one thread is not stuck in the state dir
            with contextlib.suppress(CallTimedOut, CallStillHung, OSError):
                await self._caller.call("control:unlink", self._unlink_own)
        self._bound = None
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _unlink_own(self) -> None:
        if self._still_ours():
            os.unlink(self.path)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            reply = await self._serve(reader, writer)
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
        except (ConnectionError, TimeoutError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> dict[str, Any]:
        pid, uid = _peer(writer.get_extra_info("socket"))
        try:
            # Read before judging (bounded: 4 KiB, 5 s): a refused client then reads its
            # refusal, instead of a broken pipe in the middle of its request.
            line = await asyncio.wait_for(reader.readline(), READ_TIMEOUT)
        except (ValueError, asyncio.LimitOverrunError) as exc:
            line, error = b"", str(exc)
        else:
            error = ""
        if uid not in (0, os.geteuid()):
            log.warning("control request refused", peer_pid=pid, peer_uid=uid)
            return _error(f"refused: only root and the agent's user (uid {os.geteuid()}) may")
        try:
            if error:
                raise ValueError(error)
            request = parse_json(line)
        except ValueError as exc:
            return _error(f"expected one JSON object on a line: {exc}")
        if not isinstance(request, dict):
            return _error("expected a JSON object")
        by = _user(uid)
        claimed = request.get("by")
        if isinstance(claimed, str) and claimed and claimed != by:
            by += f" ({claimed[:64]})"  # as sudo said it: the socket sees root
        op = request.get("op")
        log.info("control request", op=op, by=by, peer_pid=pid)
        if op == "pause":
            return await self._pause(request, by)
        if op == "resume":
            reply = await self.runtime.pause.resume(by=by)
            return {
                "ok": True,
                "resumed": reply.resumed,
                "first_round": {
                    name: [e.message for e in events] for name, events in reply.first_round.items()
                },
                # What did not come back (a failed reset): the command's exit code says so.
                "critical": [
                    e.message
                    for events in reply.first_round.values()
                    for e in events
                    if e.severity is Severity.CRITICAL
                ],
                "waited_out": list(reply.waited_out),
            }
        if op == "status":
            state = self.runtime.pause_state()
            return {"ok": True, "paused": None if state is None else state.to_dict()}
        if op == "repairs":
            return {"ok": True, "repairs": [r.to_dict() for r in self.runtime.held_repairs()]}
        if op == "clear_repairs":
            return await self._clear_repairs(request, by)
        return _error(
            f"unknown op {op!r}: expected pause, resume, status, repairs or clear_repairs"
        )

    async def _clear_repairs(self, request: dict[str, Any], by: str) -> dict[str, Any]:
        """`{"op": "clear_repairs", "reason": "...", "subject"/"action"/"kind"/"source": ...}`
        or `"all": true`: every held requirement that matches each filter given."""
        filters: dict[str, str] = {}
        for name in CLEAR_FILTERS:
            value = request.get(name)
            if value is None:
                continue
            if not isinstance(value, str) or not value:
                return _error(f"{name}: expected a non-empty string, got {value!r}")
            filters[name] = value
        if "action" in filters:
            try:
                filters["action"] = RepairAction.parse(filters["action"]).value
            except ModelError as exc:
                return _error(f"action: {exc}")
        every = request.get("all", False)
        if not isinstance(every, bool):
            return _error(f"all: expected true or false, got {every!r}")
        if not filters and not every:
            return _error(
                "name what to clear (subject, action, kind, source), or all: nothing is "
                "cleared by default"
            )
        reason = request.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            return _error("reason: say why (the repair done, the GPU replaced): it is kept")
        chosen = [
            repair
            for repair in self.runtime.held_repairs()
            if all(_matches(repair, name, value) for name, value in filters.items())
        ]
        cleared = await self.runtime.clear_repairs(chosen, by, reason.strip()[:500])
        return {
            "ok": True,
            "cleared": [r.to_dict() for r in cleared],
            "held": [r.to_dict() for r in self.runtime.held_repairs()],
        }

    async def _pause(self, request: dict[str, Any], by: str) -> dict[str, Any]:
        seconds = request.get("seconds")
        if seconds is not None and (
            isinstance(seconds, bool) or not isinstance(seconds, (int, float))
        ):
            return _error(f"seconds: expected a number, got {seconds!r}")
        reason = request.get("reason", "")
        if not isinstance(reason, str):
            return _error("reason: expected a string")
        try:
            reply = await self.runtime.pause.pause(
                None if seconds is None else float(seconds), reason[:500], by
            )
        except PauseRefused as exc:
            return _error(str(exc))
        return {
            "ok": reply.ok,
            "extended": reply.extended,
            "paused": reply.state.to_dict(),
            "released": {
                r.component: {"released": r.released, "detail": r.detail} for r in reply.released
            },
        }


CLEAR_FILTERS: Final = ("subject", "action", "kind", "source")


def _matches(repair: ActiveRepair, name: str, value: str) -> bool:
    if name == "subject":  # any of its names: a GPU's UUID or its PCI address
        return value in repair.names
    return (repair.action.value if name == "action" else str(getattr(repair, name))) == value


def _error(message: str) -> dict[str, Any]:
    return {"ok": False, "error": message}
