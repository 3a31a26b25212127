"""The off-node watcher: subscribe to every node's status and heartbeat; alert on silence.

Runs in the foreground until SIGTERM or SIGINT. Settings come from the `[watch]` table of the
configuration; the options below override them. Exit code 0 after a clean stop, 1 if it could
not start (the metrics port taken), 2 for a configuration error.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import sys
from pathlib import Path
from typing import Any

import structlog

from agent.contracts.errors import ConfigError
from agent.program import config_loader
from agent.program.watch.service import Watcher
from agent.program.watch.settings import WatchSettings, load_inventory
from agent.runtime import logs

log = structlog.get_logger(component="watch")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help="broker URL (overrides [watch] url)")
    parser.add_argument(
        "--inventory",
        type=Path,
        metavar="PATH",
        help="inventory file (overrides [watch] inventory_file)",
    )
    parser.add_argument(
        "--listen", help="host:port for /metrics, '' for none (overrides [watch] listen)"
    )
    parser.add_argument("--json", action="store_true", help="JSON log lines even on a terminal")


def settings_from(args: argparse.Namespace) -> WatchSettings:
    # Only [watch] and the core keys are judged: the watcher never imports the collectors.
    schema = config_loader.Schema(sections={"watch": WatchSettings})
    cfg = config_loader.settled(  # a file being written as the watcher starts: once finished
        args.config,
        lambda: config_loader.load(args.config, schema),
        again="start the watcher again once it is written",
    )
    settings = cfg.section("watch", WatchSettings)
    overrides: dict[str, Any] = {}
    if args.url is not None:
        overrides["url"] = args.url
    if args.inventory is not None:
        overrides["inventory_file"] = args.inventory
    if args.listen is not None:
        overrides["listen"] = args.listen
    try:
        return dataclasses.replace(settings, **overrides)
    except ConfigError as exc:
        raise ConfigError(f"--{exc.key}", exc.message) from None


def main(args: argparse.Namespace) -> int:
    try:
        settings = settings_from(args)
        inventory = load_inventory(settings.inventory_file) if settings.inventory_file else []
        watcher = Watcher(settings, inventory)
    except ConfigError as exc:
        print(f"gpuwarden watch: configuration error: {exc}", file=sys.stderr)
        return 2
    logs.configure("info", json=True if args.json else None)
    try:
        asyncio.run(_serve(watcher))
    except OSError as exc:
        log.error("cannot start", error=str(exc))
        return 1
    return 0


async def _serve(watcher: Watcher) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    log.info(
        "watching",
        url=watcher.settings.url,
        prefix=watcher.settings.topic_prefix,
        inventory=len(watcher.fleet.nodes),
    )
    await watcher.run(stop)
    log.info("stopped")
