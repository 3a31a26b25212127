"""`gpuwarden pause` on a real GPU: the running agent lets go of every /dev/nvidia* file, so a
GPU reset or a MIG change could proceed, and `resume` brings the GPU series back.

Run on the GPU machine: `python -m pytest -q -m gpu tests/test_pause_gpu.py`. Without NVML it
skips. It never resets a GPU and never changes MIG: it only checks that nothing of the agent
would stand in the way (no NVIDIA device file in /proc/<agent pid>/fd), as `nvidia-smi -r`
requires of every process.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.agent_proc import AgentProcess, http_get, run_gpuwarden
from tests.support.nvml import real_gpu_count
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.gpu]


@pytest.fixture(scope="module")
def gpus() -> int:
    return real_gpu_count()


@pytest.fixture
def agent(tmp_path: Path, gpus: int) -> Iterator[AgentProcess]:
    process = AgentProcess(
        tmp_path / "agent",
        config_text=(
            "[collectors.gpu]\ninterval = 1\nevent_wait_ms = 200\n"
            "[collectors.benchmark]\nenabled = false\n"
        ),
    )
    process.start(timeout=60)
    yield process
    process.stop()


def nvidia_files(pid: int) -> list[str]:
    fd_dir = Path(f"/proc/{pid}/fd")
    found = []
    for name in os.listdir(fd_dir):
        try:
            target = os.readlink(fd_dir / name)
        except OSError:
            continue
        if target.startswith("/dev/nvidia"):
            found.append(target)
    return sorted(found)


def series(agent: AgentProcess, prefix: str) -> list[str]:
    _, text = http_get(agent.metrics_url)
    return [line for line in text.splitlines() if line.startswith(prefix)]


def gpuwarden(*args: str) -> subprocess.CompletedProcess[str]:
    return run_gpuwarden(*args, timeout=180)


def test_pause_lets_go_of_every_device_file_and_resume_brings_the_gpus_back(
    agent: AgentProcess, gpus: int
) -> None:
    assert agent.process is not None
    pid = agent.process.pid
    wait_until(lambda: len(series(agent, "gpuwarden_gpu_up{")) == gpus, 60, "GPU series")
    wait_until(
        lambda: (
            series(agent, "gpuwarden_gpu_event_thread_up ") == ["gpuwarden_gpu_event_thread_up 1.0"]
        ),
        60,
        "the event thread",
    )
    held = nvidia_files(pid)
    assert held, "the agent holds no /dev/nvidia* file while monitoring: the check proves nothing"

    began = time.monotonic()
    done = gpuwarden("pause", "--config", str(agent.config_path), "--for", "5m")
    took = time.monotonic() - began
    assert done.returncode == 0, done.stdout + done.stderr
    print(f"\npause took {took:.2f} s; held before: {held}")
    assert nvidia_files(pid) == []  # nothing of the agent stands in the way of nvidia-smi -r
    assert series(agent, "gpuwarden_gpu_up{") == []
    assert series(agent, "gpuwarden_gpu_paused ") == ["gpuwarden_gpu_paused 1.0"]
    time.sleep(3)  # rounds go on while paused: still nothing opened
    assert nvidia_files(pid) == []

    began = time.monotonic()
    done = gpuwarden("resume", "--config", str(agent.config_path))
    took = time.monotonic() - began
    assert done.returncode == 0, done.stdout + done.stderr
    print(f"resume took {took:.2f} s:\n{done.stdout}")
    up = series(agent, "gpuwarden_gpu_up{")
    assert len(up) == gpus and all(line.endswith(" 1.0") for line in up), up
    assert nvidia_files(pid) != []
    wait_until(
        lambda: (
            series(agent, "gpuwarden_gpu_event_thread_up ") == ["gpuwarden_gpu_event_thread_up 1.0"]
        ),
        60,
        "the event thread after the pause",
    )
