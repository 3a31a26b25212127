"""The agent stops at once beside a dead file server (issue 13, item 5).

A real FUSE mount whose statfs never answers (tests/support/fuse_hang.py), in a private mount
namespace shared only by the real agent: the mount is reported stuck, and SIGTERM ends the
agent within the stop budget while the mount still hangs, with nothing of the agent left
behind. Before, the agent's statvfs thread went into an uninterruptible wait as the process
exited, and the process could not be reaped until the mount answered.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.program import registry
from tests.support.agent_proc import AgentProcess, http_get
from tests.support.fuse_hang import FS_TYPE
from tests.support.waiting import wait_until
from tests.support.watch import metric_value

STOP_BUDGET = 5.0
"""Seconds systemd's stop may take before the agent counts as hung (gross bound)."""


def fuse_usable() -> str:
    if os.geteuid() != 0:
        return "mounting FUSE needs root"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if shutil.which("unshare") is None:
        return "no unshare (util-linux)"
    try:
        import fuse  # noqa: F401
    except (ImportError, OSError) as exc:  # fusepy, or libfuse2 under it, missing
        return f"fusepy/libfuse2 unavailable: {exc}"
    return ""


pytestmark = pytest.mark.skipif(bool(fuse_usable()), reason=fuse_usable() or "usable")


def process_state(pid: int) -> str:
    """The state letter of a process (R, S, D, Z...), "" once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return ""
    return text.rpartition(")")[2].split()[0]


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (FileNotFoundError, ProcessLookupError):
        return ""


@pytest.fixture
def hung_mount(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(mount point, state file): the FUSE daemon's pid is in the state file's .pid sibling
    once mounted; it is SIGKILLed at the end whatever happened (that ends every wait on it)."""
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    state = tmp_path / "fuse-state"
    yield mountpoint, state
    kill_daemon(state)


def hang_launcher(mountpoint: Path, state: Path, *options: str) -> list[str]:
    """The prefix that runs a command beside a hanging FUSE mount at `mountpoint`, in a
    private mount namespace (tests/support/fuse_hang.py; `options`: its own, `--lookups`)."""
    return [
        "unshare",
        "-m",
        "--propagation",
        "private",
        sys.executable,
        "-m",
        "tests.support.fuse_hang",
        str(mountpoint),
        str(state),
        *options,
        "--",
    ]


def kill_daemon(state: Path) -> None:
    """SIGKILL the FUSE daemon whose pid is in the state file's .pid sibling, if it ran:
    that ends every wait on its mount."""
    pidfile = Path(f"{state}.pid")
    if pidfile.exists():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pidfile.read_text()), signal.SIGKILL)


def agent_config(mountpoint: Path) -> str:
    lines = [
        f"[collectors.{name}]\nenabled = false" for name in registry.COLLECTORS if name != "disk"
    ]
    lines.append(
        f'[collectors.disk]\ninterval = 0.5\ntimeout = 1.0\nmountpoints_include = ["{mountpoint}"]'
    )
    return "\n".join(lines) + "\n"


class TestDeadFileServer:
    def test_reported_stuck_and_stops_at_once(
        self, agent_process: AgentProcess, hung_mount: tuple[Path, Path]
    ) -> None:
        mountpoint, state = hung_mount
        agent_process.prefix = hang_launcher(mountpoint, state)
        agent_process.config_text = agent_config(mountpoint)
        agent_process.start()
        process = agent_process.process
        assert process is not None
        labels = {"mountpoint": str(mountpoint), "device": "hang-server", "fstype": FS_TYPE}

        def stuck() -> bool:
            _, body = http_get(agent_process.metrics_url)
            return metric_value(body, "gpuwarden_mount_stuck", **labels) == 1

        wait_until(stuck, timeout=20, what="the mount reported stuck")
        # The series comes with the round; the event's log line once the store thread has
        # stored it (events are stored before anyone hears of them), a moment later.
        wait_until(
            lambda: "mount_stuck" in agent_process.log(), timeout=10, what="mount_stuck logged"
        )
        assert state.read_text().count("statfs") == 1  # asked once, never again while stuck
        daemon = int(Path(f"{state}.pid").read_text())
        helpers = [c for c in children(process.pid) if "statvfs_child" in cmdline(c)]

        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(STOP_BUDGET)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"the agent did not exit within {STOP_BUDGET} s of SIGTERM (state "
                f"{process_state(process.pid)!r}, threads in "
                f"{sorted({process_state(int(t.name)) for t in Path(f'/proc/{process.pid}/task').iterdir()})})"
            )
        agent_process.process = None
        assert code == 0, agent_process.log()[-2000:]
        assert process_state(process.pid) == ""  # reaped: no zombie of the agent
        # The mount still hangs: its daemon is alive and answered nothing.
        assert process_state(daemon) not in ("", "Z")
        # The helper that asked is the one stuck in the kernel, killed and waiting for the
        # mount, outside the agent.
        assert [process_state(h) for h in helpers] == ["D"], helpers
        os.kill(daemon, signal.SIGKILL)
        wait_until(lambda: all(process_state(h) in ("", "Z") for h in helpers), what="helper gone")
