"""Typed, frozen configuration objects built from TOML tables, with errors a person can act on.

Each component (collector, exporter, the watcher) declares its own settings as a frozen
dataclass. `build(cls, table, key_path)` validates a TOML table against it: wrong types, values
out of range, unknown keys (a typo must not be silently ignored) all raise `ConfigError` naming
the key and what was expected. The loader in agent/program/config_file.py adds the file name.

Supported field types: bool, int, float (an int is accepted), str, pathlib.Path, Literal[...],
tuple[str, ...] / tuple[int, ...] / tuple[float, ...], a nested settings dataclass, and
`X | None`. Ranges and help text come from `setting(...)`.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

from agent.contracts.errors import ConfigError

T = TypeVar("T")


def setting(
    default: Any = dataclasses.MISSING,
    *,
    factory: Any = dataclasses.MISSING,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: float | None = None,
    help: str = "",
    secret: bool = False,
) -> Any:
    """A dataclass field with validation bounds and a help text for the README reference."""
    metadata = {
        "minimum": minimum,
        "maximum": maximum,
        "exclusive_minimum": exclusive_minimum,
        "help": help,
        "secret": secret,
    }
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple or a factory for collection defaults")
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _type_name(value: Any) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        dict: "a table",
        list: "an array",
    }.get(type(value), type(value).__name__)


def _convert(value: Any, annotation: Any, key: str) -> Any:  # noqa: PLR0912
    origin = get_origin(annotation)
    if origin in (types.UnionType, typing.Union):
        options = [a for a in get_args(annotation) if a is not type(None)]
        if value is None and len(options) < len(get_args(annotation)):
            return None  # only embedded defaults can say None: TOML has no null
        if len(options) != 1:
            raise TypeError(f"{key}: unsupported union {annotation}")
        return _convert(value, options[0], key)
    if origin is Literal:
        allowed = get_args(annotation)
        if value not in allowed:
            shown = ", ".join(repr(a) for a in allowed)
            raise ConfigError(key, f"expected one of {shown}, got {value!r}")
        return value
    if origin is tuple:
        item_type = get_args(annotation)[0]
        if not isinstance(value, list):
            raise ConfigError(key, f"expected an array, got {_type_name(value)}")
        return tuple(_convert(v, item_type, f"{key}[{i}]") for i, v in enumerate(value))
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"expected true or false, got {_type_name(value)} {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"expected an integer, got {_type_name(value)} {value!r}")
        if abs(value) >= 2**63:  # TOML allows 64-bit integers; a larger one fails later
            raise ConfigError(key, "expected an integer that fits in 64 bits")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"expected a number, got {_type_name(value)} {value!r}")
        try:
            number = float(value)
        except OverflowError:
            raise ConfigError(key, "expected a number, got one too large to represent") from None
        if not math.isfinite(number):
            raise ConfigError(key, f"expected a finite number, got {value!r}")
        return number
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"expected a string, got {_type_name(value)} {value!r}")
        return value
    if annotation is Path:
        if not isinstance(value, str) or not value:
            raise ConfigError(key, f"expected a path (a non-empty string), got {value!r}")
        return Path(value)
    if dataclasses.is_dataclass(annotation) and isinstance(annotation, type):
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a table, got {_type_name(value)}")
        return build(annotation, value, key)
    raise TypeError(f"{key}: unsupported settings type {annotation!r}")


def _check_bounds(value: Any, meta: Mapping[str, Any], key: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    minimum, maximum = meta.get("minimum"), meta.get("maximum")
    exclusive_minimum = meta.get("exclusive_minimum")
    if minimum is not None and value < minimum:
        raise ConfigError(key, f"expected a value >= {minimum}, got {value}")
    if exclusive_minimum is not None and value <= exclusive_minimum:
        raise ConfigError(key, f"expected a value > {exclusive_minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ConfigError(key, f"expected a value <= {maximum}, got {value}")


def build(cls: type[T], table: Mapping[str, Any], path: str = "") -> T:
    """Validate `table` against the settings dataclass `cls` and return a frozen instance.

    Missing keys take the dataclass defaults; unknown keys are an error that lists the valid
    ones. A `ValueError` raised by the dataclass's own `__post_init__` becomes a ConfigError
    on the table's key path.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(table) - set(fields))
    if unknown:
        valid = ", ".join(sorted(fields)) or "(none)"
        raise ConfigError(
            _join(path, unknown[0]), f"unknown key (a typo?); valid keys here: {valid}"
        )
    values: dict[str, Any] = {}
    for name, spec in fields.items():
        key = _join(path, name)
        if name not in table:
            has_default = (
                spec.default is not dataclasses.MISSING
                or spec.default_factory is not dataclasses.MISSING
            )
            if not has_default:
                raise ConfigError(key, "required key is missing")
            continue
        value = _convert(table[name], hints[name], key)
        _check_bounds(value, spec.metadata, key)
        values[name] = value
    try:
        return cls(**values)
    except ConfigError as exc:
        if exc.key and path and not exc.key.startswith(path):
            raise ConfigError(_join(path, exc.key), exc.message) from None
        raise
    except ValueError as exc:
        raise ConfigError(path, str(exc)) from None


def to_table(obj: Any, *, mask_secrets: bool = True) -> dict[str, Any]:
    """A settings object back to plain TOML-like data, secret values masked unless asked."""
    out: dict[str, Any] = {}
    for spec in dataclasses.fields(obj):
        value = getattr(obj, spec.name)
        if mask_secrets and spec.metadata.get("secret") and value:
            out[spec.name] = "<redacted>"
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            out[spec.name] = to_table(value, mask_secrets=mask_secrets)
        elif isinstance(value, Path):
            out[spec.name] = str(value)
        elif isinstance(value, tuple):
            out[spec.name] = [str(v) if isinstance(v, Path) else v for v in value]
        else:
            out[spec.name] = value
    return out
