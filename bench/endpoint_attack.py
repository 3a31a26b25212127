"""Scraper success ratio on the agent's /metrics while the port is attacked, before and after.

For each attack (tests/support/endpoint_attack.py: idle connections, a slowloris, a flood of
concurrent GETs), a real agent is started, the attack runs in its own process from 127.0.0.2
and up, and a scraper on 127.0.0.1 (which scraped once before the attack, as a real one
has) GETs /metrics every 0.5 s on a new connection; a scrape
counts when it is answered 200 within 2 s. "before" runs the agent of another checkout (main,
in a temporary worktree made with `git worktree add --detach`), "after" this one.

Goal: >= 99% of the scrapes answered under every attack.

First scrapes: a crowd of N idle connections (from up to 200 hosts, each reopened as soon as
the server closes it: the budget is 64, so the agent evicts all the while), then 20 clients
the agent has never answered GET /metrics one after the other, each on its first
connection; the table gives the median and the slowest time to the answer, how many were
answered within 2 s, and the agent's CPU time over the crowd (what its evictions cost).
The eviction choice alone (what each accept over the budget runs) is timed in CPU
microseconds over a full table of 64 idle connections, in a process of each tree's own.

    python bench/endpoint_attack.py [--seconds 20] [--before REF] [--no-before]
                                    [--only scrapes|first]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.agent_proc import REPO, AgentProcess, pythonpath
from tests.support.endpoint_attack import (
    FirstScrapes,
    Scrapes,
    finish_attack,
    first_scrapes,
    scrape,
    start_attack,
)

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


CROWDS = (100, 1000)
FIRST_SCRAPERS = 20


@dataclass
class Firsts:
    scrapes: FirstScrapes
    cpu_percent: float
    """The agent's CPU time (user and system) over the crowd's seconds, in percent of a core."""


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure_first(repo: Path, count: int, block: int) -> Firsts:
    with tempfile.TemporaryDirectory(prefix="gpuwarden-attack-") as tmp:
        agent = AgentProcess(Path(tmp), config_text=CONFIG, repo=repo).start()
        assert agent.process is not None
        try:
            sources = [f"127.0.{block}.{i}" for i in range(1, FIRST_SCRAPERS + 1)]
            seconds = 1.0 + FIRST_SCRAPERS * 0.2
            attacker = start_attack("idle", agent.port, seconds + 1.0, count, min(count, 200))
            time.sleep(1.0)  # the crowd fills the budget
            cpu, started = cpu_seconds(agent.process.pid), time.monotonic()
            firsts = first_scrapes(agent.port, sources)
            used = cpu_seconds(agent.process.pid) - cpu
            elapsed = time.monotonic() - started
            finish_attack(attacker, timeout=seconds + 30)
            return Firsts(firsts, 100.0 * used / elapsed)
        finally:
            agent.stop()


CHOICE = """
import asyncio, json, socket, sys, time
from exporters.http import ScrapeServer

async def ok(head, client):
    return 200, {}, b"ok"

async def main(calls):
    server = ScrapeServer(ok)
    listening = await server.listen("127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    clients = []
    for i in range(server.max_connections):  # one each from as many hosts: none is trusted
        client = socket.socket()
        client.bind((f"127.0.3.{1 + i}", 0))
        client.setblocking(False)
        await loop.sock_connect(client, ("127.0.0.1", port))
        clients.append(client)
    while server.open_connections < server.max_connections:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)
    started = time.process_time()  # CPU time: a shared machine's other work left out
    for _ in range(calls):
        server._victim()
    print(json.dumps((time.process_time() - started) / calls))
    listening.close()
    server.close()

asyncio.run(main(int(sys.argv[1])))
"""
"""The eviction choice alone (ScrapeServer._victim, as an accept over the budget makes it),
timed in a process of the tree's own, over a full table of idle connections."""


def choice_seconds(repo: Path, calls: int = 20000) -> float:
    env = {**os.environ, "PYTHONPATH": pythonpath(repo)}
    out = subprocess.run(
        [sys.executable, "-c", CHOICE, str(calls)],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return float(out.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--before", default="main", help="git ref of the 'before' agent")
    parser.add_argument("--no-before", action="store_true")
    parser.add_argument("--only", choices=("scrapes", "first"))
    args = parser.parse_args()
    rows: list[tuple[str, Scrapes | None, Scrapes]] = []
    firsts: list[tuple[str, Firsts | None, Firsts]] = []
    with contextlib.ExitStack() as stack:
        before = None if args.no_before else stack.enter_context(worktree(args.before))
        for label, kind, count, sources in ATTACKS if args.only != "first" else ():
            old = None if before is None else measure(before, kind, count, sources, args.seconds)
            new = measure(REPO, kind, count, sources, args.seconds)
            rows.append((label, old, new))
        choice = (
            None if before is None or args.only == "scrapes" else choice_seconds(before),
            None if args.only == "scrapes" else choice_seconds(REPO),
        )
        # Each run its own scrapers' addresses: never answered, by this agent or another.
        blocks = iter(range(20, 250))
        for count in CROWDS if args.only != "scrapes" else ():
            label = f"first scrapes, {count} idle conns"
            old_first = None if before is None else measure_first(before, count, next(blocks))
            firsts.append((label, old_first, measure_first(REPO, count, next(blocks))))

    def cell(result: Scrapes | None) -> str:
        if result is None:
            return "-"
        return f"{result.ok}/{result.ok + result.failed} ({result.ratio:.1%})"

    if rows:
        print(f"scraper every 0.5 s for {args.seconds:.0f} s, answered 200 within 2 s")
        print(f"{'attack':<38} {'before (' + args.before + ')':>20} {'after':>20}")
        for label, old, new in rows:
            print(f"{label:<38} {cell(old):>20} {cell(new):>20}")

    def first_cell(result: Firsts | None) -> str:
        if result is None:
            return "-"
        took, done = result.scrapes.took, result.scrapes.ok + result.scrapes.failed
        median = f"{statistics.median(took) * 1000:.0f}" if took else "-"
        slowest = f"{max(took) * 1000:.0f}" if took else "-"
        return f"{median}/{slowest} ms {result.scrapes.ok}/{done} cpu {result.cpu_percent:.0f}%"

    if firsts:
        print(
            f"{FIRST_SCRAPERS} new scrapers, one after the other: median/slowest ms to the "
            "answer, answered within 2 s, agent CPU over the crowd"
        )
        print(f"{'crowd':<38} {'before (' + args.before + ')':>28} {'after':>28}")
        for label, old_first, new_first in firsts:
            print(f"{label:<38} {first_cell(old_first):>28} {first_cell(new_first):>28}")
    if choice[1] is not None:
        old_us = "-" if choice[0] is None else f"{choice[0] * 1e6:.1f} us"
        label = "eviction choice, 64 waiting (per accept)"
        print(f"{label:<38} {old_us:>28} {choice[1] * 1e6:>25.1f} us")
    good = all(new.ratio >= 0.99 for _, _, new in rows)
    return 0 if good and all(new.scrapes.failed == 0 for _, _, new in firsts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
