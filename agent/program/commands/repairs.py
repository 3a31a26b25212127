"""The repairs the running agent holds as required, and their end by a person's word.

`gpuwarden repairs` lists them: what, for which GPU, mount or host, since when, and the finding
that raised it. Most end by themselves: the finding's all-clear (a GPU that answers again, a
mount that works), or the reboot that performs them. Some have no all-clear: a GPU replaced
under a new UUID, a hardware inspection done, a finding of the kernel log that no later line
takes back. `gpuwarden repairs clear` ends those, with the reason kept: one `repair_cleared`
event each, stored and sent like any other (who and why are in it), and an action that
drained the node for it (Slurm, `resume = "when_cleared"`) resumes it.

    gpuwarden repairs clear --subject GPU-5d0c... --reason "GPU replaced, RMA 1234"
    gpuwarden repairs clear --action hardware_inspection --reason "inspected, reseated"

A clear names what it ends (each of --subject, --action, --kind, --source narrows it) or says
--all; it ends every requirement of the same finding kind on the same subject. A finding that
is still there is raised again by its collector when it next changes, as any new finding is.

Exit code 0 when listed or cleared, 1 when the agent cannot be reached, refused the request or
nothing held matched the clear, 2 for a usage or configuration error.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from agent.program.commands import control_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action",
        nargs="?",
        choices=("list", "clear"),
        default="list",
        help="list (the default): what is held; clear: end what the filters name",
    )
    parser.add_argument("--subject", help="clear: the GPU UUID, mount point or host it names")
    parser.add_argument("--action", dest="repair", metavar="ACTION", help="clear: e.g. reset_gpu")
    parser.add_argument("--kind", help="clear: the finding's kind, e.g. xid, gpu_unresponsive")
    parser.add_argument("--source", help="clear: the collector that raised it, e.g. kernel_log")
    parser.add_argument(
        "--all", action="store_true", help="clear: every one held (no filter needed)"
    )
    parser.add_argument("--reason", default="", help="clear: why (required; it is kept)")
    control_args.add(parser)


def main(args: argparse.Namespace) -> int:
    filters = {
        "subject": args.subject,
        "action": args.repair,
        "kind": args.kind,
        "source": args.source,
    }
    if args.action == "list":
        if any(filters.values()) or args.all or args.reason:
            print("gpuwarden repairs: the filters and --reason go with 'clear'", file=sys.stderr)
            return 2
        payload: dict[str, Any] = {"op": "repairs"}
    else:
        if not any(filters.values()) and not args.all:
            print(
                "gpuwarden repairs clear: name what to clear (--subject, --action, --kind, "
                "--source) or say --all",
                file=sys.stderr,
            )
            return 2
        if not args.reason.strip():
            print("gpuwarden repairs clear: --reason is required (it is kept)", file=sys.stderr)
            return 2
        payload = {
            "op": "clear_repairs",
            "reason": args.reason,
            "all": args.all,
            **{k: v for k, v in filters.items() if v},
            **control_args.caller(),
        }
    reply = control_args.send(args, payload)
    if isinstance(reply, int):
        return reply
    if control_args.printed(args, reply):
        pass
    elif args.action == "list":
        _print(reply.get("repairs") or [], "no repair is required")
    else:
        _print(reply.get("cleared") or [], "nothing held matches: nothing cleared", "cleared: ")
        held = reply.get("held") or []
        if held:
            print(f"still held: {len(held)} (gpuwarden repairs)")
    if not reply.get("ok"):
        return 1
    return 1 if args.action == "clear" and not reply.get("cleared") else 0


def _print(repairs: list[dict[str, Any]], empty: str, prefix: str = "") -> None:
    if not repairs:
        print(empty)
        return
    for repair in repairs:
        since = repair.get("since")
        when = (
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since))
            if isinstance(since, (int, float))
            else "?"
        )
        print(
            f"{prefix}{repair.get('action')} for {repair.get('subject')} "
            f"({repair.get('source')} {repair.get('kind')}, {repair.get('severity')}, "
            f"since {when}): {repair.get('message')}"
        )
