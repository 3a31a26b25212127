"""Write plain data as TOML (tomllib only reads): for `config show`, whose output must load
back as a configuration file.

Covers what a configuration holds: strings, booleans, integers, floats, arrays, tables and
arrays of tables. TOML has no null: a key whose value is None is left out (it reads as the
setting's default, which is what None is). Written against TOML 1.0 (https://toml.io/en/v1.0.0).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}


def dumps(table: Mapping[str, Any]) -> str:
    """The table as a TOML document: its own keys first, then its tables, each under its
    dotted header, arrays of tables as `[[...]]`."""
    lines: list[str] = []
    _table(table, (), lines)
    return "\n".join(lines).lstrip("\n") + "\n"


def _table(table: Mapping[str, Any], path: tuple[str, ...], lines: list[str]) -> None:
    plain = {
        k: v for k, v in table.items() if v is not None and not _is_table(v) and not _is_tables(v)
    }
    for key, value in plain.items():
        lines.append(f"{key_text(key)} = {value_text(value)}")
    for key, value in table.items():
        if _is_table(value):
            if _has_plain(value) or not value:  # a table of tables needs no header of its own
                lines += ["", f"[{_header((*path, key))}]"]
            _table(value, (*path, key), lines)
        elif _is_tables(value):
            for item in value:
                lines += ["", f"[[{_header((*path, key))}]]"]
                _table(item, (*path, key), lines)


def _has_plain(table: Mapping[str, Any]) -> bool:
    return any(v is not None and not _is_table(v) and not _is_tables(v) for v in table.values())


def _is_table(value: Any) -> bool:
    return isinstance(value, Mapping)


def _is_tables(value: Any) -> bool:
    """A non-empty array whose items are all tables: written as an array of tables."""
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and len(value) > 0
        and all(isinstance(item, Mapping) for item in value)
    )


def _header(path: tuple[str, ...]) -> str:
    return ".".join(key_text(part) for part in path)


def key_text(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else string_text(key)


def string_text(text: str) -> str:
    """A basic string: quotes, backslashes and every control character escaped."""
    out = []
    for char in text:
        if char in _ESCAPES:
            out.append(_ESCAPES[char])
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def value_text(value: Any) -> str:
    """One value in line: an array or a table inside an array is written inline."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return string_text(value)
    if isinstance(value, Mapping):
        items = ", ".join(
            f"{key_text(k)} = {value_text(v)}" for k, v in value.items() if v is not None
        )
        return "{ " + items + " }" if items else "{}"
    if isinstance(value, Sequence):
        return "[" + ", ".join(value_text(item) for item in value if item is not None) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__}: {value!r}")
