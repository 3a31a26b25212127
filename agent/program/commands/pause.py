"""Let go of the GPUs: the running agent shuts NVML down, stops its NVML event thread, kills a
running benchmark child and starts none, so that a GPU reset (`nvidia-smi -r`) or a MIG change
can proceed. Heartbeats say paused and no GPU alert fires meanwhile. The pause ends with
`gpuwarden resume`, or by itself after `--for` (default: [pause] default_duration); it
survives an agent restart, not a reboot.

Exit code 0 when every part of the agent let go (no NVIDIA device file open), 1 when the
agent cannot be reached or something could not be released (the reason is printed), 2 for
a usage or configuration error.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from typing import Any

from agent.program.commands import control_args

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)([smhd])")


def parse_duration(text: str) -> float:
    """`90`, `90s`, `30m`, `1h30m`, `1.5h` -> seconds."""
    text = text.strip().lower()
    try:
        return float(text)
    except ValueError:
        pass
    parts = _PART.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise argparse.ArgumentTypeError(
            f"expected a duration such as 90, 90s, 30m, 1h30m; got {text!r}"
        )
    return sum(float(n) * _UNITS[u] for n, u in parts)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--for",
        dest="duration",
        type=parse_duration,
        default=None,
        metavar="DURATION",
        help="how long (90s, 30m, 2h); then the agent resumes by itself "
        "(default: [pause] default_duration)",
    )
    parser.add_argument("--reason", default="", help="why, for the event and the heartbeat")
    control_args.add(parser)


def main(args: argparse.Namespace) -> int:
    payload: dict[str, Any] = {"op": "pause", "reason": args.reason, **control_args.caller()}
    if args.duration is not None:
        payload["seconds"] = args.duration
    reply = control_args.send(args, payload)
    if isinstance(reply, int):
        return reply
    if not control_args.printed(args, reply):
        _print(reply)
    return 0 if reply.get("ok") else 1


def _print(reply: dict[str, Any]) -> None:
    paused = reply.get("paused") or {}
    until = paused.get("until_ts")
    when = (
        time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(until))
        if isinstance(until, (int, float))
        else "?"
    )
    verb = "still paused, now" if reply.get("extended") else "paused"
    print(f"GPU monitoring {verb} until {when}")
    for name, part in sorted((reply.get("released") or {}).items()):
        mark = "released" if part.get("released") else "NOT RELEASED"
        print(f"  {name}: {mark}: {part.get('detail', '')}")
    if not reply.get("ok"):
        print("some GPU use could not be released: see above", file=sys.stderr)
