"""From a kernel-log record to the broker's PUBACK: how long an Xid takes to leave the node.

    /work/main/.venv/bin/python bench/kernel_log_latency.py [--records 200]
        [--baseline /path/to/another/checkout]

The agent's runtime runs in a process of its own with the kernel_log collector (its default
settings: 2 s interval) following a file, and the MQTT sink publishing to a real mosquitto on
loopback. A writer thread appends `--records` Xid lines, each for its own GPU address and code
(so each is one event), 20-80 ms apart, as a syslog daemon would save them. For every line:

- `record -> stored`: from the write of the line to the commit of the transaction that holds
  its event (StateStore.write_batch returning);
- `stored -> PUBACK`: from there to the broker's PUBACK (the outbox entry's delete, which the
  sink makes only after the PUBACK);
- `record -> PUBACK`: the whole path.

Then the cost of being woken: `--noise-seconds` of noise lines (200 a second, no finding
among them) appended to the same file, and the agent's CPU time meanwhile (the process's,
less the writer thread's own) and its kernel_log rounds a second.

With `--baseline` the same script measures another checkout as well (it imports the agent
from the tree it is given), side by side. /dev/kmsg and the NVML event thread with a real
Xid are measured on a GPU host by bench/xid_gpu_latency.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]
CODES = (13, 31, 43, 48, 63, 64, 68, 74, 79, 94, 95, 119)
STAGES = ("record -> stored", "stored -> PUBACK", "record -> PUBACK")


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


class Timings:
    """When each event was stored and PUBACKed (time.time(), by event id), and when each
    line was written (by GPU address and code)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.written: dict[tuple[str, int], float] = {}
        self.events: dict[str, Any] = {}
        self.stored: dict[str, float] = {}
        self.acked: dict[str, float] = {}

    def on_stored(self, events: Sequence[Any]) -> None:
        now = time.time()
        with self.lock:
            for event in events:
                self.events.setdefault(event.id, event)
                self.stored.setdefault(event.id, now)

    def on_acked(self, event_ids: Sequence[str]) -> None:
        now = time.time()
        with self.lock:
            for event_id in event_ids:
                self.acked.setdefault(event_id, now)

    def xids(self) -> dict[tuple[str, int], str]:
        """(GPU address, code) -> the id of the first xid event stored for it."""
        with self.lock:
            out: dict[tuple[str, int], str] = {}
            for event_id, event in self.events.items():
                if event.kind == "xid":
                    key = (str(event.attributes["pci_bus_id"]), int(event.attributes["xid"]))
                    out.setdefault(key, event_id)
            return out


def hook_store(store: Any, timings: Timings) -> None:
    """Wrap the store's write and ack: the times are taken where the agent does the work."""
    write_batch: Callable[..., None] = store.write_batch
    outbox_ack: Callable[..., Any] = store.outbox_ack

    def timed_write(events: Sequence[Any], values: Any, *, outbox: bool) -> None:
        write_batch(events, values, outbox=outbox)
        timings.on_stored(events)

    def timed_ack(seqs: Sequence[int]) -> Any:
        keys = [
            str(row[0])
            for seq in seqs
            for row in store._read("SELECT key FROM outbox WHERE seq=?", (seq,))
        ]
        result = outbox_ack(seqs)
        timings.on_acked(keys)
        return result

    store.write_batch = timed_write
    store.outbox_ack = timed_ack


