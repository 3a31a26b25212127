"""Clients that leave while queued, before the agent accepts them: resets (SO_LINGER 0) on
/metrics, and control clients that close, while the agent is stopped (SIGSTOP) so that every
one of them is still in the kernel's queue when it accepts again.

What the listeners count: `aborted` (gpuwarden_http_accept_failed_total,
gpuwarden_control_accept_failed_total) is ECONNABORTED from accept(). Linux does not return
it for these: it hands such a connection to accept() like any other (a TCP one reset, in
state CLOSE; a Unix one whose peer is gone), and its first read ends it (measured on 6.18:
five resets queued, five accepts that succeed, then ECONNRESET on recv; a Unix client closed
before accept is accepted too). So here they are not failed accepts: `aborted` and `other`
stay 0, nothing is logged, and the next scraper and control client are answered. POSIX
(accept(2)) lets other kernels return ECONNABORTED instead; the listener counts that and
goes on (exporters/listener.py).
"""

from __future__ import annotations

import os
import signal
import socket
import struct
from pathlib import Path

import pytest

from agent.program.control_client import ControlError, reachable, request, socket_path
from tests.support.agent_proc import AgentProcess, http_get
from tests.support.waiting import wait_until

CONFIG = (
    "[collectors.gpu]\nenabled = false\n[collectors.benchmark]\nenabled = false\n"
    "[collectors.kernel_log]\nenabled = false\n"
)
QUEUED = 24
"""Clients of each socket that leave while queued: fewer than the control socket's backlog
(64), so that every one is queued."""
LEFT_WITH = {
    "nothing": b"",
    "part-of-a-request": b"GET /metr",
    "a-whole-request": b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
}
CONTROL_LEFT_WITH = {
    "nothing": b"",
    "part-of-a-request": b'{"op": "st',
    "a-whole-request": b'{"op": "status"}\n',
}
LINGER_0 = struct.pack("ii", 1, 0)


def leave(client: socket.socket, data: bytes) -> None:
    """Send `data` and leave at once: SO_LINGER 0 makes a TCP close a reset (RST), not a FIN."""
    if data:
        client.sendall(data)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_0)
    client.close()


def counters(body: str, name: str) -> dict[str, float]:
    prefix = name + '{reason="'
    found = {}
    for line in body.splitlines():
        if line.startswith(prefix):
            reason, _, value = line[len(prefix) :].partition('"} ')
            found[reason] = float(value)
    return found


def answers_status(state_dir: Path) -> bool:
    try:
        return request(state_dir, {"op": "status"}, 5.0).get("ok") is True
    except ControlError:
        return False


@pytest.mark.parametrize("left_with", list(LEFT_WITH))
def test_clients_that_leave_while_queued_are_no_failed_accepts(
    tmp_path: Path, left_with: str
) -> None:
    agent = AgentProcess(tmp_path, config_text=CONFIG).start()
    assert agent.process is not None
    state_dir = tmp_path / "state"
    try:
        assert answers_status(state_dir)
        os.kill(agent.process.pid, signal.SIGSTOP)  # nothing is accepted while it is stopped
        try:
            with reachable(socket_path(state_dir)) as name:
                for _ in range(QUEUED):
                    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    client.connect(name)  # queued: the backlog has room
                    leave(client, CONTROL_LEFT_WITH[left_with])
            for _ in range(QUEUED):
                client = socket.create_connection(("127.0.0.1", agent.port))  # the kernel's
                leave(client, LEFT_WITH[left_with])
        finally:
            os.kill(agent.process.pid, signal.SIGCONT)
        # Answered again: both listeners took their queue and went on.
        wait_until(lambda: answers_status(state_dir), 20, "a control answer")
        code, body = http_get(agent.metrics_url)
        assert code == 200
        for name in ("gpuwarden_http_accept_failed_total", "gpuwarden_control_accept_failed_total"):
            assert counters(body, name) == {"out_of_files": 0.0, "aborted": 0.0, "other": 0.0}, (
                name,
                [line for line in body.splitlines() if "accept_failed" in line],
            )
        assert agent.process.poll() is None
    finally:
        agent.stop()
    noisy = [
        line
        for line in agent.log().splitlines()
        if "Traceback" in line or any(f'"level": "{w}"' in line for w in ("warning", "error"))
    ]
    assert not noisy, noisy[:8]
    if left_with == "a-whole-request":
        # Accepted, not aborted: each request its client left behind was read and answered
        # (into a closed socket), one log line each, besides the first and last status.
        served = [line for line in agent.log().splitlines() if "control request" in line]
        assert len(served) >= QUEUED + 2, served[:4]
