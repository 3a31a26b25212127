"""The role's filters. `to_gpuwarden_toml`: a mapping rendered as TOML, for the gpuwarden.toml
template. `to_prometheus_label`: a value as a file_sd label value (a string).

Jinja has no TOML writer, and TOML written by string templates breaks on the first value with
a quote, a backslash or a newline in it, so the role renders the whole file from one mapping
here. It runs on the Ansible controller, which need not have gpuwarden installed: standard
library only. What it cannot write (None, a set, a lone surrogate, a mapping with a key that is
not a string) is an error naming the key's dotted path, never a file that parses differently.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
# TOML basic strings: these must be escaped; the others of U+0000-U+001F and U+007F too.
ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}


class TomlRenderError(ValueError):
    """A value TOML cannot hold, with where it is."""

    def __init__(self, path: Sequence[str], problem: str) -> None:
        where = ".".join(path) or "(the top level)"
        super().__init__(f"gpuwarden configuration, key {where}: {problem}")


def to_toml(config: Mapping[str, object]) -> str:
    """`config` as a TOML document: the scalars, arrays and inline tables of a table first,
    then its sub-tables as `[a.b]` sections (an empty table too, so `{"collectors": {"gpu":
    {}}}` survives the round trip)."""
    if not isinstance(config, Mapping):
        raise TomlRenderError([], f"expected a mapping, got {type(config).__name__}")
    lines: list[str] = []
    _table(config, [], lines)
    return "\n".join(lines).lstrip("\n") + "\n"


def _table(table: Mapping[str, object], path: list[str], lines: list[str]) -> None:
    subtables = []
    for key, value in table.items():
        _check_key(key, path)
        if isinstance(value, Mapping):
            subtables.append((key, value))
        else:
            lines.append(f"{_key(key)} = {_value(value, [*path, key])}")
    for key, value in subtables:
        # A table holding only tables needs no header of its own ([collectors] before
        # [collectors.gpu]); an empty one does, or it would vanish.
        if not value or not all(isinstance(v, Mapping) for v in value.values()):
            lines.extend(["", "[" + ".".join(_key(k) for k in [*path, key]) + "]"])
        _table(value, [*path, key], lines)


def _check_key(key: object, path: list[str]) -> None:
    if not isinstance(key, str):
        raise TomlRenderError(path, f"a key must be a string, got {key!r}")


def _key(key: str) -> str:
    return key if BARE_KEY.fullmatch(key) else _string(key, [key])


def _value(value: object, path: list[str]) -> str:
    # bool before int: True is an int in Python, and `1` is no boolean in TOML.
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _float(value)
    if isinstance(value, str):
        return _string(value, path)
    if isinstance(value, Mapping):
        items = []
        for key, item in value.items():
            _check_key(key, path)
            items.append(f"{_key(key)} = {_value(item, [*path, key])}")
        return "{" + ", ".join(items) + "}"
    if isinstance(value, Sequence) and not isinstance(value, bytes | bytearray):
        return "[" + ", ".join(_value(v, [*path, str(i)]) for i, v in enumerate(value)) + "]"
    if value is None:
        raise TomlRenderError(path, "TOML has no null: leave the key out for its default")
    raise TomlRenderError(path, f"cannot be written as TOML: {type(value).__name__} {value!r}")


def _float(value: float) -> str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    text = repr(value)
    # repr(1e16) is "1e+16": valid TOML. repr(3.0) is "3.0". Never a bare "3".
    return text if any(c in text for c in ".en") else text + ".0"


def _string(value: str, path: list[str]) -> str:
    out = []
    for char in value:
        code = ord(char)
        if char in ESCAPES:
            out.append(ESCAPES[char])
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\u{code:04X}")
        elif 0xD800 <= code <= 0xDFFF:
            raise TomlRenderError(path, f"a lone surrogate U+{code:04X} is no text")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def to_label(value: object) -> str:
    """A label value as a reader of the YAML wrote it: `false` stays "false" (not Python's
    "False"), 7 becomes "7". Anything but a scalar is an error: a label holds one value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int):
        return str(value)
    if isinstance(value, float):
        return _float(value)
    raise ValueError(
        "gpuwarden_prometheus_labels: a label value must be a string, number or boolean, "
        f"got {type(value).__name__} {value!r}"
    )


class FilterModule:
    """Ansible's entry point for a role's filter_plugins/."""

    def filters(self) -> dict[str, object]:
        return {"to_gpuwarden_toml": to_toml, "to_prometheus_label": to_label}
