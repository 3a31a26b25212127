"""How long the agent takes to stop beside a dead file server, statvfs in threads or in helpers.

    /work/main/.venv/bin/python bench/hung_mount_stop.py [--runs 3] [--give-up 10]

Needs root, /dev/fuse, fusepy and libfuse2 (as the test tests/test_disk_hung_mount.py). Each
run starts the real agent in a private mount namespace beside a FUSE mount whose statfs never
answers (tests/support/fuse_hang.py), waits until the disk collector reports the mount stuck,
sends SIGTERM and measures until the agent's process is reaped. `threads` is the disk
collector with `isolated_fs_types = []` (how every statvfs ran before); `helpers` the default.
A run that has not ended after `--give-up` seconds counts as not stopped: the FUSE daemon is
then killed, which is the only thing that ends it. Also shown: the helpers' start time and
memory (RSS of one idle helper).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

from agent.program import registry  # noqa: E402
from collectors.disk.isolated import StatvfsHelpers  # noqa: E402
from tests.support.agent_proc import AgentProcess, http_get  # noqa: E402
from tests.support.watch import metric_value  # noqa: E402


def config(mountpoint: Path, mode: str) -> str:
    lines = [f"[collectors.{n}]\nenabled = false" for n in registry.COLLECTORS if n != "disk"]
    isolated = "isolated_fs_types = []\n" if mode == "threads" else ""
    lines.append(
        f"[collectors.disk]\ninterval = 0.5\ntimeout = 1.0\n{isolated}"
        f'mountpoints_include = ["{mountpoint}"]'
    )
    return "\n".join(lines) + "\n"


def one_run(workdir: Path, mode: str, give_up: float) -> float | None:
    mountpoint, state = workdir / "mnt", workdir / "fuse-state"
    mountpoint.mkdir(parents=True)
    agent = AgentProcess(workdir / "agent")
    agent.prefix = ["unshare", "-m", "--propagation", "private", sys.executable, "-m"]
    agent.prefix += ["tests.support.fuse_hang", str(mountpoint), str(state), "--"]
    agent.config_text = config(mountpoint, mode)
    agent.start()
    process = agent.process
    assert process is not None
    labels = {"mountpoint": str(mountpoint), "device": "hang-server", "fstype": "fuse.hang"}
    try:
        deadline = time.monotonic() + 20
        while metric_value(http_get(agent.metrics_url)[1], "gpuwarden_mount_stuck", **labels) != 1:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{mode}: the mount was never reported stuck")
            time.sleep(0.05)
        began = time.monotonic()
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(give_up)
            return time.monotonic() - began
        except subprocess.TimeoutExpired:
            return None
    finally:
        daemon = Path(f"{state}.pid")
        if daemon.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(daemon.read_text()), signal.SIGKILL)
        process.wait(10)
        agent.process = None


def helper_cost() -> tuple[float, int]:
    """(ms to start a helper and get its first answer, RSS of an idle helper in KiB)."""
    helpers = StatvfsHelpers()
    began = time.monotonic()
    helpers.statvfs("/")
    started = (time.monotonic() - began) * 1000
    [pid] = helpers.pids()
    rss = next(
        int(line.split()[1])
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if line.startswith("VmRSS:")
    )
    helpers.close()
    return started, rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--give-up", type=float, default=10.0)
    args = parser.parse_args()
    rows: dict[str, list[float | None]] = {"threads": [], "helpers": []}
    with tempfile.TemporaryDirectory(prefix="hung-mount-") as tmp:
        for i in range(args.runs):
            for mode, times in rows.items():
                times.append(one_run(Path(tmp) / f"{mode}-{i}", mode, args.give_up))
    print(
        f"SIGTERM to reaped, a FUSE mount hung, {args.runs} runs (gave up after {args.give_up:g} s)"
    )
    print(f"{'statvfs in':<12} {'stopped':>8} {'median s':>9} {'max s':>7}")
    for mode, times in rows.items():
        done = [t for t in times if t is not None]
        median = f"{statistics.median(done):.2f}" if done else "-"
        worst = f"{max(done):.2f}" if done else "-"
        print(f"{mode:<12} {len(done):>5}/{len(times):<2} {median:>9} {worst:>7}")
    started, rss = helper_cost()
    print(f"one helper: first answer {started:.0f} ms after start, {rss / 1024:.1f} MiB RSS idle")


if __name__ == "__main__":
    main()
