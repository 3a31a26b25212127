"""gpuwarden diag (not implemented yet)."""

from __future__ import annotations

import argparse

from agent.commands._stub import not_implemented


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def main(args: argparse.Namespace) -> int:
    return not_implemented("diag")
