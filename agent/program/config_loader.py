"""Reading gpuwarden.toml into typed, frozen settings, judged against a `Schema`.

This module knows no component: a schema says which settings type each table has.
agent/program/config_file.py judges against the whole agent (the registry); the watcher
judges `[watch]` alone, so it never imports a collector.

With no file the embedded defaults apply, so `gpuwarden run` works on a bare host. Every error
names the file, the key and what was expected, and the command line turns it into exit code 2.
Secrets are read only from files named by `*_file` keys, and a secret file that other users can
read is refused.

`load` also checks every file the configuration names (agent/contracts/settings.py,
`check_files`) where the command reads it: the tables of the schema (or those named), skipping
a component that is disabled. `config check`, `run` and `watch` thus share one judgement and
one message for each file.
"""

from __future__ import annotations

import dataclasses
import time
import tomllib
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from agent.contracts.collector import CollectorSettings, CollectorSpec
from agent.contracts.config import EMBEDDED, TOP_LEVEL_TABLES, Config, CoreSettings
from agent.contracts.errors import ConfigError
from agent.contracts.settings import FileProblem, build, check_files, read_regular, to_table

DEFAULT_CONFIG_PATH = Path("/etc/gpuwarden/gpuwarden.toml")
T = TypeVar("T")


@dataclass(frozen=True)
class Schema:
    """The tables a command judges: settings type per top-level table, and the collectors.

    Tables of TOP_LEVEL_TABLES that a schema leaves out must still be tables, but are not
    judged (the watcher does not know the collectors' settings, and must not import them)."""

    sections: Mapping[str, type[Any]]
    collectors: Mapping[str, CollectorSpec[Any]] = field(default_factory=dict)


def parse(data: Mapping[str, Any], source: str, schema: Schema) -> Config:
    """Validate parsed TOML data against `schema`. Raises ConfigError (with the file name)
    on any problem."""
    try:
        return _parse(data, source, schema)
    except ConfigError as exc:
        raise exc.with_file(source) from None


def _parse(data: Mapping[str, Any], source: str, schema: Schema) -> Config:
    core_keys = {field.name for field in dataclasses.fields(CoreSettings)}
    unknown = sorted(set(data) - core_keys - set(TOP_LEVEL_TABLES))
    if unknown:
        valid = ", ".join(sorted(core_keys | set(TOP_LEVEL_TABLES)))
        raise ConfigError(unknown[0], f"unknown key (a typo?); valid top-level keys: {valid}")
    core = build(CoreSettings, {k: v for k, v in data.items() if k in core_keys})
    for name in TOP_LEVEL_TABLES:
        if not isinstance(data.get(name, {}), dict):
            raise ConfigError(name, "expected a table")

    sections: dict[str, Any] = {}
    for name, settings_type in sorted(schema.sections.items()):
        sections[name] = build(settings_type, data.get(name, {}), name)

    collector_tables = data.get("collectors", {})
    collectors: dict[str, CollectorSettings] = {}
    if schema.collectors:
        unknown = sorted(set(collector_tables) - set(schema.collectors))
        if unknown:
            valid = ", ".join(sorted(schema.collectors))
            raise ConfigError(f"collectors.{unknown[0]}", f"unknown collector; known: {valid}")
    for name, spec in schema.collectors.items():
        table = collector_tables.get(name, {})
        if not isinstance(table, dict):
            raise ConfigError(f"collectors.{name}", "expected a table")
        defaults = spec.defaults()
        merged = {**to_table(defaults, mask_secrets=False), **table}
        collectors[name] = build(spec.settings_type, merged, f"collectors.{name}")
    return Config(core=core, sections=sections, collectors=collectors, source=source)


SETTLE = 0.5
"""Seconds a file must stay unchanged before it is read, and while it is read."""
SETTLE_BOUND = 10.0
"""Seconds a read waits for a file that keeps changing (or is missing) before it refuses it."""


