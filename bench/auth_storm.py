"""32 clients guessing basic-auth passwords against the agent's /metrics, before and after.

A real agent process with a users file at cost 12 (the cost `htpasswd -B -C 12` makes), a real
mosquitto it is connected to; 32 clients from 32 other loopback addresses send wrong passwords
as fast as they are answered (tests/support/endpoint_attack.py, in its own process). Measured
over the storm: the agent's CPU (utime + stime from /proc), the guesses answered, the bcrypt
checks the agent ran (its own counter of failed checks; after only), the right scraper's
answers (every 0.5 s, 200 within 10 s, Prometheus' default scrape timeout), and how long the
agent takes to reconnect to the broker restarted mid-storm (aiomqtt's connect shares asyncio's
default executor, where main ran bcrypt). Then the time of a wrong password for users of cost
5 and 12 and for an unknown user.

    python bench/auth_storm.py [--seconds 20] [--before REF] [--no-before]
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import bcrypt

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.endpoint_attack import CONFIG, worktree
from tests.support.agent_proc import REPO, AgentProcess
from tests.support.endpoint_attack import Scrapes, finish_attack, scrape, start_attack
from tests.support.mosquitto import Broker

GUESSERS = 32
TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Storm:
    cpu: float
    guesses_per_s: float
    checks: float | None
    """bcrypt checks of wrong passwords the agent ran (its own counter; None on main)"""
    scrapes: Scrapes
    reconnect_s: float


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def reconnect_seconds(broker: Broker, timeout: float) -> float:
    """Restart the broker; seconds until the agent's client is connected again (the
    broker's log says so)."""
    broker.stop()
    before = broker.log_path.read_text(errors="replace").count("New client connected")
    broker.start()
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        log = broker.log_path.read_text(errors="replace")
        if log.count("New client connected") > before:
            return time.monotonic() - started
        time.sleep(0.05)
    return float("inf")


def storm(repo: Path, seconds: float) -> Storm:
    with tempfile.TemporaryDirectory(prefix="gpuwarden-auth-") as tmp:
        users = Path(tmp) / "users"
        users.write_text(f"prometheus:{bcrypt.hashpw(b's3cret', bcrypt.gensalt(12)).decode()}\n")
        users.chmod(0o600)
        # mosquitto run as root drops to its own user: it must be able to write its log here.
        Path(tmp).chmod(0o755)
        (Path(tmp) / "broker").mkdir(mode=0o777)
        (Path(tmp) / "broker").chmod(0o777)
        broker = Broker(Path(tmp) / "broker").start()
        config = CONFIG + (
            f'[mqtt]\nenabled = true\nurl = "{broker.url}"\nreconnect_min = 0.2\n'
            "reconnect_max = 1.0\n"
        )
        agent = AgentProcess(Path(tmp) / "agent", config_text=config, repo=repo)
        agent.config_text = f'basic_auth_users_file = "{users}"\n' + config
        right = "Basic " + base64.b64encode(b"prometheus:s3cret").decode()
        try:
            agent.start(wait=False)
            _wait_served(agent, right)
            assert agent.process is not None
            pid = agent.process.pid
            attacker = start_attack("guess", agent.port, seconds + 2.0, GUESSERS, GUESSERS)
            time.sleep(2.0)
            cpu_start, wall_start = cpu_seconds(pid), time.monotonic()
            result: list[Scrapes] = []
            scraper = threading.Thread(
                target=lambda: result.append(
                    scrape(agent.port, seconds, 0.5, timeout=10.0, authorization=right)
                )
            )
            scraper.start()
            time.sleep(seconds / 2)
            reconnect = reconnect_seconds(broker, seconds)
            scraper.join()
            cpu = (cpu_seconds(pid) - cpu_start) / (time.monotonic() - wall_start)
            tally = finish_attack(attacker, timeout=60)
            checks = _failed_checks(agent.port, right)
            # Answers to guesses, whatever their status (main ran bcrypt for each of them).
            return Storm(cpu, tally.answers / (seconds + 2.0), checks, result[0], reconnect)
        finally:
            agent.stop()
            broker.stop()


def _failed_checks(port: int, authorization: str) -> float | None:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    request.add_header("Authorization", authorization)
    with urllib.request.urlopen(request, timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith('gpuwarden_http_auth_refused_total{reason="failed"}'):
                return float(line.split()[-1])
    return None


def _wait_served(agent: AgentProcess, authorization: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if scrape(agent.port, 0.01, timeout=5.0, authorization=authorization).ok:
            return
        time.sleep(0.2)
    raise TimeoutError(f"agent did not serve /metrics:\n{agent.log()}")


def timing(repo: Path) -> dict[str, float]:
    """ms of a wrong password for each user, in a child process of `repo`."""
    code = """
import bcrypt, json, time
from exporters.web_auth import BasicAuth
users = {"cheap": bcrypt.hashpw(b"pw", bcrypt.gensalt(5)), "dear": bcrypt.hashpw(b"pw", bcrypt.gensalt(12))}
auth = BasicAuth(users)
# The fastest of 5, taken in turns: load on a shared machine only ever adds time.
out = dict.fromkeys(("cheap", "dear", "unknown"), float("inf"))
for _ in range(5):
    for user in out:
        t = time.perf_counter(); auth.check(user, "wrong"); out[user] = min(out[user], (time.perf_counter() - t) * 1000)
print(json.dumps(out))
"""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, check=True
    )
    return {k: float(v) for k, v in json.loads(done.stdout).items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--before", default="main")
    parser.add_argument("--no-before", action="store_true")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        before = None if args.no_before else stack.enter_context(worktree(args.before))
        runs = [("before (" + args.before + ")", before), ("after", REPO)]
        results = [(label, storm(repo, args.seconds), timing(repo)) for label, repo in runs if repo]
    print(f"{GUESSERS} guessing clients (cost 12), {args.seconds:.0f} s, 2 cores")
    print(
        f"{'':<16} {'agent CPU':>10} {'guesses/s':>10} {'bcrypt/s':>9} {'scrapes 200':>12}"
        f" {'MQTT reconnect':>15}"
        f" {'wrong pw ms: cost 5 / cost 12 / unknown':>42}"
    )
    for label, result, ms in results:
        scrapes = f"{result.scrapes.ok}/{result.scrapes.ok + result.scrapes.failed}"
        checks = "-" if result.checks is None else f"{result.checks / (args.seconds + 2):.1f}"
        print(
            f"{label:<16} {result.cpu:>9.0%} {result.guesses_per_s:>10.0f} {checks:>9}"
            f" {scrapes:>12}"
            f" {result.reconnect_s:>14.1f}s"
            f" {ms['cheap']:>20.1f} / {ms['dear']:>6.1f} / {ms['unknown']:>6.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
