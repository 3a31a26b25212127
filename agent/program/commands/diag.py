"""Write a redacted diagnostic bundle (tar.gz) for a support ticket.

Everything in it is redacted first (credentials, passwords, private keys, e-mail addresses,
prompt text); the bundle's redaction.json counts what was removed. Exit code 0 when the bundle
was written, 1 when it could not be, 2 for a configuration or usage error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from agent.contracts.errors import ConfigError
from agent.program import config_file as config_module
from agent.program.diagnose.diag import DiagOptions, build_bundle


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "-o",
        "--output",
        type=Path,
        default=None,
        metavar="FILE",
        help="bundle path (default: ./gpuwarden-diag-<node>-<UTC time>.tar.gz)",
    )
    parser.add_argument(
        "--include",
        type=Path,
        action="append",
        default=[],
        metavar="PATH",
        help="add a file (a training log, say), redacted; may be repeated",
    )
    parser.add_argument(
        "--no-torch",
        action="store_true",
        help="skip the torch child process (it imports torch: a few seconds)",
    )


def main(args: argparse.Namespace) -> int:
    try:
        cfg = config_module.load(args.config)
    except ConfigError as exc:
        print(f"gpuwarden: configuration error: {exc}", file=sys.stderr)
        return 2
    options = DiagOptions(
        output=args.output, includes=tuple(args.include), run_torch_probe=not args.no_torch
    )
    argv = sys.argv[2:]
    try:
        path, bundle = asyncio.run(build_bundle(cfg, options, argv))
    except OSError as exc:
        where = exc.filename or (args.output or "the current directory")
        print(f"gpuwarden diag: cannot write the bundle: {exc.strerror} ({where})", file=sys.stderr)
        return 1
    size = path.stat().st_size
    redaction = bundle.report.to_dict()
    if args.json:
        print(
            json.dumps(
                {
                    "path": str(path),
                    "size_bytes": size,
                    "files": len(bundle.members),
                    "redaction": redaction,
                    "notes": bundle.notes,
                },
                indent=2,
            )
        )
        return 0
    print(f"wrote {path} ({len(bundle.members)} files, {size / 1024:.1f} KiB)")
    kinds = ", ".join(f"{kind} {n}" for kind, n in redaction["by_kind"].items())
    print(f"redacted {redaction['total']} item(s){': ' + kinds if kinds else ''}")
    for skipped in redaction["skipped_files"]:
        print(f"left out {skipped['name']}: {skipped['reason']}")
    for note in bundle.notes:
        print(f"note: {note}")
    print("check the bundle before you send it: tar -xzf it and read what is inside")
    return 0
