"""How long `gpuwarden pause` and `resume` take, end to end, against the agent as a real
process on the fake NVML (8 fake GPUs, event thread on), side by side with the gpu collector's
own round, and what the agent holds before, during and after.

Each pause is the real command (a new Python process: its start-up is most of the time), the
agent's reply after NVML is shut down and the event thread joined; each resume waits for the
first round after the pause. The fake's nvmlInit costs nothing: on the H200 add the real
nvmlInit (tests/test_pause_gpu.py prints both commands' wall time there).

    python bench/pause.py [--runs 5] [--gpus 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.agent_proc import REPO, AgentProcess, http_get


def command(*args: str) -> float:
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "agent", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"gpuwarden {args[0]} failed: {done.stdout}{done.stderr}")
    return time.monotonic() - began


def held(pid: int, devices: Path) -> int:
    fd_dir = Path(f"/proc/{pid}/fd")
    count = 0
    for name in os.listdir(fd_dir):
        try:
            count += os.readlink(fd_dir / name).startswith(f"{devices}/")
        except OSError:
            continue
    return count


def round_seconds(agent: AgentProcess) -> float:
    _, text = http_get(agent.metrics_url)
    for line in text.splitlines():
        if line.startswith('gpuwarden_collector_duration_seconds{collector="gpu"}'):
            return float(line.split()[-1])
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--gpus", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        devices = Path(tmp) / "dev"
        devices.mkdir()
        agent = AgentProcess(
            Path(tmp) / "agent",
            entry=["-m", "tests.support.fake_nvml_agent", str(devices), str(args.gpus)],
            config_text='[collectors.gpu]\ninterval = 1\nsysfs_root = "/nonexistent"\n'
            "[collectors.benchmark]\nenabled = false\n",
        )
        agent.start(timeout=60)
        try:
            assert agent.process is not None
            pid = agent.process.pid
            time.sleep(3)
            state = str(agent.workdir / "state")
            baseline = command("resume", "--state-dir", state)  # nothing to resume: the floor
            pauses, resumes, rounds = [], [], []
            during = after = before = 0
            for _ in range(args.runs):
                rounds.append(round_seconds(agent))
                before = held(pid, devices)
                pauses.append(command("pause", "--state-dir", state, "--for", "5m"))
                during = held(pid, devices)
                resumes.append(command("resume", "--state-dir", state))
                after = held(pid, devices)
                time.sleep(1.5)
        finally:
            agent.stop()
    print(f"{args.gpus} fake GPUs, {args.runs} runs (seconds: median / max)")
    print(f"{'what':<44} {'median':>8} {'max':>8}")
    rows = [
        ("gpuwarden resume with nothing paused (floor)", [baseline]),
        ("gpuwarden pause (NVML shut, thread joined)", pauses),
        ("gpuwarden resume (incl. first round after)", resumes),
        ("gpu collector round, steady", rounds),
    ]
    for name, values in rows:
        print(f"{name:<44} {statistics.median(values):>8.3f} {max(values):>8.3f}")
    print(f"device files held: before {before}, paused {during}, after resume {after}")


if __name__ == "__main__":
    main()
