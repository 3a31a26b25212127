"""Human output for every command, one way: colour only on a terminal and never with NO_COLOR
set (https://no-color.org), the width of the terminal (COLUMNS first), text wrapped at word
boundaries with a hanging indent, and no raw `None` for a value that is not known.

Machine output (`--json`) does not go through here.
"""

from __future__ import annotations

import os
import re
import shutil
import textwrap
from collections.abc import Iterable
from typing import TextIO

DEFAULT_WIDTH = 100
"""Columns when the output is not a terminal and COLUMNS is not set (a pipe, a file, a CI log)."""
MAX_WIDTH = 120
"""Wider lines are hard to read even on a wide terminal."""
MIN_TEXT = 30
"""Text wrapped after a hanging indent keeps at least this many columns."""
DEFAULT_ROWS = 40
"""A screenful when the height is not known."""
UNKNOWN = "unknown"
"""What a human reads for a value that is absent, in place of Python's `None`."""

_ANSI = re.compile(r"\x1b\[[0-9;]*m")

GREEN, YELLOW, RED, DIM, BOLD = "32", "33", "31;1", "2", "1"


def use_colour(stream: TextIO) -> bool:
    """Colour on a terminal only; NO_COLOR set to anything but the empty string turns it off
    (no-color.org), and so does TERM=dumb."""
    if os.environ.get("NO_COLOR", ""):
        return False
    if os.environ.get("TERM") == "dumb":
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _is_tty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def width(stream: TextIO) -> int:
    """Columns to fill: COLUMNS when set, else the terminal's, else DEFAULT_WIDTH; at most
    MAX_WIDTH. shutil.get_terminal_size reads COLUMNS first and asks stdout's terminal."""
    if not os.environ.get("COLUMNS", "").strip().isdigit() and not _is_tty(stream):
        return DEFAULT_WIDTH
    columns = shutil.get_terminal_size((DEFAULT_WIDTH, DEFAULT_ROWS)).columns
    return max(MIN_TEXT + 10, min(columns, MAX_WIDTH))


def rows(stream: TextIO) -> int:
    """Lines in a screenful: LINES when set, else the terminal's, else DEFAULT_ROWS."""
    if not os.environ.get("LINES", "").strip().isdigit() and not _is_tty(stream):
        return DEFAULT_ROWS
    return max(10, shutil.get_terminal_size((DEFAULT_WIDTH, DEFAULT_ROWS)).lines)


def paint(text: str, code: str, colour: bool) -> str:
    return f"\x1b[{code}m{text}\x1b[0m" if colour and code else text


def visible_len(text: str) -> int:
    """Columns a string takes on screen (colour codes take none)."""
    return len(_ANSI.sub("", text))


def wrap(text: str, columns: int, first: str = "", indent: int | None = None) -> list[str]:
    """`text` after the prefix `first`, wrapped at word boundaries to `columns`, every further
    line indented by `indent` (default: the width of `first`). A word longer than the room
    (a path, a UUID) is cut only when it would not fit on a line of its own. `first` may be
    coloured: its codes take no columns."""
    head = visible_len(first)
    hang = head if indent is None else indent
    columns = max(columns, hang + MIN_TEXT, head + MIN_TEXT)
    wrapper = textwrap.TextWrapper(
        columns,
        initial_indent=" " * head,  # placeholder of the prefix's visible width
        subsequent_indent=" " * hang,
        break_on_hyphens=False,
        break_long_words=True,
    )
    lines = wrapper.wrap(text) or [" " * head]
    return [first + lines[0][head:], *lines[1:]]


def fit(text: str, columns: int) -> str:
    """One cell cut to `columns` with an ellipsis when longer."""
    return text if len(text) <= columns else text[: max(columns - 1, 0)] + "…"


def shown(value: object, unknown: str = UNKNOWN) -> str:
    """A value for a human: `unknown` (or what the caller names) where it is None or empty."""
    if value is None or value == "":
        return unknown
    return str(value)


def join(items: Iterable[str], sep: str = ", ") -> str:
    return sep.join(item for item in items if item)
