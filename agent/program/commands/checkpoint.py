"""Checkpoints: `gpuwarden checkpoint verify PATH...` judges them now, as the collector does.

Each PATH is a checkpoint (a file or a checkpoint directory) or a directory of them. Two looks
`--gap` seconds apart decide what has stopped changing; every sidecar checksum is hashed (at
`--bandwidth` MiB/s). Exit code 0 when every checkpoint is complete, 1 when some are still
incomplete, 2 when one is corrupt, a PATH holds no complete checkpoint, or a usage error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from agent.program.diagnose.checkpoint_findings import Looked, verify_paths
from agent.program.diagnose.findings import EXIT_FAILURES, EXIT_OK, EXIT_WARNINGS
from collectors.checkpoints.judge import RoundOutcome

MIB = 2**20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    verify = sub.add_parser("verify", help="judge checkpoints now: status, step, size, checksum")
    verify.add_argument("paths", type=Path, nargs="+", metavar="PATH")
    verify.add_argument("--json", action="store_true", help="machine-readable output")
    verify.add_argument(
        "--gap", type=float, default=1.0, help="seconds between the two looks (default 1)"
    )
    verify.add_argument(
        "--settle",
        type=float,
        default=60.0,
        help="a checkpoint untouched this many seconds has stopped changing (default 60)",
    )
    verify.add_argument(
        "--bandwidth", type=float, default=200.0, help="MiB/s hashing may read (default 200)"
    )


def outcomes(looked: dict[str, Looked | str]) -> dict[str, RoundOutcome | str]:
    return {p: (x if isinstance(x, str) else x.outcome) for p, x in looked.items()}


def exit_code(results: dict[str, RoundOutcome | str]) -> int:
    code = EXIT_OK
    for outcome in results.values():
        if isinstance(outcome, str) or outcome.newest_complete() is None:
            return EXIT_FAILURES
        counts = outcome.counts()
        if counts["corrupt"]:
            return EXIT_FAILURES
        if counts["incomplete"] or counts["verifying"]:
            code = EXIT_WARNINGS
    return code


def _size(size: int) -> str:
    return f"{size / MIB:.1f} MiB" if size >= MIB else f"{size} B"


def render(results: dict[str, RoundOutcome | str]) -> str:
    lines: list[str] = []
    for path, outcome in results.items():
        lines.append(path)
        if isinstance(outcome, str):
            lines += [f"  cannot be read: {outcome}", ""]
            continue
        lines.append(f"  {'STATUS':<10} {'STEP':>8} {'SIZE':>11} {'CHECKSUM':<9} NAME / ACTION")
        for v in outcome.verdicts:
            step = "-" if v.step is None else str(v.step)
            lines.append(
                f"  {v.status:<10} {step:>8} {_size(v.size_bytes):>11} {v.checksum:<9} {v.name}"
            )
            if v.action:
                lines.append(f"  {'':<42}-> {v.action}")
        newest = outcome.newest_complete()
        lines.append(
            f"  restart from: {newest.path}"
            if newest
            else "  no complete checkpoint to restart from"
        )
        lines.append("")
    return "\n".join(lines).rstrip()


def main(args: argparse.Namespace) -> int:
    if args.gap < 0 or args.settle < 0 or args.bandwidth <= 0:
        print(
            "gpuwarden checkpoint verify: --gap and --settle >= 0, --bandwidth > 0", file=sys.stderr
        )
        return EXIT_FAILURES
    results = outcomes(
        asyncio.run(verify_paths(list(args.paths), args.gap, args.settle, args.bandwidth))
    )
    if args.json:
        data = {
            path: (
                {"error": o}
                if isinstance(o, str)
                else {
                    "restart_from": (n.to_dict() if (n := o.newest_complete()) else None),
                    "checkpoints": [v.to_dict() for v in o.verdicts],
                }
            )
            for path, o in results.items()
        }
        print(json.dumps({"exit_code": exit_code(results), "paths": data}, indent=2))
    else:
        print(render(results))
    return exit_code(results)
