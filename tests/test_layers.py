"""The layers hold at run time too: what a command loads is what it runs (docs/ARCHITECTURE.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agent.contracts.config import TOP_LEVEL_TABLES
from agent.contracts.errors import ConfigError
from agent.program import config_loader, registry
from agent.program.watch.settings import WatchSettings

HEAVY = ("pynvml", "torch", "bcrypt", "collectors", "agent.program.registry")


def loaded_after(code: str) -> list[str]:
    """Top-level module names (and the registry) loaded by a fresh interpreter running code."""
    probe = (
        f"{code}\nimport json, sys\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} | "
        "({'agent.program.registry'} & set(sys.modules)))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    names: list[str] = json.loads(out.stdout.strip().splitlines()[-1])
    return names


class TestWatcherLoadsLittle:
    """The off-node watcher never loads NVML, torch, bcrypt or a collector."""

    def test_watch_command_and_its_config(self, tmp_path: Path) -> None:
        config = tmp_path / "gpuwarden.toml"
        config.write_text('[watch]\nurl = "mqtt://127.0.0.1:1"\n[collectors.gpu]\nenabled = true\n')
        code = (
            "from agent.program.commands import watch\n"
            f"watch.settings_from(watch_args := __import__('argparse').Namespace("
            f"config=__import__('pathlib').Path({str(config)!r}), url=None, inventory=None, "
            "listen=None))"
        )
        loaded = loaded_after(code)
        assert not [name for name in HEAVY if name in loaded], loaded

    def test_the_agent_command_does_load_them(self) -> None:
        """The probe can fail: the daemon's command does load the collectors and NVML."""
        loaded = loaded_after("from agent.program.commands import run")
        assert "collectors" in loaded
        assert "pynvml" in loaded


class TestWatcherSchema:
    """The watcher judges [watch] and the core keys; a typo at the top is still an error."""

    schema = config_loader.Schema(sections={"watch": WatchSettings})

    def test_unknown_top_level_key(self) -> None:
        with pytest.raises(ConfigError, match="wach: unknown key"):
            config_loader.parse({"wach": {}}, "f.toml", self.schema)

    def test_watch_table_is_judged(self) -> None:
        with pytest.raises(ConfigError, match=r"f\.toml: watch\.keepalive"):
            config_loader.parse({"watch": {"keepalive": 0}}, "f.toml", self.schema)

    def test_other_tables_must_be_tables(self) -> None:
        with pytest.raises(ConfigError, match="mqtt: expected a table"):
            config_loader.parse({"mqtt": 3}, "f.toml", self.schema)

    def test_agent_tables_are_named_once(self) -> None:
        assert set(registry.SCHEMA.sections) | {"collectors"} == set(TOP_LEVEL_TABLES)
