"""Listening sockets that survive running out of files: the accepting under the /metrics
endpoints (exporters/http.py) and the agent's control socket (agent/program/control.py).

asyncio's own listener (`create_server`, `start_unix_server`), out of files (EMFILE on
accept: a low `LimitNOFILE=`, or files held elsewhere in the process), goes on with its burst
of accepts: it logs a traceback for each failed one and arms a retry timer for each, hundreds
a second, filling the log, while the socket answers nobody. Listener ends the burst at the
first failure, lets its owner make room (the endpoint gives up a waiting connection), waits
ACCEPT_BACKOFF (or a turn of the loop, where room was made) before the next accept, and
AcceptFailures says so at most once a minute, each failure counted.
"""

from __future__ import annotations

import asyncio
import errno
import resource
import socket
import time
from collections import Counter
from collections.abc import Callable

BACKLOG = 1024
"""Connections accepted in one burst at most (and the endpoint's listen backlog)."""
ACCEPT_BACKOFF = 0.1
"""Seconds before the next accept after one failed (out of files, say) where no room was
made."""
ACCEPT_LOG_EVERY = 60.0
"""Seconds between two warnings about accepts that failed (each failure is counted)."""
ACCEPT_FAILURES = ("out_of_files", "aborted", "other")
"""out of files: EMFILE, ENFILE, ENOBUFS, ENOMEM; aborted: ECONNABORTED, a connection given up
while queued (counted, never said: nothing is wrong here). POSIX lets a kernel return it for
a client that left while queued; Linux accepts that connection instead (a TCP one reset, in
state CLOSE; a Unix one with its peer gone), and its first read ends it: not counted
(tests/test_left_while_queued.py)."""
_OUT_OF_FILES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)

MakeRoom = Callable[[OSError], bool]
"""Told of a failed accept; whether it made room (gave up a connection) for the next."""


class AcceptFailures:
    """Accepts that failed, counted by reason (ACCEPT_FAILURES) in `counts`, and said at most
    once every ACCEPT_LOG_EVERY seconds: `message` and `action`, the error, how many failed
    since the last warning and the limit of open files."""

    def __init__(self, component: str, message: str, action: str) -> None:
        self.component = component
        self.message = message
        self.action = action
        self.counts: Counter[str] = Counter()
        self._told_at: float | None = None
        self._untold = 0

    def aborted(self) -> None:
        """An accept that failed with ECONNABORTED: counted, not said (the client left)."""
        self.counts["aborted"] += 1

    def note(self, exc: OSError) -> None:
        reason = "out_of_files" if exc.errno in _OUT_OF_FILES else "other"
        self.counts[reason] += 1
        self._untold += 1
        now = time.monotonic()
        if self._told_at is not None and now - self._told_at < ACCEPT_LOG_EVERY:
            return
        # Not at the top: exporters/http.py runs under the bare system interpreter too
        # (tests/support/tls_handshakes.py), which has no structlog.
        import structlog  # noqa: PLC0415 (a module already loaded: a dictionary look-up)

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        structlog.get_logger(component=self.component).warning(
            self.message,
            error=str(exc),
            failures=self._untold,
            open_files_limit=soft,
            action=self.action,
        )
        self._told_at, self._untold = now, 0


class Listener:
    """Listening sockets, each accepted connection handed to `protocol` as asyncio's Server
    would (connect_accepted_socket): what asyncio's Server offers its users (sockets, close,
    wait_closed, serve_forever, async with), with its own accepting.

    Like asyncio's, it accepts what the kernel has queued, up to BACKLOG at a time, before any
    of it is read (the endpoint then sheds a flood by eviction, without a request read).
    Unlike asyncio's, an accept that fails ends the burst: `make_room` is told (it counts and
    warns, and may give up a connection), and the listener waits ACCEPT_BACKOFF, or only a
    turn of the loop where room was made, before the next."""

    def __init__(
        self,
        sockets: list[socket.socket],
        protocol: Callable[[], asyncio.BaseProtocol],
        make_room: MakeRoom,
        aborted: Callable[[], None] = lambda: None,
    ) -> None:
        self._sockets = tuple(sockets)
        self._protocol = protocol
        self._make_room = make_room
        self._aborted = aborted
        self._loop = asyncio.get_running_loop()
        self._closed = self._loop.create_future()
        self._resume: dict[int, asyncio.TimerHandle] = {}
        self._connecting: set[asyncio.Task[None]] = set()
        for sock in self._sockets:
            sock.setblocking(False)
            self._loop.add_reader(sock.fileno(), self._ready, sock)

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        """The listening sockets; none once closed (as asyncio's Server)."""
        return () if self._closed.done() else self._sockets

    def _ready(self, sock: socket.socket) -> None:
        for _ in range(BACKLOG):
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return  # nothing more queued
            except ConnectionAbortedError:
                self._aborted()  # that client gave up while queued: counted, and on
                continue
            except OSError as exc:
                made_room = self._make_room(exc)
                fd = sock.fileno()
                self._loop.remove_reader(fd)
                delay = 0.0 if made_room else ACCEPT_BACKOFF
                self._resume[fd] = self._loop.call_later(delay, self._again, sock)
                return
            task = self._loop.create_task(self._connect(conn))
            self._connecting.add(task)
            task.add_done_callback(self._connecting.discard)

    def _again(self, sock: socket.socket) -> None:
        self._resume.pop(sock.fileno(), None)
        if not self._closed.done():
            self._loop.add_reader(sock.fileno(), self._ready, sock)

    async def _connect(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        try:
            await self._loop.connect_accepted_socket(self._protocol, conn)
        except OSError:
            conn.close()

    def close(self) -> None:
        """Stop accepting and close the sockets (the connections stay, as with asyncio's)."""
        if self._closed.done():
            return
        self._closed.set_result(None)
        for handle in self._resume.values():
            handle.cancel()
        for sock in self._sockets:
            if sock.fileno() >= 0:
                self._loop.remove_reader(sock.fileno())
            sock.close()
        for task in self._connecting:
            task.cancel()

    async def wait_closed(self) -> None:
        await asyncio.shield(self._closed)

    async def serve_forever(self) -> None:
        """Until cancelled (then closed) or closed."""
        try:
            await asyncio.shield(self._closed)
        finally:
            self.close()

    async def __aenter__(self) -> Listener:
        return self

    async def __aexit__(self, *_: object) -> None:
        self.close()
