"""The agent's configuration: gpuwarden.toml judged against every registered component.

With no file the embedded defaults apply, so `gpuwarden run` works on a bare host. Every error
names the file, the key and what was expected, and the command line turns it into exit code 2.
Secrets are read only from files named by `*_file` keys (agent/contracts/config.py).

The files the configuration names are checked as it loads (agent/program/config_loader.py):
the agent's own, and with `with_watch_files` also [watch]'s (config check judges for both).
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


WATCHER_SECTIONS = frozenset({"watch"})
"""Tables only `gpuwarden watch` reads: the agent must not judge their files (a shared
gpuwarden.toml names the watcher's systemd credential, which the agent's user cannot open)."""


def load(path: Path | None, *, with_watch_files: bool = False) -> Config:
    """Load `path`, or the system file if it exists, or the embedded defaults, checking the
    files that `run` reads (and those `watch` reads, if asked)."""
    sections = set(registry.SCHEMA.sections)
    files_of = sections if with_watch_files else sections - WATCHER_SECTIONS
    return load_with(path, registry.SCHEMA, files_of)
