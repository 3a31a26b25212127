"""Resident memory and CPU of `gpuwarden run`, and the CPU cost of one /metrics scrape,
side by side with Debian's prometheus-node-exporter scraped the same number of times.

    python bench/agent_footprint.py [--duration 300] [--scrapes 200]

The agent runs on the embedded defaults (with a temporary state dir and a free port). After
`--duration` seconds at default intervals its RSS and CPU seconds are read from /proc; then both
servers are scraped `--scrapes` times and the CPU each spent is divided by the count.
Goal (issue 2): RSS <= 64 MB; CPU per scrape no more than node_exporter's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.ports import free_port, wait_for_port  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def scrape(port: int, count: int) -> int:
    """Scrape `count` times; the size of the last body."""
    size = 0
    for _ in range(count):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            size = len(r.read())
    return size


def scrape_cost(pid: int, port: int, count: int) -> tuple[float, int]:
    scrape(port, 3)  # warm
    before = cpu_seconds(pid)
    size = scrape(port, count)
    return (cpu_seconds(pid) - before) / count, size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=300.0)
    parser.add_argument("--scrapes", type=int, default=200)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gpuwarden-bench-"))
    port = free_port()
    (work / "c.toml").write_text(
        f'state_dir = "{work}/state"\n[prometheus]\nlisten = "127.0.0.1:{port}"\n'
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    agent = subprocess.Popen(
        [sys.executable, "-m", "agent", "run", "--config", str(work / "c.toml")],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    exporter = None
    try:
        wait_for_port(port, 30)
        started = time.monotonic()
        time.sleep(args.duration)
        elapsed = time.monotonic() - started
        agent_rss, agent_cpu = rss_bytes(agent.pid), cpu_seconds(agent.pid)
        agent_scrape, agent_size = scrape_cost(agent.pid, port, args.scrapes)
        rows = [
            (
                "gpuwarden run",
                f"{agent_rss / 2**20:.1f}",
                f"{agent_cpu:.2f} in {elapsed:.0f} s",
                f"{agent_scrape * 1000:.2f}",
                f"{agent_size}",
            )
        ]
        binary = shutil.which("prometheus-node-exporter")
        if binary:
            node_port = free_port()
            exporter = subprocess.Popen(
                [binary, f"--web.listen-address=127.0.0.1:{node_port}"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            wait_for_port(node_port, 30)
            node_scrape, node_size = scrape_cost(exporter.pid, node_port, args.scrapes)
            rows.append(
                (
                    "prometheus-node-exporter (defaults)",
                    f"{rss_bytes(exporter.pid) / 2**20:.1f}",
                    "-",
                    f"{node_scrape * 1000:.2f}",
                    f"{node_size}",
                )
            )
        else:
            rows.append(("prometheus-node-exporter", "not installed", "-", "-", "-"))
    finally:
        for proc in (agent, exporter):
            if proc is not None:
                proc.terminate()
                proc.wait(10)
        shutil.rmtree(work, ignore_errors=True)
    header = ("process", "RSS MiB", "CPU seconds", "CPU ms / scrape", "bytes / scrape")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(5)]
    for row in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
