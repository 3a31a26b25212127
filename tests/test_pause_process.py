"""`gpuwarden pause` and `resume` against the agent as a real process (on the fake NVML, whose
nvmlInit opens real files): the device files leave the agent's /proc/<pid>/fd, no NVML call is
made, the heartbeat on a real mosquitto says paused, and the control socket refuses other
users."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.program.control_client import socket_path
from tests.support.agent_proc import AgentProcess, http_get, run_gpuwarden
from tests.support.fake_nvml_agent import calls_path, hang_gpu, stuck_calls, unhang_gpu
from tests.support.mosquitto import Broker
from tests.support.mqtt import Subscriber
from tests.support.waiting import wait_until


def gpuwarden(*args: str) -> subprocess.CompletedProcess[str]:
    return run_gpuwarden(*args)


def device_files(pid: int, devices: Path) -> list[str]:
    fd_dir = Path(f"/proc/{pid}/fd")
    found = []
    for name in os.listdir(fd_dir):
        try:
            target = os.readlink(fd_dir / name)
        except OSError:
            continue
        if target.startswith(f"{devices}/"):
            found.append(target)
    return sorted(found)


def metric(agent: AgentProcess, name: str) -> list[str]:
    _, text = http_get(agent.metrics_url)
    return [line for line in text.splitlines() if line.startswith(name)]


def calls(devices: Path, since: float) -> dict[str, int]:
    """The fake's library calls by name, from a report its reporter wrote after `since`: one
    written earlier may lack the last calls before a release (it writes every 0.1 s, later
    on a loaded machine), and they would read as calls made while paused."""
    path = calls_path(devices)
    wait_until(lambda: path.stat().st_mtime > since, what="a report of the fake's calls")
    counts: dict[str, int] = json.loads(path.read_text())
    return counts


@pytest.fixture
def fake_agent(tmp_path: Path, broker: Broker) -> Iterator[tuple[AgentProcess, Path]]:
    devices = tmp_path / "dev"
    devices.mkdir()
    agent = AgentProcess(
        tmp_path / "agent",
        entry=["-m", "tests.support.fake_nvml_agent", str(devices), "2"],
        config_text=(
            f'[mqtt]\nenabled = true\nurl = "{broker.url}"\nreconnect_min = 0.2\n'
            "[heartbeat]\ninterval = 0.5\n"
            "[collectors.gpu]\ninterval = 0.5\nevent_wait_ms = 100\n"
            'sysfs_root = "/nonexistent"\n'
            "[collectors.benchmark]\nenabled = false\n"
        ),
    )
    agent.start()
    yield agent, devices
    agent.stop()


def heartbeats(sub: Subscriber) -> list[dict[str, Any]]:
    return [m.json() for m in sub.on("test-node/heartbeat")]


@pytest.mark.slow
class TestPauseCommand:
    def test_pause_and_resume_the_running_agent(
        self, fake_agent: tuple[AgentProcess, Path], broker: Broker
    ) -> None:
        agent, devices = fake_agent
        assert agent.process is not None
        pid = agent.process.pid
        wait_until(lambda: bool(metric(agent, "gpuwarden_gpu_up{")), what="GPU series")
        wait_until(lambda: len(device_files(pid, devices)) == 3, what="the fake's device files")
        sub = Subscriber(broker.port).start()
        try:
            done = gpuwarden(
                "pause", "--config", str(agent.config_path), "--for", "10m", "--reason", "reset"
            )
            assert done.returncode == 0, done.stdout + done.stderr
            assert "gpu: released" in done.stdout
            released = time.time()
            assert device_files(pid, devices) == []  # nvidia-smi -r could proceed now
            assert metric(agent, "gpuwarden_gpu_paused ") == ["gpuwarden_gpu_paused 1.0"]
            assert metric(agent, "gpuwarden_gpu_up{") == []
            sub.wait_for(
                lambda s: any(h.get("gpu") == "paused" for h in heartbeats(s)),
                what="a heartbeat saying paused",
            )
            paused = next(h for h in heartbeats(sub) if h.get("gpu") == "paused")
            assert paused["paused"]["reason"] == "reset"
            assert paused["health"] == "ok"
            before = calls(devices, since=released)
            count = len(heartbeats(sub))
            sub.wait_for(lambda s: len(heartbeats(s)) >= count + 3, what="more heartbeats")
            assert calls(devices, since=time.time()) == before  # not one NVML call while paused

            done = gpuwarden("resume", "--config", str(agent.config_path))
            assert done.returncode == 0, done.stdout + done.stderr
            assert "GPU monitoring resumed" in done.stdout
            assert len(device_files(pid, devices)) == 3
            assert metric(agent, "gpuwarden_gpu_paused ") == ["gpuwarden_gpu_paused 0.0"]
            assert len(metric(agent, "gpuwarden_gpu_up{")) == 2
            sub.wait_for(
                lambda s: heartbeats(s)[-1].get("gpu") == "active", what="heartbeat active"
            )
        finally:
            sub.stop()

    def test_json_answer_and_a_duration_refused(
        self, fake_agent: tuple[AgentProcess, Path]
    ) -> None:
        agent, _ = fake_agent
        state = str(agent.workdir / "state")
        done = gpuwarden("pause", "--state-dir", state, "--for", "30d")
        assert done.returncode == 1 and "max_duration" in done.stderr
        done = gpuwarden("pause", "--state-dir", state, "--for", "90s", "--json")
        assert done.returncode == 0, done.stderr
        reply = json.loads(done.stdout)
        assert reply["released"]["gpu"]["released"] is True
        assert reply["paused"]["until_ts"] - reply["paused"]["since_ts"] == pytest.approx(90, 1)
        done = gpuwarden("resume", "--state-dir", state, "--json")
        assert json.loads(done.stdout)["resumed"] is True
        done = gpuwarden("resume", "--state-dir", state)
        assert done.returncode == 0 and "not paused" in done.stdout

    def test_other_users_are_refused(self, fake_agent: tuple[AgentProcess, Path]) -> None:
        """The socket is root's and the agent's user's only: opened to all on purpose here,
        the peer credentials still refuse nobody."""
        agent, _ = fake_agent
        path = socket_path(agent.workdir / "state")
        os.chmod(agent.workdir / "state", 0o755)
        os.chmod(path, 0o666)
        reply = as_user(65534, agent.workdir / "state", {"op": "pause", "seconds": 60})
        assert reply["ok"] is False and "refused" in reply["error"]
        assert metric(agent, "gpuwarden_gpu_paused ") == ["gpuwarden_gpu_paused 0.0"]


@pytest.fixture
def hung_agent(tmp_path: Path, broker: Broker) -> Iterator[tuple[AgentProcess, Path]]:
    """The agent with a short NVML call timeout: a call hung on a GPU stays in the driver
    beyond it, and a pause waits for it no longer than that timeout and a second."""
    devices = tmp_path / "dev"
    devices.mkdir()
    agent = AgentProcess(
        tmp_path / "agent",
        entry=["-m", "tests.support.fake_nvml_agent", str(devices), "2"],
        config_text=(
            f'[mqtt]\nenabled = true\nurl = "{broker.url}"\nreconnect_min = 0.2\n'
            "[heartbeat]\ninterval = 0.5\n"
            "[collectors.gpu]\ninterval = 0.5\ntimeout = 0.5\nevent_wait_ms = 100\n"
            'sysfs_root = "/nonexistent"\n'
            "[collectors.benchmark]\nenabled = false\n"
        ),
    )
    agent.start()
    yield agent, devices
    unhang_gpu(devices, 1)
    agent.stop()


@pytest.mark.slow
class TestAPauseAskedAgain:
    def test_what_did_not_let_go_is_asked_again(
        self, hung_agent: tuple[AgentProcess, Path]
    ) -> None:
        """`gpuwarden pause` while paused asks again. Before, it only moved the deadline and
        printed the first pause's answer: once the hung NVML call had returned, the agent
        still held the device files for the whole pause, and the operator who asked again
        read NOT RELEASED (exit 1) with nothing held back, or released when it was not."""
        agent, devices = hung_agent
        assert agent.process is not None
        pid = agent.process.pid
        state = str(agent.workdir / "state")
        wait_until(lambda: len(device_files(pid, devices)) == 3, what="the fake's device files")
        hang_gpu(devices, 1)
        wait_until(lambda: stuck_calls(devices, 1) == 1, what="a call hung on GPU 1")

        def pause() -> tuple[int, dict[str, Any]]:
            done = gpuwarden("pause", "--state-dir", state, "--for", "10m", "--json")
            reply: dict[str, Any] = json.loads(done.stdout)
            return done.returncode, reply

        for asked in ("first", "again while it hangs"):
            code, reply = pause()
            gpu = reply["released"]["gpu"]
            assert (code, gpu["released"]) == (1, False), (asked, reply)
            assert "has not returned" in gpu["detail"], (asked, reply)
            assert reply["extended"] is (asked != "first")
            assert len(device_files(pid, devices)) == 3  # NVML is not shut under the call

        unhang_gpu(devices, 1)
        wait_until(lambda: stuck_calls(devices, 1) == 0, what="the hung call's return")
        code, reply = pause()
        assert reply["extended"] is True
        assert (code, reply["released"]["gpu"]["released"]) == (0, True), reply
        assert device_files(pid, devices) == []  # nvidia-smi -r may go ahead now
        released = time.time()
        before = calls(devices, since=released)
        wait_until(lambda: calls_path(devices).stat().st_mtime > released + 1.5, what="rounds")
        assert calls(devices, since=time.time()) == before  # nothing opens NVML while paused

        done = gpuwarden("resume", "--state-dir", state)
        assert done.returncode == 0, done.stdout + done.stderr
        assert len(device_files(pid, devices)) == 3
        wait_until(lambda: len(metric(agent, "gpuwarden_gpu_up{")) == 2, what="both GPUs up")


def as_user(uid: int, state_dir: Path, payload: dict[str, Any]) -> dict[str, Any]:
    """One request from a child process that dropped to `uid` (it only uses a socket). The
    directory is reached through a descriptor the parent opened: the test's tmp_path is under
    root's 0700 /tmp/pytest-of-root, which would refuse the child before the agent could."""
    directory = os.open(state_dir, os.O_PATH | os.O_DIRECTORY)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no threads of its own
        try:
            os.setgid(uid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX) as sock:
                sock.settimeout(10.0)
                sock.connect(f"/proc/self/fd/{directory}/{socket_path(state_dir).name}")
                sock.sendall(json.dumps(payload).encode() + b"\n")
                answer = sock.makefile("rb").readline()
        except BaseException as exc:
            answer = json.dumps({"child_error": repr(exc)}).encode()
        os.write(write_end, answer)
        os._exit(0)
    os.close(write_end)
    os.close(directory)
    data = b""
    while chunk := os.read(read_end, 65536):
        data += chunk
    os.close(read_end)
    os.waitpid(pid, 0)
    reply: dict[str, Any] = json.loads(data)
    assert "child_error" not in reply, reply
    return reply


class TestNoAgent:
    def test_a_clear_error_when_no_agent_runs(self, tmp_path: Path) -> None:
        done = gpuwarden("pause", "--state-dir", str(tmp_path))
        assert done.returncode == 1
        assert "no agent is running" in done.stderr and str(tmp_path) in done.stderr

    def test_a_bad_duration_is_a_usage_error(self, tmp_path: Path) -> None:
        done = gpuwarden("pause", "--state-dir", str(tmp_path), "--for", "ten minutes")
        assert done.returncode == 2 and "expected a duration" in done.stderr