def settled(
    path: Path | None,
    read: Callable[[], T],
    *,
    quiet: float = SETTLE,
    bound: float = SETTLE_BOUND,
    again: str = "send SIGHUP again once it is written",
) -> T:
    """`read()` the configuration once the file at `path` (None: the system file, if it
    exists) is written: unchanged for `quiet` seconds, and through the read. The start and
    every reload read this way.

    A file truncated and written again in place (an editor, `cat >`, a tool that does not
    rename), still being appended to, or replaced by a rename (missing for a moment where the
    tool unlinks it first) is empty, half written or gone for a moment: a part cut at a line
    is valid TOML and would be taken as meant (collectors back to their defaults, one the
    file disables started). A file whose last change is `quiet` seconds old is read at once
    (a start does not wait for a file written long ago). A read that fails while the file
    was changing is tried again; one that fails on a file that stood still raises its own
    error (it names the file, the key and what was expected). A file still changing (or
    missing after being there) after `bound` seconds is refused with ConfigError; `again`
    says what to do then."""
    target = path
    if target is None and DEFAULT_CONFIG_PATH.exists():
        target = DEFAULT_CONFIG_PATH
    if target is None:
        return read()
    deadline = time.monotonic() + bound
    seen = _identity(target)
    wait = not _quiet_since(target, quiet)
    while True:
        if wait:
            time.sleep(quiet)
        wait = True
        now = _identity(target)
        if now == seen:
            try:
                value = read()
            except ConfigError:
                if _identity(target) == seen or time.monotonic() >= deadline:
                    raise
            else:
                if _identity(target) == seen:
                    return value
            now = _identity(target)
        if time.monotonic() >= deadline:
            raise ConfigError(
                "",
                f"the file kept changing for {bound:g} s (still being written?); expected a "
                f"finished file: {again}",
                str(target),
            )
        seen = now


def _identity(path: Path) -> tuple[int, ...] | None:
    """What changes when a file is written or replaced (None: it cannot be read now)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _quiet_since(path: Path, quiet: float) -> bool:
    """The file's last change (its ctime: a write, a rename, a chmod; no tool sets it) is at
    least `quiet` seconds old by the wall clock."""
    try:
        changed = path.stat().st_ctime
    except OSError:
        return False
    return time.time() - changed - quiet >= 0


def load(path: Path | None, schema: Schema, files_of: Collection[str] | None = None) -> Config:
    """Load `path`, or the system file if it exists, or the embedded defaults, judge it
    against `schema` and check the files named in the sections `files_of` (None: every
    section of the schema), the core settings and the collectors."""
    cfg = _load(path, schema)
    try:
        check_config_files(cfg, files_of)
    except ConfigError as exc:
        raise exc.with_file(cfg.source) from None
    return cfg


def check_config_files(cfg: Config, files_of: Collection[str] | None = None) -> None:
    """Check the files named by the settings a command reads. A disabled sink or collector
    (`enabled = false`) reads none, so its files are not judged."""
    check_files(cfg.core)
    for name, section in sorted(cfg.sections.items()):
        if (files_of is None or name in files_of) and getattr(section, "enabled", True):
            check_files(section, name)
    for name, settings in cfg.collectors.items():
        if settings.enabled:
            check_files(settings, f"collectors.{name}")


def _load(path: Path | None, schema: Schema) -> Config:
    if path is None:
        if not DEFAULT_CONFIG_PATH.exists():
            return parse({}, EMBEDDED, schema)
        path = DEFAULT_CONFIG_PATH
    try:
        raw = read_regular(path)  # never opens a FIFO or a device: it could block forever
    except FileProblem as exc:
        reason = str(exc).removeprefix(f"{path}: ").removeprefix(f"{path} ")
        raise ConfigError(
            "",
            f"cannot read the configuration: {reason}; expected a regular file (TOML)",
            str(path),
        ) from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError("", f"not UTF-8 text: {exc}", str(path)) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("", f"TOML syntax error: {exc}", str(path)) from None
    except RecursionError:
        # tomllib recurses once per nesting level: a few hundred nested arrays or inline
        # tables exhaust the stack. Not a traceback: the same clear error as a syntax error.
        raise ConfigError(
            "", "arrays or inline tables nested too deeply for the TOML parser", str(path)
        ) from None
    except Exception as exc:  # any other parser failure is still a bad file, not a crash
        raise ConfigError(
            "", f"the TOML parser failed: {type(exc).__name__}: {exc}", str(path)
        ) from None
    return parse(data, str(path), schema)
