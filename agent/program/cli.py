"""The `gpuwarden` command line (docs/ARCHITECTURE.md, command-line contract).

Exit codes: 0 success; 1 a runtime failure, or warnings for `check`; 2 a usage or configuration
error, failures found by `check`, or a command not implemented yet; 74 the output could not be
written (agent/program/stdout_guard.py), whatever the command found.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path

from agent import __version__
from agent.program import stdout_guard
from agent.program.hangup import HANGUPS

DAEMONS = frozenset({"run", "watch"})
"""Their stdout is their log, not a result: not guarded (agent/program/stdout_guard.py)."""

# command -> (module under agent.commands, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("run", "run the agent in the foreground (the systemd service runs this)"),
    "check": ("check", "one-shot preflight of this host; exit code by the worst finding"),
    "bench": ("bench", "run one matmul benchmark now and print the record"),
    "scan": ("scan", "list the findings (Xid, I/O errors, ...) in a saved kernel log"),
    "watch": ("watch", "the off-node watcher: alert when a node's heartbeat stops"),
    "diag": ("diag", "write a redacted diagnostic bundle for a support ticket"),
    "config": ("config_cmd", "validate or show the configuration"),
    "checkpoint": ("checkpoint", "verify checkpoints now: which one a restart can use"),
    "pause": ("pause", "let go of the GPUs for a reset or a MIG change (the running agent)"),
    "resume": ("resume", "end a pause: the running agent watches the GPUs again"),
    "repairs": ("repairs", "the repairs the running agent holds required; clear one done"),
}


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="PATH",
        help="configuration file (default: /etc/gpuwarden/gpuwarden.toml if it exists, "
        "else the embedded defaults)",
    )


def named_command(argv: Sequence[str]) -> str | None:
    """The command `argv` names: its first word that is not an option (no option of the top
    level takes a value), or None when it names none of COMMANDS."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser. With `only`, the other commands are listed with their help line
    (so usage, `--help` and errors read the same) without importing their modules: what a
    command imports stays resident for its life, and `run` is the daemon (issue 14)."""
    parser = argparse.ArgumentParser(
        prog="gpuwarden",
        description="Health agent for GPU hosts: GPUs, kernel log, disks, processes and a "
        "matmul benchmark, served to Prometheus and pushed over MQTT.",
    )
    parser.add_argument("--version", action="version", version=f"gpuwarden {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=help_text)
            continue
        module = importlib.import_module(f"agent.program.commands.{module_name}")
        command = sub.add_parser(name, help=help_text, description=module.__doc__)
        add_config_argument(command)
        module.add_arguments(command)
        command.set_defaults(_module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    command = named_command(sys.argv[1:] if argv is None else argv)
    if command == "run" and argv is None:
        # Before the daemon's imports: from here a SIGHUP is a reload, never the end of the
        # agent (agent/program/hangup.py).
        HANGUPS.install()
    parser = build_parser(command)
    args = parser.parse_args(argv)
    if command not in DAEMONS:
        stdout_guard.guard()
    try:
        code: int = args._module.main(args)
        sys.stdout.flush()
    except stdout_guard.OutputNotWritten as exc:
        return stdout_guard.not_written(exc)
    return code


if __name__ == "__main__":
    sys.exit(main())