def _writer(path: Path, records: int, timings: Timings, started: threading.Event) -> None:
    chance = random.Random(7)
    started.wait()
    with path.open("a", buffering=1) as handle:
        for n in range(records):
            time.sleep(chance.uniform(0.02, 0.08))
            bus, code = n % 256, CODES[n // 256]
            handle.write(
                f"[{100 + n * 0.05:10.4f}] NVRM: Xid (PCI:0000:{bus:02x}:00): {code}, "
                f"pid={5000 + n}, name=python3, latency bench line {n}\n"
            )
            with timings.lock:
                timings.written[(f"0000:{bus:02x}:00.0", code)] = time.time()


NOISE_PER_SECOND = 200


def _noise(path: Path, halt: threading.Event, spent: list[float]) -> None:
    """Noise lines (a USB reset, no finding) at NOISE_PER_SECOND; its own CPU time in `spent`."""
    start = time.thread_time()
    with path.open("a", buffering=1) as handle:
        n = 0
        while not halt.wait(1 / NOISE_PER_SECOND):
            handle.write(f"[{2000 + n * 0.005:10.4f}] usb 1-1: reset high-speed USB device {n}\n")
            n += 1
    spent.append(time.thread_time() - start)


async def _noise_cost(runtime: Any, log: Path, seconds: float) -> dict[str, float]:
    halt = threading.Event()
    spent: list[float] = []
    status = runtime.collectors["kernel_log"]
    rounds, cpu = status.rounds_done, time.process_time()
    writer = threading.Thread(target=_noise, args=(log, halt, spent), daemon=True)
    writer.start()
    await asyncio.sleep(seconds)
    halt.set()
    await asyncio.to_thread(writer.join, 5)
    used = time.process_time() - cpu - sum(spent)
    return {
        "cpu_percent": 100 * used / seconds,
        "rounds_per_s": (status.rounds_done - rounds) / seconds,
    }


async def _measure(
    tree: Path, work: Path, url: str, records: int, noise_seconds: float
) -> dict[str, Any]:
    sys.path.insert(0, str(tree))
    from agent.program import config_file, registry
    from agent.runtime import logs
    from agent.runtime.core import Runtime
    from agent.runtime.state import StateStore

    logs.configure("warning", stream=open(os.devnull, "w"), json=True)  # noqa: SIM115
    log = work / "kern.log"
    log.write_text("[    0.0000] Linux version 6.8.0 (bench)\n")
    others = {n: {"enabled": False} for n in registry.COLLECTORS if n != "kernel_log"}
    cfg = config_file.parse(
        {
            "node_id": "bench",
            "state_dir": str(work / "state"),
            "prometheus": {"enabled": False},
            "collectors": {**others, "kernel_log": {"path": str(log)}},
            "heartbeat": {"interval": 5.0},
            "mqtt": {"enabled": True, "url": url, "reconnect_min": 0.2, "reconnect_max": 1.0},
        }
    )
    store = StateStore.open(cfg.state_dir)
    timings = Timings()
    hook_store(store, timings)
    runtime = Runtime(cfg, store, collectors=registry.COLLECTORS, sinks=registry.SINKS)
    await runtime.start()
    started = threading.Event()
    writer = threading.Thread(target=_writer, args=(log, records, timings, started), daemon=True)
    writer.start()
    await asyncio.sleep(1.0)  # the first round (and the MQTT connection) are behind us
    started.set()
    deadline = time.monotonic() + records * 0.08 + 30.0
    while time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        ids = timings.xids()
        with timings.lock:
            if sum(1 for i in ids.values() if i in timings.acked) >= records:
                break
    noise = await _noise_cost(runtime, log, noise_seconds)
    await runtime.stop()
    store.close()
    ids = timings.xids()
    with timings.lock:
        rows = [
            (
                timings.written[k],
                timings.stored.get(ids.get(k, "")),
                timings.acked.get(ids.get(k, "")),
            )
            for k in timings.written
        ]
    return {
        "records": len(rows),
        "noise": noise,
        "record -> stored": [s - w for w, s, _ in rows if s is not None],
        "stored -> PUBACK": [a - s for _, s, a in rows if s is not None and a is not None],
        "record -> PUBACK": [a - w for w, _, a in rows if a is not None],
    }


def run_one(tree: Path, records: int, noise_seconds: float) -> dict[str, Any]:
    sys.path.insert(0, str(HERE))
    from tests.support.mosquitto import Broker

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        broker = Broker(work / "broker").start()
        try:
            return asyncio.run(_measure(tree, work, broker.url, records, noise_seconds))
        finally:
            broker.stop()


def _spawn(tree: Path, records: int, noise_seconds: float) -> dict[str, Any]:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--one",
            "--tree",
            str(tree),
            "--records",
            str(records),
            "--noise-seconds",
            str(noise_seconds),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _cells(result: dict[str, Any], stage: str) -> str:
    values = result[stage]
    if not values:
        return f"{'-':>8} {'-':>8} {'-':>8}"
    return f"{percentile(values, 0.5):8.3f} {percentile(values, 0.99):8.3f} {max(values):8.3f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200)
    parser.add_argument("--noise-seconds", type=float, default=10.0)
    parser.add_argument("--baseline", type=Path, help="another checkout, measured side by side")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", type=Path, default=HERE, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.tree.resolve(), args.records, args.noise_seconds)))
        return 0
    trees = {"this checkout": HERE}
    if args.baseline is not None:
        trees["baseline"] = args.baseline.resolve()
    results = {name: _spawn(tree, args.records, args.noise_seconds) for name, tree in trees.items()}
    print(
        f"{args.records} Xid lines appended to a followed file, kernel_log at its default "
        "2 s interval, MQTT QoS 1 to mosquitto on loopback; seconds"
    )
    print(f"{'':<18}" + "".join(f" | {name:^26}" for name in results))
    print(f"{'stage':<18}" + f" | {'p50':>8} {'p99':>8} {'max':>8}" * len(results))
    for stage in STAGES:
        print(f"{stage:<18}" + "".join(f" | {_cells(r, stage)}" for r in results.values()))
    print(
        f"{'PUBACKed':<18}"
        + "".join(
            f" | {str(len(r['record -> PUBACK'])) + ' of ' + str(r['records']):>26}"
            for r in results.values()
        )
    )
    print(f"{NOISE_PER_SECOND} noise lines/s for {args.noise_seconds:g} s:")
    for label, key, unit in (
        ("agent CPU", "cpu_percent", "% of a core"),
        ("rounds", "rounds_per_s", "a second"),
    ):
        cells = [f"{r['noise'][key]:.1f} {unit}" for r in results.values()]
        print(f"{label:<18}" + "".join(f" | {cell:>26}" for cell in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
