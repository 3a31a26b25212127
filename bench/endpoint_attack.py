"""Scraper success ratio on the agent's /metrics while the port is attacked, before and after.

For each attack (tests/support/endpoint_attack.py: idle connections, a slowloris, a flood of
concurrent GETs), a real agent is started, the attack runs in its own process from 127.0.0.2
and up, and a scraper on 127.0.0.1 (which scraped once before the attack, as a real one
has) GETs /metrics every 0.5 s on a new connection; a scrape
counts when it is answered 200 within 2 s. "before" runs the agent of another checkout (main,
in a temporary worktree made with `git worktree add --detach`), "after" this one.

Goal: >= 99% of the scrapes answered under every attack.

    python bench/endpoint_attack.py [--seconds 20] [--before REF] [--no-before]
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.agent_proc import REPO, AgentProcess
from tests.support.endpoint_attack import Scrapes, finish_attack, scrape, start_attack

ATTACKS = (
    ("40 idle connections", "idle", 40, 1),
    ("slowloris, 200 connections", "slowloris", 200, 1),
    ("slowloris, 200 conns from 50 hosts", "slowloris", 200, 50),
    ("1,000 concurrent GETs (4 hosts)", "flood", 1000, 4),
    ("200 idle connections from 200 hosts", "idle", 200, 200),
    ("slowloris, 300 conns from 150 hosts", "slowloris", 300, 150),
)
# Only the endpoint is under test: the other collectors would add noise, not load.
CONFIG = """
[collectors.gpu]
enabled = false
[collectors.benchmark]
enabled = false
[collectors.kernel_log]
enabled = false
"""


@contextlib.contextmanager
def worktree(ref: str) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="gpuwarden-before-") as tmp:
        path = Path(tmp) / "tree"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(path), ref],
            check=True,
        )
        try:
            yield path
        finally:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)], check=True
            )


def measure(repo: Path, kind: str, count: int, sources: int, seconds: float) -> Scrapes:
    with tempfile.TemporaryDirectory(prefix="gpuwarden-attack-") as tmp:
        agent = AgentProcess(Path(tmp), config_text=CONFIG, repo=repo).start()
        try:
            scrape(agent.port, 0.1)  # it has scraped before the attack, as a real one has
            attacker = start_attack(kind, agent.port, seconds + 1.0, count, sources)
            result: list[Scrapes] = []
            # The attack settles for a second before the scraper starts counting.
            timer = threading.Timer(1.0, lambda: result.append(scrape(agent.port, seconds)))
            timer.start()
            timer.join()
            finish_attack(attacker, timeout=seconds + 30)
            return result[0]
        finally:
            agent.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--before", default="main", help="git ref of the 'before' agent")
    parser.add_argument("--no-before", action="store_true")
    args = parser.parse_args()
    rows: list[tuple[str, Scrapes | None, Scrapes]] = []
    with contextlib.ExitStack() as stack:
        before = None if args.no_before else stack.enter_context(worktree(args.before))
        for label, kind, count, sources in ATTACKS:
            old = None if before is None else measure(before, kind, count, sources, args.seconds)
            new = measure(REPO, kind, count, sources, args.seconds)
            rows.append((label, old, new))

    def cell(result: Scrapes | None) -> str:
        if result is None:
            return "-"
        return f"{result.ok}/{result.ok + result.failed} ({result.ratio:.1%})"

    print(f"scraper every 0.5 s for {args.seconds:.0f} s, answered 200 within 2 s")
    print(f"{'attack':<38} {'before (' + args.before + ')':>20} {'after':>20}")
    for label, old, new in rows:
        print(f"{label:<38} {cell(old):>20} {cell(new):>20}")
    return 0 if all(new.ratio >= 0.99 for _, _, new in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
