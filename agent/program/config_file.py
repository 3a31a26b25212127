"""Loading gpuwarden.toml into typed, frozen settings (ARCHITECTURE.md, configuration contract).

With no file the embedded defaults apply, so `gpuwarden run` works on a bare host. Every error
names the file, the key and what was expected, and the command line turns it into exit code 2.
Secrets are read only from files named by `*_file` keys, and a secret file that other users can
read is refused.
"""

from __future__ import annotations

import os
import re
import socket
import stat
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from agent.contracts.collector import CollectorSettings
from agent.contracts.errors import ConfigError
from agent.contracts.settings import build, setting, to_table
from agent.program import registry

T = TypeVar("T")

DEFAULT_CONFIG_PATH = Path("/etc/gpuwarden/gpuwarden.toml")
EMBEDDED = "<embedded defaults>"
LogLevel = Literal["debug", "info", "warning", "error"]
NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
"""What a node id may be: one MQTT topic level the watcher accepts (agent/program/watch/payloads.py)."""


def _default_state_dir() -> Path:
    # systemd's StateDirectory= sets this; outside systemd the FHS place applies.
    env = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    return Path(env) if env else Path("/var/lib/gpuwarden")


@dataclass(frozen=True)
class CoreSettings:
    node_id: str = setting("", help="node name in topics and labels; empty: the host name")
    state_dir: Path = setting(
        factory=_default_state_dir,
        help="state database, outbox, benchmark history",
    )
    log_level: LogLevel = setting("info", help="debug, info, warning or error")

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


def parse(data: Mapping[str, Any], source: str = EMBEDDED) -> Config:
    """Validate parsed TOML data. Raises ConfigError (with the file name) on any problem."""
    try:
        return _parse(data, source)
    except ConfigError as exc:
        raise exc.with_file(source) from None


def _parse(data: Mapping[str, Any], source: str) -> Config:
    section_names = set(registry.SINKS) | set(registry.SECTIONS)
    core_keys = {"node_id", "state_dir", "log_level"}
    unknown = sorted(set(data) - core_keys - section_names - {"collectors"})
    if unknown:
        valid = ", ".join(sorted(core_keys | section_names | {"collectors"}))
        raise ConfigError(unknown[0], f"unknown key (a typo?); valid top-level keys: {valid}")
    core = build(CoreSettings, {k: v for k, v in data.items() if k in core_keys})

    sections: dict[str, Any] = {}
    for name in sorted(section_names):
        table = data.get(name, {})
        if not isinstance(table, dict):
            raise ConfigError(name, "expected a table")
        sections[name] = build(registry.section_type(name), table, name)

    collector_tables = data.get("collectors", {})
    if not isinstance(collector_tables, dict):
        raise ConfigError("collectors", "expected a table of [collectors.<name>] tables")
    unknown = sorted(set(collector_tables) - set(registry.COLLECTORS))
    if unknown:
        valid = ", ".join(sorted(registry.COLLECTORS))
        raise ConfigError(f"collectors.{unknown[0]}", f"unknown collector; known: {valid}")
    collectors: dict[str, CollectorSettings] = {}
    for name in registry.COLLECTORS:
        spec = registry.collector_spec(name)
        table = collector_tables.get(name, {})
        if not isinstance(table, dict):
            raise ConfigError(f"collectors.{name}", "expected a table")
        defaults = spec.defaults()
        merged = {**to_table(defaults, mask_secrets=False), **table}
        collectors[name] = build(spec.settings_type, merged, f"collectors.{name}")
    return Config(core=core, sections=sections, collectors=collectors, source=source)


def load(path: Path | None) -> Config:
    """Load `path`, or the system file if it exists, or the embedded defaults."""
    if path is None:
        if not DEFAULT_CONFIG_PATH.exists():
            return parse({}, EMBEDDED)
        path = DEFAULT_CONFIG_PATH
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError("", f"cannot read the configuration: {exc.strerror}", str(path)) from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError("", f"not UTF-8 text: {exc}", str(path)) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("", f"TOML syntax error: {exc}", str(path)) from None
    return parse(data, str(path))


def read_secret(path: Path, key: str) -> str:
    """Read a secret from a file named by a `*_file` key; refuse files others may read.

    The trailing newline that editors add is removed.
    """
    try:
        info = path.stat()
    except OSError as exc:
        raise ConfigError(key, f"cannot read secret file {path}: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(key, f"secret file {path} is not a regular file")
    if info.st_mode & 0o077:
        raise ConfigError(
            key,
            f"secret file {path} is accessible to other users (mode "
            f"{stat.filemode(info.st_mode)}); run: chmod 600 {path}",
        )
    try:
        return path.read_text(encoding="utf-8").rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(key, f"cannot read secret file {path}: {exc}") from None
