"""The agent's configuration: gpuwarden.toml judged against every registered component.

With no file the embedded defaults apply, so `gpuwarden run` works on a bare host. Every error
names the file, the key and what was expected, and the command line turns it into exit code 2.
Secrets are read only from files named by `*_file` keys (agent/contracts/config.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agent.contracts.config import EMBEDDED, NODE_ID, Config, CoreSettings, read_secret
from agent.program import registry
from agent.program.config_loader import DEFAULT_CONFIG_PATH, Schema
from agent.program.config_loader import load as load_with
from agent.program.config_loader import parse as parse_with

# The typed values live in the contracts layer; commands reach them through this module too.
__all__ = [
    "DEFAULT_CONFIG_PATH",
    "EMBEDDED",
    "NODE_ID",
    "Config",
    "CoreSettings",
    "Schema",
    "load",
    "parse",
    "read_secret",
]


def parse(data: Mapping[str, Any], source: str = EMBEDDED) -> Config:
    """Validate parsed TOML data against the whole agent. Raises ConfigError with the file."""
    return parse_with(data, source, registry.SCHEMA)


def load(path: Path | None) -> Config:
    """Load `path`, or the system file if it exists, or the embedded defaults."""
    return load_with(path, registry.SCHEMA)
