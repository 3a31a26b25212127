"""Shared by commands that later work fills in."""

from __future__ import annotations

import sys


def not_implemented(name: str) -> int:
    print(f"gpuwarden {name}: not implemented yet", file=sys.stderr)
    return 2
