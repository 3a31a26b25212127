"""The systemd units: `systemd-analyze verify` in a scratch root, and the security exposure."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from exporters.http import MAX_CONNECTIONS
from exporters.listener import BACKLOG

ROOT = Path(__file__).resolve().parents[1]
UNITS = ROOT / "systemd"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze") or "/usr/bin/systemd-analyze"
SYSTEM_UNITS = Path("/usr/lib/systemd/system")
EXEC = "/opt/gpuwarden/venv/bin/gpuwarden"


def analyze(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SYSTEMD_ANALYZE, *map(str, args)], capture_output=True, text=True, timeout=120, check=False
    )


def exposure(unit: Path) -> float:
    done = analyze("security", "--offline=true", "--no-pager", unit)
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", done.stdout)
    assert match, done.stdout + done.stderr
    return float(match.group(1))


def unit_root(tmp_path: Path, with_executable: bool = True) -> Path:
    """A scratch root with the stock system units, ours, and a stub at the ExecStart path.

    verify needs the targets a unit pulls in (sysinit.target, ...) and the executables it
    names; the real host's /opt is not ours to write.
    """
    root = tmp_path / "root"
    shutil.copytree(SYSTEM_UNITS, root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    for unit in UNITS.glob("*.service"):
        shutil.copy(unit, root / "etc/systemd/system" / unit.name)
    (root / "bin").mkdir()
    shutil.copy("/bin/kill", root / "bin/kill")
    if with_executable:
        stub = root / EXEC.lstrip("/")
        stub.parent.mkdir(parents=True)
        stub.write_text("#!/bin/sh\nexit 0\n")
        stub.chmod(0o755)
    return root


class TestVerify:
    """systemd-analyze verify accepts both units, and notices a missing executable."""

    @pytest.mark.parametrize("unit", ["gpuwarden.service", "gpuwarden-watch.service"])
    def test_verify(self, tmp_path: Path, unit: str) -> None:
        done = analyze("verify", f"--root={unit_root(tmp_path)}", unit)
        assert done.returncode == 0, done.stderr
        assert done.stderr.strip() == ""

    def test_missing_executable_is_caught(self, tmp_path: Path) -> None:
        done = analyze(
            "verify", f"--root={unit_root(tmp_path, with_executable=False)}", "gpuwarden.service"
        )
        assert done.returncode != 0
        assert "not executable" in done.stderr

    def test_unknown_directive_is_reported(self, tmp_path: Path) -> None:
        root = unit_root(tmp_path)
        unit = root / "etc/systemd/system/gpuwarden.service"
        unit.write_text(unit.read_text().replace("UMask=0077", "UMask=0077\nProtectEverything=yes"))
        done = analyze("verify", f"--root={root}", "gpuwarden.service")
        assert "ProtectEverything" in done.stderr


class TestSecurity:
    """Exposure (systemd-analyze security --offline): agent <= 2.0, watcher tighter."""

    def test_agent_exposure(self) -> None:
        assert exposure(UNITS / "gpuwarden.service") <= 2.0

    def test_watcher_exposure(self) -> None:
        assert exposure(UNITS / "gpuwarden-watch.service") <= 1.5

    def test_agent_keeps_what_it_needs(self) -> None:
        text = (UNITS / "gpuwarden.service").read_text()
        settings = dict(re.findall(r"^(\w+)=(.*)$", text, re.MULTILINE))
        # These would hide /dev/nvidia*, /dev/kmsg, or other users' processes.
        assert settings.get("PrivateDevices") == "no"
        assert settings.get("ProtectKernelLogs") == "no"
        assert "ProtectProc" not in settings
        assert "PrivateUsers" not in settings  # CAP_SYSLOG must count in the host namespace
        assert settings["CapabilityBoundingSet"] == "CAP_SYSLOG"
        assert settings["Type"] == "notify"
        assert "WatchdogSec" in settings
        allowed = re.findall(r"^DeviceAllow=(.*)$", text, re.MULTILINE)
        assert "/dev/kmsg r" in allowed
        assert {"char-nvidia-frontend rw", "char-nvidia-uvm rw", "/dev/nvidiactl rw"} <= set(
            allowed
        )

    @pytest.mark.parametrize("unit", ["gpuwarden.service", "gpuwarden-watch.service"])
    def test_open_files_above_a_burst_of_accepts(self, unit: str) -> None:
        """LimitNOFILE= is raised over systemd's 1024 (the process cannot raise its own under
        ~@resources): the listener may accept a whole BACKLOG of queued connects at once,
        besides its budget of kept connections and the process's own files."""
        text = (UNITS / unit).read_text()
        (value,) = re.findall(r"^LimitNOFILE=(\d+)$", text, re.MULTILINE)  # soft = hard
        assert int(value) >= BACKLOG + MAX_CONNECTIONS + 1024
        assert int(value) <= 524288  # systemd's own default hard limit: nothing unusual asked
        assert "~@privileged @resources" in text  # why the unit, not the process, raises it

    def test_a_loose_unit_scores_worse(self, tmp_path: Path) -> None:
        loose = tmp_path / "loose.service"
        loose.write_text("[Service]\nExecStart=/bin/true\n")
        assert exposure(loose) > 5.0


class TestSysusers:
    """The sysusers.d entry creates the gpuwarden system user in a scratch root."""

    def test_creates_user(self, tmp_path: Path) -> None:
        (tmp_path / "etc").mkdir()
        done = subprocess.run(
            ["systemd-sysusers", f"--root={tmp_path}", str(UNITS / "gpuwarden.sysusers")],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        passwd = (tmp_path / "etc/passwd").read_text()
        entry = next(line for line in passwd.splitlines() if line.startswith("gpuwarden:"))
        fields = entry.split(":")
        assert int(fields[2]) < 1000  # a system user
        assert fields[5] == "/var/lib/gpuwarden"
        assert fields[6] in ("/usr/sbin/nologin", "/sbin/nologin")
