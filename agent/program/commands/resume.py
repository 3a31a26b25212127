"""End a pause (`gpuwarden pause`): the agent initialises NVML again, restarts its event
thread, reads every GPU afresh and reports a GPU that did not come back. Prints what the
first round after the pause found.

Exit code 0 when resumed (or there was no pause), 1 when the agent cannot be reached or the
first round after the pause found something critical (a GPU that did not come back), 2 for a
usage or configuration error.
"""

from __future__ import annotations

import argparse
from typing import Any

from agent.program.commands import control_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    control_args.add(parser)


def main(args: argparse.Namespace) -> int:
    reply = control_args.send(args, {"op": "resume", **control_args.caller()})
    if isinstance(reply, int):
        return reply
    if control_args.printed(args, reply):
        pass
    elif not reply.get("resumed"):
        print("not paused: nothing to resume")
    else:
        _print(reply)
    if not reply.get("ok"):
        return 1
    return 1 if reply.get("critical") else 0


def _print(reply: dict[str, Any]) -> None:
    print("GPU monitoring resumed")
    for name, messages in sorted((reply.get("first_round") or {}).items()):
        for message in messages or ["first round done, nothing to report"]:
            print(f"  {name}: {message}")
    for name in reply.get("waited_out") or []:
        print(f"  {name}: its first round after the pause has not ended yet")
