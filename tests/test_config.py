"""Configuration: embedded defaults, typed settings, and clear errors with exit code 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.contracts.collector import CollectorSettings
from agent.contracts.errors import ConfigError
from agent.program import config_file as config
from tests.support.agent_proc import REPO

BAD_FILES: list[tuple[str, str, str]] = [
    # (id, file content, fragment the message must contain)
    ("syntax", "node_id = \n", "TOML syntax error"),
    ("unknown-top", "nodeid = 'x'\n", "nodeid: unknown key (a typo?)"),
    (
        "unknown-section-key",
        "[prometheus]\nlisen = '127.0.0.1:1'\n",
        "prometheus.lisen: unknown key",
    ),
    (
        "wrong-type",
        "[heartbeat]\ninterval = 'fast'\n",
        "heartbeat.interval: expected a number, got a string",
    ),
    (
        "bool-as-string",
        "[prometheus]\nenabled = 'yes'\n",
        "prometheus.enabled: expected true or false",
    ),
    ("below-minimum", "[heartbeat]\ninterval = 0\n", "heartbeat.interval: expected a value >= 0.1"),
    ("bad-listen", "[prometheus]\nlisten = 'localhost'\n", "prometheus.listen: expected host:port"),
    ("bad-port", "[prometheus]\nlisten = '127.0.0.1:70000'\n", "port must be 1-65535"),
    (
        "unknown-collector",
        "[collectors.gpus]\nenabled = true\n",
        "collectors.gpus: unknown collector",
    ),
    (
        "collector-key",
        "[collectors.system]\nintervall = 3\n",
        "collectors.system.intervall: unknown key",
    ),
    (
        "collector-interval",
        "[collectors.system]\ninterval = -1\n",
        "collectors.system.interval: expected a value >= 0.05",
    ),
    ("node-id-slash", "node_id = 'a/b'\n", "node_id: expected letters, digits"),
    ("node-id-control", 'node_id = "a\\u0000b"\n', "node_id: expected letters, digits"),
    (
        "huge-integer",
        "[collectors.system]\ninterval = 1" + "0" * 400 + "\n",
        "collectors.system.interval: expected a number, got one too large",
    ),
    (
        "huge-float",
        "[heartbeat]\ninterval = 1e400\n",
        "heartbeat.interval: expected a finite number",
    ),
    ("log-level", "log_level = 'loud'\n", "log_level: expected one of"),
    ("section-not-table", "heartbeat = 3\n", "heartbeat: expected a table"),
]


class TestDefaults:
    """With no file, the embedded defaults give a working configuration."""

    def test_embedded_defaults(self) -> None:
        cfg = config.parse({})
        assert cfg.source == config.EMBEDDED
        assert cfg.node_id
        assert "system" in cfg.collectors
        assert isinstance(cfg.collectors["system"], CollectorSettings)
        assert cfg.collectors["system"].interval == 15.0  # the spec's own default

    def test_file_overrides_only_what_it_names(self, tmp_path: Path) -> None:
        path = tmp_path / "c.toml"
        path.write_text("node_id = 'n1'\n[collectors.system]\ntimeout = 2.5\n")
        cfg = config.load(path)
        assert cfg.node_id == "n1"
        assert cfg.collectors["system"].timeout == 2.5
        assert cfg.collectors["system"].interval == 15.0

    def test_settings_are_frozen(self) -> None:
        cfg = config.parse({})
        with pytest.raises(AttributeError):
            cfg.core.node_id = "x"  # type: ignore[misc]


class TestBadFiles:
    """Each bad file names the file, the key and what was expected."""

    @pytest.mark.parametrize(
        ("content", "fragment"), [(c, f) for _, c, f in BAD_FILES], ids=[i for i, _, _ in BAD_FILES]
    )
    def test_load_raises_with_message(self, tmp_path: Path, content: str, fragment: str) -> None:
        path = tmp_path / "bad.toml"
        path.write_text(content)
        with pytest.raises(ConfigError) as info:
            config.load(path)
        assert str(path) in str(info.value)
        assert fragment in str(info.value)

    def test_missing_file(self, tmp_path: Path) -> None:
        with pytest.raises(ConfigError, match="cannot read the configuration"):
            config.load(tmp_path / "nope.toml")

    @pytest.mark.parametrize("command", [["config", "check"], ["run"]])
    def test_cli_exit_code_2(self, tmp_path: Path, command: list[str]) -> None:
        path = tmp_path / "bad.toml"
        path.write_text("[heartbeat]\ninterval = 'fast'\n")
        result = subprocess.run(
            [sys.executable, "-m", "agent", *command, "--config", str(path)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert result.returncode == 2
        assert f"{path}: heartbeat.interval: expected a number" in result.stderr

    def test_config_check_ok(self, tmp_path: Path) -> None:
        path = tmp_path / "good.toml"
        path.write_text("node_id = 'ok-node'\n")
        result = subprocess.run(
            [sys.executable, "-m", "agent", "config", "check", "--config", str(path)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert result.returncode == 0, result.stderr
        assert "configuration ok" in result.stdout


class TestSecrets:
    """Secrets come from files that only their owner can read."""

    def test_reads_private_file(self, tmp_path: Path) -> None:
        secret = tmp_path / "pw"
        secret.write_text("s3cret\n")
        secret.chmod(0o600)
        assert config.read_secret(secret, "mqtt.password_file") == "s3cret"

    @pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
    def test_refuses_file_others_can_read(self, tmp_path: Path, mode: int) -> None:
        secret = tmp_path / "pw"
        secret.write_text("s3cret\n")
        secret.chmod(mode)
        with pytest.raises(ConfigError, match="chmod 600") as info:
            config.read_secret(secret, "mqtt.password_file")
        assert info.value.key == "mqtt.password_file"
        assert "s3cret" not in str(info.value)

    def test_missing_secret_file(self, tmp_path: Path) -> None:
        with pytest.raises(ConfigError, match="none: No such file or directory; expected"):
            config.read_secret(tmp_path / "none", "mqtt.password_file")
