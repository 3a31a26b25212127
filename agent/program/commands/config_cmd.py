"""Validate the configuration (`config check`) or print the effective one (`config show`).

`config show` prints TOML that `config check` accepts: paste it into gpuwarden.toml, or keep
the keys you change. Secrets are never printed: they live in the files the `*_file` keys name.
A key left unset (no file, say) is left out. `--json` prints the same as JSON.

Exit code 0 when the configuration is valid, 2 with a message naming the file, the key and
what was expected when it is not. Nothing is started.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from agent.contracts.errors import ConfigError
from agent.contracts.settings import to_table
from agent.program import config_file as config_module
from agent.program import toml_text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action",
        choices=("check", "show"),
        help="check: validate only; show: print the effective settings",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def effective(cfg: config_module.Config) -> dict[str, object]:
    """The effective configuration, secrets masked."""
    data: dict[str, object] = to_table(cfg.core)
    data["node_id"] = cfg.node_id  # the effective one (the host name when the file sets none)
    for name, section in cfg.sections.items():
        data[name] = to_table(section)
    data["collectors"] = {name: to_table(s) for name, s in cfg.collectors.items()}
    return data


def main(args: argparse.Namespace) -> int:
    try:
        # Both roles: a file that `run` or `watch` would refuse is refused here too.
        cfg = config_module.load(args.config, with_watch_files=True)
    except ConfigError as exc:
        if args.json:
            print(json.dumps({"ok": False, "file": exc.file, "key": exc.key, "error": exc.message}))
        print(f"gpuwarden: configuration error: {exc}", file=sys.stderr)
        return 2
    try:
        if args.json:
            payload = {"ok": True, "source": cfg.source, "config": effective(cfg)}
            print(json.dumps(payload, default=str))
        elif args.action == "show":
            print(f"# gpuwarden: the effective configuration, from {cfg.source}")
            print(toml_text.dumps(effective(cfg)), end="")
        else:
            print(f"configuration ok: {cfg.source}")
        sys.stdout.flush()
    except BrokenPipeError:  # `config show | head`: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
