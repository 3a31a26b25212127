"""The agent's configuration as typed values: the core settings and the whole `Config`.

agent/program/config_file.py reads gpuwarden.toml into these; every layer may read them.
Secrets are read only from files named by `*_file` keys, and a secret file that other users can
read is refused (`read_secret`).
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from agent.contracts.collector import CollectorSettings
from agent.contracts.errors import ConfigError
from agent.contracts.settings import read_file, setting

EMBEDDED = "<embedded defaults>"
TOP_LEVEL_TABLES = ("actions", "collectors", "heartbeat", "mqtt", "pause", "prometheus", "watch")
"""Every top-level table of gpuwarden.toml. A command that judges only some of them (the
watcher reads `[watch]`) still knows the others' names, so a typo is an error everywhere.
agent/program/registry.py checks this list against the tables it defines."""
"""The source name of a configuration built from no file."""
T = TypeVar("T")

LogLevel = Literal["debug", "info", "warning", "error"]
NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
"""What a node id may be: one MQTT topic level the watcher accepts (agent/program/watch/payloads.py)."""


def _default_state_dir() -> Path:
    # systemd's StateDirectory= sets this; outside systemd the FHS place applies.
    env = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    return Path(env) if env else Path("/var/lib/gpuwarden")


def _default_runtime_dir() -> Path:
    # systemd's RuntimeDirectory= sets this (a tmpfs: it outlives a restart of the agent,
    # RuntimeDirectoryPreserve=yes, and not a reboot); outside systemd the FHS place applies.
    env = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    return Path(env) if env else Path("/run/gpuwarden")


@dataclass(frozen=True)
class CoreSettings:
    node_id: str = setting("", help="node name in topics and labels; empty: the host name")
    state_dir: Path = setting(
        factory=_default_state_dir,
        help="state database, outbox, benchmark history",
    )
    runtime_dir: Path = setting(
        factory=_default_runtime_dir,
        help="where what the state store could not take (a full state disk, a store in "
        "memory) is spilled, kept up to date while it cannot and at a clean stop, for the "
        "next start to adopt",
    )
    log_level: LogLevel = setting("info", help="debug, info, warning or error")
    state_open_timeout: float = setting(
        10.0,
        minimum=0.5,
        maximum=300.0,
        help="seconds opening the state database may take (at start, and each retry); past "
        "that the state dir counts as hung and the agent keeps state in memory",
    )
    state_retry_interval: float = setting(
        60.0,
        minimum=1.0,
        maximum=3600.0,
        help="seconds between attempts to move a state store kept in memory (the state dir "
        "unusable or hung at start) back to the disk",
    )

    def __post_init__(self) -> None:
        if self.node_id and not NODE_ID.fullmatch(self.node_id):
            raise ConfigError(
                "node_id",
                f"expected letters, digits and . _ : - (up to 128, starting with a letter or "
                f"digit), got {self.node_id!r}: it is an MQTT topic level and a label value",
            )


@dataclass(frozen=True)
class Config:
    core: CoreSettings
    sections: Mapping[str, Any]
    collectors: Mapping[str, CollectorSettings]
    source: str = EMBEDDED

    @property
    def node_id(self) -> str:
        return self.core.node_id or socket.gethostname().split(".")[0] or "localhost"

    @property
    def state_dir(self) -> Path:
        return self.core.state_dir

    def section(self, name: str, kind: type[T]) -> T:
        value = self.sections[name]
        if not isinstance(value, kind):
            raise TypeError(f"section {name} is {type(value).__name__}, not {kind.__name__}")
        return value

    def collector(self, name: str) -> CollectorSettings:
        return self.collectors[name]


def read_secret(path: Path, key: str) -> str:
    """Read a secret from a file named by a `*_file` key, by the rules the loader checked it
    with (settings.read_file): a regular file that other users cannot access, UTF-8 text.

    The trailing newline that editors add is removed.
    """
    return read_file(path, "secret", key).decode("utf-8").rstrip("\r\n")
