"""A real one-node Slurm cluster for tests: munged, slurmctld and slurmd (Debian's slurm-wlm
and munge), on free loopback ports, every file under one temporary directory.

The node is this host (slurmd must run where its NodeName's host is): NodeName is the short
host name, NodeAddr 127.0.0.1. `scontrol` is a small wrapper that names this cluster's
slurm.conf, so the agent under test runs it as it would run the real one, without a shell.
The HealthCheckProgram runs `gpuwarden check --slurm` only while a flag file exists, so the
other tests are not drained by it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.ports import free_port
from tests.support.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
BINARIES = ("munged", "slurmctld", "slurmd", "scontrol", "sinfo")


def missing_binaries() -> list[str]:
    found = {name: shutil.which(name) or shutil.which(name, path="/usr/sbin") for name in BINARIES}
    return [name for name, path in found.items() if path is None]


@dataclass
class SlurmCluster:
    root: Path
    node: str = field(default_factory=lambda: socket.gethostname().split(".")[0])
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def scontrol(self) -> Path:
        return self.root / "bin" / "scontrol"

    @property
    def health_flag(self) -> Path:
        return self.root / "health-check-on"

    @property
    def health_config(self) -> Path:
        return self.root / "health" / "gpuwarden.toml"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, check: bool = True) -> str:
        done = subprocess.run(
            list(argv), env=self.env, capture_output=True, text=True, timeout=30, check=False
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"{argv} failed ({done.returncode}): {done.stderr}{done.stdout}")
        return done.stdout

    def reasons(self) -> str:
        """`sinfo -R`: the drain reasons, one line per node."""
        return self.run("sinfo", "-R", "-h", "-o", "%n|%E")

    def reason(self) -> str:
        for line in self.reasons().splitlines():
            node, _, reason = line.partition("|")
            if node.strip() == self.node:
                return reason.strip()
        return ""

    def state(self) -> str:
        return self.run("sinfo", "-h", "-n", self.node, "-o", "%T").strip()

    def drained(self) -> bool:
        return "drain" in self.state().lower()

    def undrained(self) -> bool:
        return not self.drained()

    def drain(self, reason: str) -> None:
        self.run("scontrol", "update", f"nodename={self.node}", "state=drain", f"reason={reason}")

    def health_checks_running(self) -> bool:
        """A `gpuwarden check` that slurmd started for this cluster is still running."""
        marker = str(self.health_config).encode()
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and marker in (proc / "cmdline").read_bytes():
                    return True
            except OSError:
                continue
        return False

    def stop_health_checks(self) -> None:
        """No new health check acts, and none started before is still running."""
        self.health_flag.unlink(missing_ok=True)
        wait_until(lambda: not self.health_checks_running(), 60, "health checks to end")

    def resume(self) -> None:
        if self.drained():
            self.run("scontrol", "update", f"nodename={self.node}", "state=resume")
        wait_until(lambda: not self.drained(), 20, "the node to resume")

    # -- start and stop ----------------------------------------------------------------------

    def start(self) -> None:
        for name in ("munge", "state", "spool", "log", "run", "bin", "health"):
            (self.root / name).mkdir(parents=True, exist_ok=True)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (self.root / "munge").chmod(0o700)
        self._write_conf()
        self._write_wrappers()
        sock = self.root / "munge" / "munge.sock"
        self._spawn(
            "munged",
            "-F",
            f"--key-file={key}",
            f"--socket={sock}",
            f"--pid-file={self.root / 'munge' / 'munged.pid'}",
            f"--log-file={self.root / 'munge' / 'munged.log'}",
            f"--seed-file={self.root / 'munge' / 'seed'}",
            "--force",
        )
        wait_until(sock.exists, 10, "munged's socket")
        self._spawn("slurmctld", "-D", "-i", "-f", str(self.conf))
        self._spawn("slurmd", "-D", "-f", str(self.conf))
        wait_until(self._idle, 60, "the Slurm node to register idle")

    def _idle(self) -> bool:
        for proc in self.processes:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}:\n{self.logs()}")
        try:
            return self.state().lower().startswith("idle")
        except (RuntimeError, subprocess.TimeoutExpired):
            return False

    def _spawn(self, program: str, *args: str) -> None:
        path = shutil.which(program) or shutil.which(program, path="/usr/sbin")
        assert path is not None, program
        log = (self.root / "log" / f"{program}.out").open("ab")
        self.processes.append(
            subprocess.Popen([path, *args], env=self.env, stdout=log, stderr=subprocess.STDOUT)
        )

    def logs(self) -> str:
        out = []
        for path in sorted((self.root / "log").glob("*")):
            out.append(f"== {path.name}\n{path.read_text(errors='replace')[-3000:]}")
        return "\n".join(out)

    def stop(self) -> None:
        for proc in reversed(self.processes):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self.processes):
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.processes.clear()

    def _write_conf(self) -> None:
        r = self.root
        lines = [
            "ClusterName=gwtest",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={r / 'munge' / 'munge.sock'}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'run' / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "ReturnToService=2",
            # The health check runs every few seconds (the flag file decides whether it
            # does anything), on every node state.
            f"HealthCheckProgram={r / 'bin' / 'health-check'}",
            "HealthCheckInterval=2",
            "HealthCheckNodeState=ANY",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs=1 State=UNKNOWN",
            f"PartitionName=gw Nodes={self.node} Default=YES State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    def _write_wrappers(self) -> None:
        real = shutil.which("scontrol")
        self.scontrol.write_text(f'#!/bin/sh\nSLURM_CONF="{self.conf}" exec {real} "$@"\n')
        self.scontrol.chmod(0o755)
        check = self.root / "bin" / "health-check"
        check.write_text(
            "#!/bin/sh\n"
            f'[ -f "{self.health_flag}" ] || exit 0\n'
            f'cd "{REPO}" && PYTHONPATH="{REPO}" exec "{sys.executable}" -m agent check '
            f'--slurm --no-torch --expect-gpus 0 --config "{self.health_config}" '
            f'>> "{self.root / "log" / "health-check.out"}" 2>&1\n'
        )
        check.chmod(0o755)


def cluster(root: Path) -> Iterator[SlurmCluster]:
    """A started cluster. A start that fails (a daemon that exits at once: a port that a
    free_port() answer lost to another process meanwhile) is tried once more on new ports."""
    slurm = SlurmCluster(root / "1")
    try:
        try:
            slurm.start()
        except RuntimeError as first:
            slurm.stop()
            slurm = SlurmCluster(root / "2")
            try:
                slurm.start()
            except RuntimeError as second:
                raise RuntimeError(f"{second}\n(first attempt: {first})") from None
        yield slurm
    finally:
        slurm.stop()


def wait_drained(slurm: SlurmCluster, timeout: float = 30.0) -> str:
    wait_until(slurm.drained, timeout, "the node to be drained")
    return slurm.reason()


def settle(seconds: float) -> None:
    """Give a component time to do what it must not do (a bound, not a timing claim)."""
    time.sleep(seconds)
