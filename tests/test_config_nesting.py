"""A configuration file the TOML parser cannot read (nested too deeply: RecursionError, or any
other failure of the parser) is a ConfigError naming the file, for every command that loads it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.contracts.errors import ConfigError
from agent.program import config_file as config
from tests.support.agent_proc import REPO


def deep_array(depth: int) -> str:
    return "deep = " + "[" * depth + "]" * depth + "\n"


def deep_table(depth: int) -> str:
    return "deep = " + "{ a = " * depth + "1" + " }" * depth + "\n"


class TestLoad:
    """Loading turns every failure of the parser into a ConfigError naming the file."""

    @pytest.mark.parametrize("body", [deep_array(2000), deep_table(3000), deep_array(200_000)])
    def test_nesting_is_a_config_error(self, tmp_path: Path, body: str) -> None:
        path = tmp_path / "deep.toml"
        path.write_text(body)
        with pytest.raises(ConfigError) as caught:
            config.load(path)
        assert caught.value.file == str(path)
        assert "nested too deeply" in caught.value.message

    @pytest.mark.parametrize("command", [["config", "check"], ["run"]])
    def test_commands_say_so_cleanly(self, tmp_path: Path, command: list[str]) -> None:
        path = tmp_path / "deep.toml"
        path.write_text(deep_array(5000))
        result = subprocess.run(
            [sys.executable, "-m", "agent", *command, "--config", str(path)],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 2, result.stderr[-2000:]
        assert f"configuration error: {path}: " in result.stderr
        assert "nested too deeply" in result.stderr
        assert "Traceback" not in result.stderr
