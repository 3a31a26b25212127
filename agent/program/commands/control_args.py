"""What `pause`, `resume` and `repairs` share: finding the agent and talking to it."""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
from pathlib import Path
from typing import Any

from agent.contracts.errors import ConfigError
from agent.program import config_file
from agent.program.control_client import ControlError, request

TIMEOUT = 120.0
"""Seconds to wait for the agent: a pause waits for rounds in flight, a resume for a round."""


def add(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        metavar="PATH",
        help="the running agent's state directory (default: the configuration's state_dir)",
    )
    parser.add_argument("--json", action="store_true", help="print the agent's answer as JSON")


def caller() -> dict[str, str]:
    """Who is asking, as the user would say it (the socket sees root under sudo)."""
    name = os.environ.get("SUDO_USER") or getpass.getuser()
    return {"by": name} if name else {}


def printed(args: argparse.Namespace, reply: dict[str, Any]) -> bool:
    """Print the answer as JSON (`--json`), or the agent's error: True when one was, False
    when the command is to say it in its own words."""
    if args.json:
        print(json.dumps(reply, indent=2))
    elif reply.get("error"):
        print(f"gpuwarden {args.command}: {reply['error']}", file=sys.stderr)
    else:
        return False
    return True


def send(args: argparse.Namespace, payload: dict[str, Any]) -> dict[str, Any] | int:
    """The agent's answer, or an exit code after printing why there is none."""
    command = payload["op"]
    state_dir: Path | None = args.state_dir
    if state_dir is None:
        try:
            state_dir = config_file.load(args.config).state_dir
        except ConfigError as exc:
            print(f"gpuwarden {command}: configuration error: {exc}", file=sys.stderr)
            return 2
    try:
        return request(state_dir, payload, TIMEOUT)
    except ControlError as exc:
        print(f"gpuwarden {command}: {exc}", file=sys.stderr)
        return 1
