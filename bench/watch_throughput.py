"""Heartbeats per second the watcher processes from a real mosquitto, next to mosquitto_sub.

One run: a private mosquitto on a free loopback port; `mosquitto_sub` and the watcher (its real
aiomqtt client and state machine) subscribe; several `mosquitto_pub -l` processes (one node
topic each) publish heartbeat lines as fast as they can. Each consumer's rate is the messages
it received over the time from the first publish to its last message. Then the watcher's
processing alone (Fleet.ingest without the network) and one evaluation of 10,000 nodes.

Goal: >= 10,000 heartbeats/s (10,000 nodes at 1 Hz).

    python bench/watch_throughput.py [--messages 200000] [--publishers 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.program.watch.fleet import Fleet
from agent.program.watch.service import Watcher
from agent.program.watch.settings import WatchSettings
from tests.support.ports import free_port, wait_for_port

PREFIX = "gpuwarden/v1"
MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"


def start_broker(workdir: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    conf = workdir / "mosquitto.conf"
    # No per-message logging, and no per-client queue limit: a slow reader must not lose
    # QoS 0 messages to the default 1000-message queue and skew the comparison.
    conf.write_text(
        f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
        "log_type error\nmax_queued_messages 0\nmax_queued_bytes 0\n"
    )
    process = subprocess.Popen(
        [MOSQUITTO, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    wait_for_port(port)
    return process, port


def heartbeat_lines(count: int, node: int) -> bytes:
    now = time.time()
    return b"".join(
        json.dumps(
            {
                "seq": i,
                "ts": now,
                "interval_s": 1.0,
                "health": "ok",
                "outbox_depth": {"events": 0},
                "node": f"node-{node:05d}",
            }
        ).encode()
        + b"\n"
        for i in range(count)
    )


async def run_network(messages: int, publishers: int, workdir: Path) -> dict[str, float]:
    broker, port = start_broker(workdir)
    per = messages // publishers
    total = per * publishers
    files = []
    for n in range(publishers):
        path = workdir / f"node-{n}.txt"
        path.write_bytes(heartbeat_lines(per, n))
        files.append(path)
    sub = await asyncio.create_subprocess_exec(
        "mosquitto_sub",
        "-p",
        str(port),
        "-t",
        f"{PREFIX}/+/heartbeat",
        "-q",
        "0",
        "-C",
        str(total),
        stdout=asyncio.subprocess.DEVNULL,
    )
    watcher = Watcher(
        WatchSettings(url=f"mqtt://127.0.0.1:{port}", listen="", evaluate_interval=1.0)
    )
    stop = asyncio.Event()
    task = asyncio.create_task(watcher.run(stop))
    while not watcher.fleet.connected:
        await asyncio.sleep(0.01)
    await asyncio.sleep(1.0)  # let mosquitto_sub subscribe too
    began = time.perf_counter()
    pubs = [
        await asyncio.create_subprocess_exec(
            "mosquitto_pub",
            "-p",
            str(port),
            "-t",
            f"{PREFIX}/node-{n:05d}/heartbeat",
            "-q",
            "0",
            "-l",
            stdin=path.open("rb"),
        )
        for n, path in enumerate(files)
    ]
    results: dict[str, float] = {}

    async def publishers_done() -> None:
        await asyncio.gather(*(p.wait() for p in pubs))
        results["publish"] = time.perf_counter() - began

    async def sub_done() -> None:
        await sub.wait()
        results["mosquitto_sub"] = time.perf_counter() - began

    async def watcher_done() -> None:
        while watcher.fleet.counters.messages["heartbeat"] < total:
            await asyncio.sleep(0.005)
        results["watcher"] = time.perf_counter() - began

    try:
        await asyncio.wait_for(
            asyncio.gather(publishers_done(), sub_done(), watcher_done()), timeout=120
        )
    except TimeoutError:
        results["timed_out"] = 1.0
    results["watcher_received"] = float(watcher.fleet.counters.messages["heartbeat"])
    results["total"] = float(total)
    stop.set()
    await task
    if sub.returncode is None:
        sub.kill()
    broker.terminate()
    broker.wait(5)
    return results


def run_ingest(messages: int, nodes: int) -> tuple[float, float]:
    """Fleet.ingest alone (parse + state update), and one evaluate over `nodes` nodes."""
    now = time.time()
    fleet = Fleet(now=now)
    fleet.broker_connected(now - 10)
    for n in range(nodes):
        fleet.ingest(
            f"{PREFIX}/node-{n:05d}/status",
            json.dumps({"state": "online", "bdseq": 1, "ts": now}).encode(),
            False,
            now,
        )
    batch = [
        (
            f"{PREFIX}/node-{i % nodes:05d}/heartbeat",
            json.dumps({"seq": i, "ts": now, "interval_s": 1.0, "health": "ok"}).encode(),
        )
        for i in range(messages)
    ]
    began = time.perf_counter()
    for topic, payload in batch:
        fleet.ingest(topic, payload, False, now)
    ingest = time.perf_counter() - began
    began = time.perf_counter()
    fleet.evaluate(now + 0.5)
    return messages / ingest, time.perf_counter() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--publishers", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        net = asyncio.run(run_network(args.messages, args.publishers, Path(tmp)))
    ingest_rate, evaluate_seconds = run_ingest(100_000, 10_000)
    total = int(net["total"])
    print(f"{total} heartbeats from {args.publishers} mosquitto_pub -l processes, QoS 0, loopback")
    print(f"{'consumer':<44} {'messages':>9} {'seconds':>8} {'msgs/s':>9}")
    for name, key in (
        ("publishers (all done)", "publish"),
        ("mosquitto_sub (C client)", "mosquitto_sub"),
        ("gpuwarden watch (aiomqtt + state machine)", "watcher"),
    ):
        if key in net:
            got = int(net["watcher_received"]) if key == "watcher" else total
            print(f"{name:<44} {got:>9} {net[key]:>8.2f} {got / net[key]:>9.0f}")
        else:
            print(f"{name:<44} {'-':>9} {'timeout':>8}")
    print(
        f"{'Fleet.ingest alone (no network)':<44} {100_000:>9} {100_000 / ingest_rate:>8.2f} "
        f"{ingest_rate:>9.0f}"
    )
    print(f"one evaluation of 10,000 nodes: {evaluate_seconds * 1000:.1f} ms")
    watcher_rate = net["watcher_received"] / net["watcher"] if "watcher" in net else 0.0
    print(
        f"goal >= 10,000/s: {'met' if watcher_rate >= 10_000 else 'NOT met'} "
        f"({watcher_rate:.0f}/s through the real client)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
