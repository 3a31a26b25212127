"""sd_notify against a real unix datagram socket; the watchdog withholds pings on a stall."""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.runtime.systemd import Notifier, Supervisor, run_watchdog, watchdog_interval
from tests.support.agent_proc import AgentProcess


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(10)
    yield sock, path
    sock.close()


def receive_all(sock: socket.socket, until: str, limit: int = 200) -> list[str]:
    messages: list[str] = []
    for _ in range(limit):
        messages.append(sock.recv(4096).decode())
        if until in messages[-1]:
            return messages
    raise AssertionError(f"{until!r} never arrived: {messages}")


class TestNotifier:
    """The datagrams systemd expects."""

    def test_messages(self, notify_socket: tuple[socket.socket, str]) -> None:
        sock, path = notify_socket
        notifier = Notifier(path)
        assert notifier.ready("ok")
        assert sock.recv(100) == b"READY=1\nSTATUS=ok"
        notifier.watchdog()
        assert sock.recv(100) == b"WATCHDOG=1"
        notifier.stopping()
        assert sock.recv(100) == b"STOPPING=1\nSTATUS=stopping"

    def test_full_queue_does_not_block(self, notify_socket: tuple[socket.socket, str]) -> None:
        """A receiver that never reads must not freeze the sender (the event loop)."""
        _, path = notify_socket
        notifier = Notifier(path)
        results = [notifier.watchdog() for _ in range(5000)]
        assert results[0] is True
        assert results[-1] is False  # dropped once the queue is full, not blocked

    def test_disabled_without_socket(self) -> None:
        notifier = Notifier("")
        assert not notifier.enabled
        assert not notifier.ready("ok")

    def test_abstract_namespace(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(b"\0gpuwarden-test-notify")
        sock.settimeout(5)
        try:
            Notifier("@gpuwarden-test-notify").watchdog()
            assert sock.recv(100) == b"WATCHDOG=1"
        finally:
            sock.close()

    def test_watchdog_interval(self) -> None:
        assert watchdog_interval({"WATCHDOG_USEC": "20000000"}) == 10.0
        assert watchdog_interval({}) is None
        assert watchdog_interval({"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": "1"}) is None


class TestWatchdog:
    """WATCHDOG=1 only while every supervised task makes progress."""

    async def test_pings_stop_when_a_task_stalls(
        self, notify_socket: tuple[socket.socket, str]
    ) -> None:
        sock, path = notify_socket
        sock.setblocking(False)
        clock = [0.0]
        supervisor = Supervisor(clock=lambda: clock[0])
        supervisor.register("collector:gpu", 5.0)
        task = asyncio.create_task(run_watchdog(Notifier(path), supervisor, 0.03, lambda: "ok"))
        await asyncio.sleep(0.1)
        before = drain(sock)
        assert "WATCHDOG=1" in before and "STATUS=ok" in before
        clock[0] = 10.0  # the collector has not beaten for 10 s, past its 5 s allowance
        await asyncio.sleep(0.1)
        stalled = drain(sock)
        assert "WATCHDOG=1" not in stalled
        assert "STATUS=stalled: collector:gpu" in stalled
        supervisor.beat("collector:gpu")
        await asyncio.sleep(0.1)
        assert "WATCHDOG=1" in drain(sock)
        task.cancel()


def drain(sock: socket.socket) -> list[str]:
    out: list[str] = []
    while True:
        try:
            out.extend(sock.recv(4096).decode().split("\n"))
        except BlockingIOError:
            return out


class TestAgentNotifies:
    """The real agent says READY, pings the watchdog and says STOPPING."""

    def test_ready_watchdog_stopping(
        self, notify_socket: tuple[socket.socket, str], agent_process: AgentProcess
    ) -> None:
        sock, path = notify_socket
        agent_process.env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"}
        agent_process.start(wait=False)
        messages = receive_all(sock, "READY=1")
        assert any(m.startswith("READY=1\nSTATUS=") for m in messages)
        assert receive_all(sock, "WATCHDOG=1")
        agent_process.signal(signal.SIGTERM)
        assert receive_all(sock, "STOPPING=1")
        assert agent_process.stop() == 0
