"""The control socket is not there while the agent runs: it is retried, said in health, and
found again once the cause is gone.

A real agent process on a real tmpfs state dir. The causes: a bind that fails at start (a
state dir out of inodes, or read-only, with or without a stale socket left there), the socket
file removed or replaced while the agent runs (tmpfiles or an operator's `rm`, a regular file
put there, another process's socket, a second agent started by mistake on the same state dir),
and the stale socket of a kill -9 (a guard: it worked before). Before, a bind that failed at
start was logged once and never tried again, health said nothing, and a removed or stolen
socket went unnoticed: `gpuwarden pause` said "no agent is running" to an operator about to
reset a GPU, until the agent was restarted.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.program.control_client import ControlError, reachable, request, socket_path
from tests.support.agent_proc import AgentProcess, http_get, run_gpuwarden
from tests.support.disk import SmallDisk
from tests.support.waiting import wait_until

CONFIG = (
    "[collectors.gpu]\nenabled = false\n[collectors.benchmark]\nenabled = false\n"
    "[collectors.kernel_log]\nenabled = false\n"
)
CORE = "state_retry_interval = 1.0\n"
"""The store, in memory while the state dir is unusable, goes back to it soon after."""
WAIT = 30.0
"""A bound on how long the agent may take to notice (it checks every few seconds)."""


def agent_in(workdir: Path) -> AgentProcess:
    return AgentProcess(workdir, config_text=CONFIG, core_text=CORE)


def healthz(agent: AgentProcess) -> tuple[int, str]:
    return http_get(agent.metrics_url.replace("/metrics", "/healthz"))


def control_problems(agent: AgentProcess) -> list[str]:
    _, body = healthz(agent)
    return [line for line in body.splitlines() if "control socket" in line]


def series(agent: AgentProcess, name: str) -> list[str]:
    _, body = http_get(agent.metrics_url)
    return [line for line in body.splitlines() if line.startswith(name + " ")]


def answers(state_dir: Path) -> bool:
    try:
        return request(state_dir, {"op": "status"}, 5.0).get("ok") is True
    except ControlError:
        return False


def holder(path: Path) -> int | None:
    """The pid of the process listening on the socket at `path` (SO_PEERCRED), or None."""
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.settimeout(5.0)
    try:
        with reachable(path) as name:
            client.connect(name)
        raw = client.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid: int = struct.unpack("3i", raw)[0]
        return pid
    except OSError:
        return None
    finally:
        client.close()


def pause_and_resume(agent: AgentProcess) -> None:
    """What an operator runs before a GPU reset, and after it: both reach the agent."""
    done = run_gpuwarden("pause", "--config", str(agent.config_path), "--for", "5m")
    assert done.returncode == 0, done.stdout + done.stderr
    done = run_gpuwarden("resume", "--config", str(agent.config_path))
    assert done.returncode == 0, done.stdout + done.stderr


def use_up_inodes(where: Path) -> list[Path]:
    taken: list[Path] = []
    refused: OSError | None = None
    while refused is None:
        path = where / f".inode-{len(taken)}"
        try:
            path.touch()
        except OSError as exc:
            refused = exc
        else:
            taken.append(path)
    assert refused.errno == errno.ENOSPC, refused
    return taken


def remount(disk: SmallDisk, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(disk.path)], check=True)


def leave_stale_socket(path: Path) -> None:
    """A socket file nobody listens on: what an agent killed with -9 leaves."""
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with reachable(path) as name:
        stale.bind(name)
    stale.close()


@contextlib.contextmanager
def running(agent: AgentProcess) -> Iterator[AgentProcess]:
    agent.start()
    try:
        yield agent
    finally:
        agent.stop()
        log = agent.log()
        assert "Traceback" not in log, log[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("cause", "stale"),
    [("no-free-inodes", False), ("read-only", False), ("read-only", True)],
)
def test_a_socket_that_cannot_be_bound_at_start_is_said_retried_and_bound_later(
    tmp_path: Path, cause: str, stale: bool
) -> None:
    agent = agent_in(tmp_path)
    state_dir = tmp_path / "state"
    path = socket_path(state_dir)
    with SmallDisk(state_dir, inodes=64 if cause == "no-free-inodes" else None) as disk:
        if stale:
            leave_stale_socket(path)
        taken = use_up_inodes(state_dir) if cause == "no-free-inodes" else []
        if cause == "read-only":
            remount(disk, "ro")
        errno_text = os.strerror(errno.ENOSPC if cause == "no-free-inodes" else errno.EROFS)
        with running(agent):
            assert agent.process is not None
            pid = agent.process.pid
            # Health names it, with the path and the cause, so the heartbeat and
            # gpuwarden_health_ok carry it; and its own series says it.
            wait_until(lambda: bool(control_problems(agent)), WAIT, "a control socket problem")
            problems = control_problems(agent)
            assert len(problems) == 1, problems
            assert str(path) in problems[0] and errno_text in problems[0], problems
            assert healthz(agent)[0] == 503
            assert series(agent, "gpuwarden_health_ok") == ["gpuwarden_health_ok 0.0"]
            assert series(agent, "gpuwarden_control_socket_up") == [
                "gpuwarden_control_socket_up 0.0"
            ]
            # The operator's command says the agent runs and its socket is not there.
            done = run_gpuwarden("pause", "--config", str(agent.config_path), "--for", "5m")
            assert done.returncode == 1, done.stdout + done.stderr
            assert "Traceback" not in done.stderr, done.stderr
            assert f"pid {pid}" in done.stderr and "not there" in done.stderr, done.stderr
            assert "no agent is running" not in done.stderr, done.stderr

            # The cause goes away: the agent binds by itself and the problem clears.
            for filler in taken:
                filler.unlink()
            if cause == "read-only":
                remount(disk, "rw")
            wait_until(lambda: answers(state_dir), WAIT, "the control socket answering")
            assert holder(path) == pid
            wait_until(lambda: not control_problems(agent), WAIT, "the problem cleared")
            assert series(agent, "gpuwarden_control_socket_up") == [
                "gpuwarden_control_socket_up 1.0"
            ]
            wait_until(lambda: healthz(agent)[0] == 200, WAIT, "a healthy agent")
            pause_and_resume(agent)
            assert os.stat(path).st_mode & 0o777 == 0o600  # its permissions as ever


@pytest.mark.slow
def test_a_full_state_disk_still_takes_the_socket(tmp_path: Path) -> None:
    """A socket file needs an inode, not a block: a tmpfs without a free byte binds it (a
    guard, with the store in memory meanwhile)."""
    agent = agent_in(tmp_path)
    state_dir = tmp_path / "state"
    with SmallDisk(state_dir) as disk:
        disk.fill()
        with running(agent):
            wait_until(lambda: answers(state_dir), WAIT, "the control socket answering")
            assert not control_problems(agent)
            pause_and_resume(agent)


def put_regular_file(path: Path) -> None:
    path.write_text("not a socket\n")


@pytest.mark.slow
@pytest.mark.parametrize("replaced_by", ["nothing", "stale-socket", "regular-file", "live-socket"])
def test_a_socket_removed_or_replaced_while_running_is_noticed_and_bound_again(
    tmp_path: Path, replaced_by: str
) -> None:
    agent = agent_in(tmp_path)
    state_dir = tmp_path / "state"
    path = socket_path(state_dir)
    with running(agent):
        assert agent.process is not None
        pid = agent.process.pid
        wait_until(lambda: answers(state_dir), WAIT, "the control socket answering")
        os.unlink(path)  # tmpfiles cleaning, an operator's rm
        other: socket.socket | None = None
        if replaced_by == "stale-socket":
            leave_stale_socket(path)
        elif replaced_by == "regular-file":
            put_regular_file(path)
        elif replaced_by == "live-socket":
            other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            with reachable(path) as name:
                other.bind(name)
            other.listen(64)
        try:
            if replaced_by in ("regular-file", "live-socket"):
                # Not the agent's to remove: said, with what is there, and left alone.
                wait_until(lambda: bool(control_problems(agent)), WAIT, "a problem")
                problems = control_problems(agent)
                assert str(path) in problems[0], problems
                if replaced_by == "live-socket":
                    assert f"pid {os.getpid()}" in problems[0], problems
                    assert holder(path) == os.getpid()
                else:
                    assert "not a socket" in problems[0], problems
                    assert path.read_text() == "not a socket\n"
                assert series(agent, "gpuwarden_control_socket_up") == [
                    "gpuwarden_control_socket_up 0.0"
                ]
                # The cause goes away: the other process ends (its socket left stale), the
                # file is removed.
                if other is not None:
                    # (No command before: what listens there takes it and never answers.)
                    other.close()
                else:
                    done = run_gpuwarden("resume", "--config", str(agent.config_path))
                    assert done.returncode == 1, done.stdout + done.stderr
                    assert "not there" in done.stderr, done.stderr
                    path.unlink()
        finally:
            if other is not None:
                other.close()
        wait_until(lambda: holder(path) == pid, WAIT, "the agent's socket again")
        wait_until(lambda: not control_problems(agent), WAIT, "the problem cleared")
        pause_and_resume(agent)


@pytest.mark.slow
def test_a_second_agent_on_the_same_state_dir_does_not_take_the_socket(tmp_path: Path) -> None:
    """Started by mistake on the same state dir: before, it unlinked the first agent's
    socket and bound its own, and the first never noticed (and unlinked the second's at
    its stop). The first keeps it; the second says so, and takes it once the first is gone."""
    first = agent_in(tmp_path / "a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "state").symlink_to(tmp_path / "a" / "state")
    second = agent_in(tmp_path / "b")
    path = socket_path(tmp_path / "a" / "state")
    with running(first):
        assert first.process is not None
        first_pid = first.process.pid
        wait_until(lambda: holder(path) == first_pid, WAIT, "the first's socket")
        with running(second):
            assert second.process is not None
            second_pid = second.process.pid
            wait_until(lambda: bool(control_problems(second)), WAIT, "the second's problem")
            problems = control_problems(second)
            assert f"pid {first_pid}" in problems[0], problems
            assert holder(path) == first_pid
            assert not control_problems(first)
            first.stop()
            wait_until(lambda: holder(path) == second_pid, WAIT, "the second's socket")
            wait_until(lambda: not control_problems(second), WAIT, "the problem cleared")
            pause_and_resume(second)


@pytest.mark.slow
def test_a_stop_leaves_a_socket_that_is_not_the_agents(tmp_path: Path) -> None:
    agent = agent_in(tmp_path)
    path = socket_path(tmp_path / "state")
    with running(agent):
        wait_until(lambda: answers(tmp_path / "state"), WAIT, "the control socket answering")
        os.unlink(path)
        other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with reachable(path) as name:
            other.bind(name)
        other.listen(64)
        try:
            ours = os.stat(path).st_ino
            wait_until(lambda: bool(control_problems(agent)), WAIT, "a problem")
            agent.stop()
            assert os.stat(path).st_ino == ours
            assert holder(path) == os.getpid()
        finally:
            other.close()


@pytest.mark.slow
def test_the_stale_socket_of_a_kill_9_is_replaced_at_the_next_start(tmp_path: Path) -> None:
    """A guard: this worked before."""
    state_dir = tmp_path / "state"
    path = socket_path(state_dir)
    killed = agent_in(tmp_path).start()
    assert killed.process is not None
    wait_until(lambda: answers(state_dir), WAIT, "the control socket answering")
    killed.signal(signal.SIGKILL)
    killed.process.wait(10)
    assert path.is_socket() and holder(path) is None  # left behind, nobody listening
    with running(agent_in(tmp_path)) as again:
        assert again.process is not None
        pid = again.process.pid
        wait_until(lambda: holder(path) == pid, WAIT, "the new agent's socket")
        assert not control_problems(again)
        pause_and_resume(again)


@pytest.mark.parametrize("at_path", ["nothing", "stale-socket", "regular-file", "full-queue"])
def test_the_command_says_why_it_cannot_reach_the_agent_without_a_traceback(
    tmp_path: Path, at_path: str
) -> None:
    """No agent of this state dir runs: each shape of what the path holds gets one line of
    why and exit 1. A listener whose queue is full (an agent out of files for long, another
    process's socket) made connect() fail with EAGAIN, and the command end in a traceback."""
    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o700)
    path = socket_path(state_dir)
    held: list[socket.socket] = []
    try:
        if at_path == "stale-socket":
            leave_stale_socket(path)
        elif at_path == "regular-file":
            put_regular_file(path)
        elif at_path == "full-queue":
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            held.append(listener)
            with reachable(path) as name:
                listener.bind(name)
                listener.listen(0)
                while True:  # queued until the kernel takes no more
                    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    client.setblocking(False)
                    held.append(client)
                    try:
                        client.connect(name)
                    except BlockingIOError:
                        break
        done = run_gpuwarden("resume", "--state-dir", str(state_dir))
    finally:
        for each in held:
            each.close()
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpuwarden resume: "), lines
    assert str(path) in lines[0], lines
