"""Event-loop lag of the agent while the MQTT sink bounds or drains a 100k-entry outbox.

    /work/main/.venv/bin/python bench/loop_lag.py [--entries 100000] [--seconds 12]
        [--baseline /path/to/another/checkout]

A probe task sleeps 2 ms in a loop and records how late each wake-up is: anything the loop
runs without yielding (a SQLite statement on the loop, a whole-table count) shows as lag.
Meanwhile the agent's own work goes on as in production: heartbeats every second (each one
reports the outbox depth), a /metrics render every second, the sink's bound checks. Scenarios:

- `down, within bounds`: broker unreachable (a closed loopback port), 100k entries queued,
  bounds not reached: the periodic bound checks and the depth reports.
- `down, over bound`: the same with `outbox_max_entries` at 60% of the backlog: the drop.
- `draining`: a real mosquitto on loopback takes the whole backlog (QoS 1, PUBACKs).

Each scenario runs in its own process, against this checkout or, with `--baseline`, against
another one as well (the same script imports the agent from the tree it is given), and the
table shows both side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]
SCENARIOS = ("down, within bounds", "down, over bound", "draining")
PROBE_SLEEP = 0.002


def _import_agent(tree: Path) -> dict[str, Any]:
    """The agent's modules from `tree` (this checkout or a baseline)."""
    sys.path.insert(0, str(tree))
    from agent.contracts.model import Event, Severity
    from agent.program import config_file as config_module
    from agent.program import registry
    from agent.runtime import logs
    from agent.runtime.core import Runtime
    from agent.runtime.state import StateStore

    return {
        "config": config_module,
        "logs": logs,
        "Event": Event,
        "Severity": Severity,
        "Runtime": Runtime,
        "registry": registry,
        "StateStore": StateStore,
    }


def _fill(mods: dict[str, Any], state_dir: Path, entries: int) -> None:
    """`entries` Xid-like events in history and outbox, written before the agent starts."""
    store = mods["StateStore"].open(state_dir)
    event, severity = mods["Event"], mods["Severity"]
    batch = []
    for i in range(entries):
        batch.append(
            event(
                source="kernel_log",
                kind="xid",
                severity=severity.CRITICAL,
                subject="0000:1b:00.0",
                message=f"GPU 0000:1b:00.0 reported Xid 79 (fallen off the bus), record {i}",
                action="drain the node and reset the GPU; if it recurs, replace it",
                attributes={"xid": 79, "pid": 4242},
            )
        )
        if len(batch) == 1000:
            store.record_events(batch, outbox=True)
            batch = []
    if batch:
        store.record_events(batch, outbox=True)
    store.close()


def _depth(runtime: Any) -> int:
    sink = runtime.sinks["mqtt"]
    return int(sum(sink.outbox.depth().values()))


async def _measure(
    mods: dict[str, Any],
    state_dir: Path,
    url: str,
    max_entries: int,
    *,
    seconds: float,
    drain: bool,
) -> dict[str, Any]:
    """Probe the loop for `seconds`, or with `drain` until the outbox is empty."""
    cfg = mods["config"].parse(
        {
            "node_id": "bench",
            "state_dir": str(state_dir),
            "prometheus": {"enabled": False},
            # No collector: the lag measured is the store's and the sink's, not /proc's.
            "collectors": {name: {"enabled": False} for name in mods["registry"].COLLECTORS},
            "heartbeat": {"interval": 1.0},
            "mqtt": {
                "enabled": True,
                "url": url,
                "outbox_max_entries": max_entries,
                "reconnect_min": 0.5,
                "reconnect_max": 1.0,
                "metrics_interval": 1.0,
            },
        }
    )
    registry = mods["registry"]
    store = mods["StateStore"].open(cfg.state_dir)  # before the probe: `run` opens it in a thread
    runtime = mods["Runtime"](cfg, store, collectors=registry.COLLECTORS, sinks=registry.SINKS)
    lags: list[float] = []
    stop = asyncio.Event()

    async def probe() -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            before = loop.time()
            await asyncio.sleep(PROBE_SLEEP)
            lags.append(max(0.0, loop.time() - before - PROBE_SLEEP))

    async def scrape() -> None:
        while not stop.is_set():
            runtime.samples()  # what /metrics renders
            await asyncio.sleep(1.0)

    await runtime.start()
    started = time.perf_counter()
    tasks = [asyncio.create_task(probe()), asyncio.create_task(scrape())]
    deadline = started + seconds
    while time.perf_counter() < deadline:
        await asyncio.sleep(0.1)
        if drain and _depth(runtime) <= 2:  # a heartbeat and a snapshot may be in flight
            break
    took = time.perf_counter() - started
    stop.set()
    await asyncio.gather(*tasks)
    left = _depth(runtime)
    await runtime.stop()
    runtime.store.close()
    ordered = sorted(lags)
    return {
        "ticks": len(ordered),
        "p50_ms": 1000 * statistics.median(ordered),
        "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
        "max_ms": 1000 * ordered[-1],
        "seconds": took,
        "left": left,
    }


def run_one(tree: Path, scenario: str, entries: int, seconds: float) -> dict[str, Any]:
    mods = _import_agent(tree)
    mods["logs"].configure("warning", stream=open(os.devnull, "w"), json=True)  # noqa: SIM115
    sys.path.insert(0, str(HERE))
    from tests.support.mosquitto import Broker
    from tests.support.ports import free_port

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        _fill(mods, work / "state", entries)
        if scenario == "draining":
            broker = Broker(work / "broker").start()
            try:
                return asyncio.run(
                    _measure(
                        mods, work / "state", broker.url, entries * 2, seconds=600.0, drain=True
                    )
                )
            finally:
                broker.stop()
        bound = entries * 2 if scenario == "down, within bounds" else int(entries * 0.6)
        url = f"mqtt://127.0.0.1:{free_port()}"  # nothing listens there
        return asyncio.run(_measure(mods, work / "state", url, bound, seconds=seconds, drain=False))


def _spawn(tree: Path, scenario: str, entries: int, seconds: float) -> dict[str, Any]:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--one",
            scenario,
            "--tree",
            str(tree),
            "--entries",
            str(entries),
            "--seconds",
            str(seconds),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--baseline", type=Path, help="another checkout to compare with")
    parser.add_argument("--one", choices=SCENARIOS, help=argparse.SUPPRESS)
    parser.add_argument("--tree", type=Path, default=HERE, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.tree, args.one, args.entries, args.seconds)))
        return
    trees = [("this", HERE)] + ([("baseline", args.baseline)] if args.baseline else [])
    print(
        f"loop lag (ms; probe sleeps {PROBE_SLEEP * 1000:g} ms) with {args.entries} entries "
        "queued; 'left': outbox entries at the end"
    )
    header = f"{'scenario':<22} {'tree':<9} {'p50':>7} {'p99':>8} {'max':>8} {'s':>6} {'left':>7}"
    print(header)
    print("-" * len(header))
    for scenario in SCENARIOS:
        for label, tree in trees:
            r = _spawn(tree, scenario, args.entries, args.seconds)
            print(
                f"{scenario:<22} {label:<9} {r['p50_ms']:7.2f} {r['p99_ms']:8.2f} "
                f"{r['max_ms']:8.1f} {r['seconds']:6.1f} {r['left']:7d}"
            )


if __name__ == "__main__":
    main()
