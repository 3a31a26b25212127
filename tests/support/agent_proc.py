"""The agent as a real subprocess, with a temporary config and state dir."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.ports import free_port

REPO = Path(__file__).resolve().parents[2]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()


def pythonpath(repo: Path = REPO) -> str:
    """The checkout first, then whatever the caller's path held: on the GPU machine the
    dependencies are installed into a folder named there, not into the interpreter."""
    return os.pathsep.join(p for p in (str(repo), os.environ.get("PYTHONPATH")) if p)


def run_gpuwarden(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """One `gpuwarden` command as the operator runs it, from this checkout (its PYTHONPATH as
    the agent's: `pythonpath`)."""
    return subprocess.run(
        [sys.executable, "-m", "agent", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": pythonpath()},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@dataclass
class AgentProcess:
    workdir: Path
    config_text: str = ""
    """TOML appended after the generated state_dir and [prometheus] listen lines."""
    port: int = field(default_factory=free_port)
    env: dict[str, str] = field(default_factory=dict)
    repo: Path = REPO
    """The checkout whose agent runs (a benchmark runs another branch's for a before/after)."""
    prefix: list[str] = field(default_factory=list)
    """A command the agent's command line is handed to (it must exec it, so that the pid is
    the agent's): a launcher of a private mount namespace, say."""
    process: subprocess.Popen[bytes] | None = None
    node_id: str = "test-node"
    core_text: str = ""
    """Top-level keys (before any table) after the generated node_id and state_dir."""
    entry: list[str] = field(default_factory=lambda: ["-m", "agent"])
    """What Python runs: the agent, or a launcher of it (tests/support/fake_nvml_agent.py)."""

    @property
    def config_path(self) -> Path:
        return self.workdir / "gpuwarden.toml"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    @property
    def log_path(self) -> Path:
        return self.workdir / "agent.log"

    def write_config(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        head = (
            f'node_id = "{self.node_id}"\nstate_dir = "{self.workdir / "state"}"\n'
            f"{self.core_text}"
            f'[prometheus]\nlisten = "127.0.0.1:{self.port}"\n'
        )
        self.config_path.write_text(head + self.config_text)

    def start(self, wait: bool = True, timeout: float = 15.0) -> AgentProcess:
        self.write_config()
        env = {
            **os.environ,
            "PYTHONPATH": pythonpath(self.repo),
            "PYTHONUNBUFFERED": "1",
            **self.env,
        }
        if "NOTIFY_SOCKET" not in self.env:
            env.pop("NOTIFY_SOCKET", None)
        self.process = subprocess.Popen(
            [*self.prefix, sys.executable, *self.entry, "run", "--config", str(self.config_path)],
            cwd=self.repo,
            env=env,
            stdout=self.log_path.open("ab"),
            stderr=subprocess.STDOUT,
        )
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"agent exited with {self.process.returncode}:\n{self.log()}")
            try:
                status, _ = http_get(self.metrics_url, timeout=1.0)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"agent did not serve /metrics within {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def signal(self, signum: int) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    def stop(self, timeout: float = 10.0) -> int:
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        code = self.process.returncode
        self.process = None
        return int(code)
