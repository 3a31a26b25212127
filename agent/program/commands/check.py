"""One-shot preflight of this host: GPUs, driver, torch, kernel log, disks, memory, processes,
the state dir and the network endpoints the agent uses.

Read-only unless --io-test or --bench is given. Exit code 0 when every line is OK (or N/A or
SKIP), 1 when the worst line is a WARN, 2 when a line FAILs or the configuration is invalid.
A host without GPUs fails the driver line unless --expect-gpus 0 says it has none on purpose.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from agent.contracts.errors import ConfigError
from agent.program import config_file as config_module
from agent.program import output
from agent.program.diagnose.check import CheckOptions, CheckReport, run_check
from agent.program.diagnose.findings import Status
from agent.program.diagnose.kernel_findings import xid_catalog_line
from exporters.actions.settings import ActionsSettings
from exporters.actions.slurm import check_reason, health_check

COLOURS = {
    Status.OK: output.GREEN,
    Status.WARN: output.YELLOW,
    Status.FAIL: output.RED,
    Status.NA: output.DIM,
    Status.SKIP: output.DIM,
}
VERDICT = {0: Status.OK, 1: Status.WARN, 2: Status.FAIL}
BY_WEIGHT = (Status.FAIL, Status.WARN, Status.OK, Status.NA, Status.SKIP)
"""The status the summary line leads with: the worst one found."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--io-test",
        type=Path,
        metavar="DIR",
        default=None,
        help="also write and fsync 64 MiB in DIR and time it",
    )
    parser.add_argument(
        "--bench", action="store_true", help="also run one matmul benchmark per GPU"
    )
    parser.add_argument(
        "--expect-gpus",
        type=int,
        metavar="N",
        default=None,
        help="GPUs this host should have (default: at least one; 0: none, GPU lines N/A)",
    )
    parser.add_argument(
        "--python",
        default=None,
        metavar="PATH",
        help="interpreter whose torch is checked (default: [collectors.benchmark] python, "
        "the one the benchmark runs under, else gpuwarden's own)",
    )
    parser.add_argument("--no-torch", action="store_true", help="skip the torch child process")
    parser.add_argument(
        "--slurm",
        action="store_true",
        help="run as Slurm's HealthCheckProgram: print one line (the reason), drain this node "
        "on a FAIL with that reason, resume it when the check passes again if [actions.slurm] "
        "resume = when_cleared and the drain was check's own",
    )


def render_table(report: CheckReport, colour: bool, width: int = output.DEFAULT_WIDTH) -> str:
    lines = [f"gpuwarden check on {report.node_id}", *output.wrap(xid_catalog_line(), width), ""]
    name_width = min(max((len(f.name) for f in report.findings), default=10), 38)
    indent = 4 + 2 + name_width + 2
    for finding in report.findings:
        status = output.paint(f"{finding.status.value:<4}", COLOURS[finding.status], colour)
        name = output.fit(finding.name, name_width)
        lines += output.wrap(finding.detail, width, f"{status}  {name:<{name_width}}  ", indent)
        if finding.action and finding.status in (Status.WARN, Status.FAIL):
            lines += [
                " " * indent + part
                for part in output.wrap(finding.action, width - indent, "-> ", 3)
            ]
    lines += ["", summary_line(report, colour)]
    return "\n".join(lines)


def summary_line(report: CheckReport, colour: bool) -> str:
    """Leads with the worst status ("FAIL: 1 FAIL, 2 WARN, 9 OK"), the others after it."""
    worst = VERDICT[report.exit_code]
    counts = report.counts()
    summary = ", ".join(f"{counts[s.value]} {s.value}" for s in BY_WEIGHT if counts[s.value])
    head = output.paint(worst.value, COLOURS[worst], colour)
    return f"{head}: {summary or 'no checks ran'} (exit code {report.exit_code})"


def slurm_line(report: CheckReport) -> str | None:
    """The scontrol reason for a failed check; None when nothing failed."""
    failed = [
        (f.name, f.detail, f.repair_action.value)
        for f in report.findings
        if f.status is Status.FAIL
    ]
    return check_reason(failed) if failed else None


def _slurm(cfg: config_module.Config, report: CheckReport) -> int:
    """HealthCheckProgram: slurmd ignores the exit code and the output; the program must drain
    the node itself (Slurm's documentation of HealthCheckProgram). One line says what was
    found and done; the exit code is check's own."""
    reason = slurm_line(report)
    settings = cfg.section("actions", ActionsSettings).slurm
    try:
        done = asyncio.run(health_check(settings, reason))
    except (RuntimeError, ValueError) as exc:
        print(f"{reason or 'gpuwarden: check: ok'}; scontrol failed: {exc}")
        return max(report.exit_code, 2) if reason else 2
    print(f"{reason or 'gpuwarden: check: ok'} ({done})")
    return report.exit_code


def main(args: argparse.Namespace) -> int:
    try:
        cfg = config_module.load(args.config)
    except ConfigError as exc:
        print(f"gpuwarden: configuration error: {exc}", file=sys.stderr)
        return 2
    if args.expect_gpus is not None and args.expect_gpus < 0:
        print("gpuwarden check: --expect-gpus must be 0 or more", file=sys.stderr)
        return 2
    options = CheckOptions(
        io_test_dir=args.io_test,
        bench=args.bench,
        expect_gpus=args.expect_gpus,
        python=args.python,
        torch=not args.no_torch,
    )
    report = asyncio.run(run_check(cfg, options))
    code = report.exit_code
    if args.slurm:
        code = _slurm(cfg, report)
    elif args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(render_table(report, output.use_colour(sys.stdout), output.width(sys.stdout)))
    if report.hung_calls:
        # A call stuck in the driver or on a dead mount keeps its thread, and Python joins
        # worker threads at exit: leave without waiting, the findings are already printed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
