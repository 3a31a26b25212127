"""JSON from outside the agent (a checkpoint's header, a file in a diagnostic bundle, a control
request): nesting too deep for the parser is malformed JSON like any other.

`json.loads` raises RecursionError, not a ValueError, for an array or object nested deeper
than the interpreter's recursion limit (about a thousand levels): `[` written 4 KiB times is
enough. Code that catches the parser's errors to report a bad input would let that one escape
and fail the whole command or round instead."""

from __future__ import annotations

import json
from typing import Any


class JsonTooDeep(json.JSONDecodeError):
    """Nested deeper than the parser can follow: malformed for the agent, but a reader that
    must not pass on what it cannot see into (redaction) can tell it from other damage."""

    def __init__(self) -> None:
        super().__init__("nested too deeply to read", "", 0)


def parse_json(text: str | bytes | bytearray) -> Any:
    """`json.loads`, raising `JsonTooDeep` (a `json.JSONDecodeError`, so a ValueError) for
    nesting too deep too."""
    try:
        return json.loads(text)
    except RecursionError:
        raise JsonTooDeep from None


def decode_json_at(text: str, start: int) -> tuple[Any, int]:
    """`json.JSONDecoder().raw_decode(text, start)` with the same guarantee."""
    try:
        return json.JSONDecoder().raw_decode(text, start)
    except RecursionError:
        raise JsonTooDeep from None
