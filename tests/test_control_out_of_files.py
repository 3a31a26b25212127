"""The control socket when the agent is out of files (EMFILE on accept): it neither stops nor
fills the log, and answers again once files are free.

A real agent process; its limit of open files is lowered from outside (prlimit, as a low
`LimitNOFILE=` or files held elsewhere in the process would leave it), and the files are used
up: by what the agent already holds (the limit set under its count), or by control clients
that connect and send nothing. asyncio's own listener, which the control socket used, logged
a traceback for each accept it tried, a hundred a second, until files came back.
"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.program.control_client import ControlError, reachable, request, socket_path
from tests.support.agent_proc import AgentProcess, http_get
from tests.support.waiting import wait_until

CONFIG = (
    "[collectors.gpu]\nenabled = false\n[collectors.benchmark]\nenabled = false\n"
    "[collectors.kernel_log]\nenabled = false\n"
)
OUT_FOR = 3.0
"""Seconds the agent is kept out of files: three of asyncio's retries."""


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@contextlib.contextmanager
def idle_clients(path: Path, count: int) -> Iterator[list[socket.socket]]:
    """`count` control connections that send nothing (those the kernel still queues)."""
    clients: list[socket.socket] = []
    try:
        with reachable(path) as name:
            for _ in range(count):
                client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                client.setblocking(False)
                try:
                    client.connect(name)
                except BlockingIOError:  # the backlog is full: not queued
                    client.close()
                    continue
                clients.append(client)
        yield clients
    finally:
        for client in clients:
            client.close()


def status(state_dir: Path, timeout: float) -> dict[str, object] | None:
    try:
        return request(state_dir, {"op": "status"}, timeout)
    except ControlError:
        return None


@pytest.mark.parametrize("taken_by", ["the-agent-itself", "idle-control-clients"])
def test_out_of_files_the_control_socket_is_quiet_and_comes_back(
    tmp_path: Path, taken_by: str
) -> None:
    agent = AgentProcess(tmp_path, config_text=CONFIG).start()
    assert agent.process is not None
    pid = agent.process.pid
    state_dir = tmp_path / "state"
    try:
        assert status(state_dir, 10.0) == {"ok": True, "paused": None}
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        held = open_files(pid)
        # No file more at all, or a few more, which the idle clients take.
        limit = held - 1 if taken_by == "the-agent-itself" else held + 4
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (limit, hard))
        try:
            with idle_clients(socket_path(state_dir), 0 if limit < held else 40):
                deadline = time.monotonic() + OUT_FOR
                while time.monotonic() < deadline:
                    # Queued, never accepted: no answer while every file is taken.
                    assert status(state_dir, 0.5) is None
        finally:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
        # Files are free again (the limit back, the idle clients gone): answered again.
        wait_until(lambda: status(state_dir, 2.0) is not None, 30, "a control answer")
        assert status(state_dir, 10.0) == {"ok": True, "paused": None}
        assert agent.process.poll() is None
        # Counted, as the HTTP listener's are: the failed accepts of the control socket.
        code, body = http_get(agent.metrics_url)
        assert code == 200
        failed = [
            float(line.rsplit(" ", 1)[1])
            for line in body.splitlines()
            if line.startswith('gpuwarden_control_accept_failed_total{reason="out_of_files"}')
        ]
        assert failed and failed[0] >= 1, [
            line for line in body.splitlines() if "accept_failed" in line
        ]
        assert 'gpuwarden_control_accept_failed_total{reason="other"} 0' in body.replace(
            ".0\n", "\n"
        )
    finally:
        agent.stop()
    log = agent.log().splitlines()
    told = [line for line in log if "accept" in line.lower() or "Too many open files" in line]
    # At most once a minute (each failure counted), not a line for each accept tried.
    assert 1 <= len(told) <= 3, (len(told), told[:6])
