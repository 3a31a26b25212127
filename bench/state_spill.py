"""What a spill at a clean stop costs (agent/runtime/spill.py): the time `spill.write` takes
out of the stop's SPILL_BUDGET, and the time `spill.adopt_all` adds to the next start, for
outbox sizes up to the MQTT sink's bound, next to the floor of each: SQLite's own backup of
the same in-memory database to a file in the same directory (the write), and reading every
row of that file back (the adoption).

    .venv/bin/python bench/state_spill.py [--sizes 1000,10000,100000] [--dir /dev/shm]

Two sources: a store in memory holding N outbox entries and their events (the state dir was
unusable at start: the whole store is spilled), and a store on the disk whose writes fail,
with N events waiting in the store guard's queue (its bound is 10,000). `--dir` is the
runtime dir; systemd's is a tmpfs (/run), so the default is /dev/shm.

The second table is the spill kept while the agent runs (`spill.LiveSpill`): what one of
its writes costs, how long it then waits before the next (its bound, MAX_SHARE of a CPU),
the share of a CPU that comes to under a steady stream of changes, and how long its
snapshot holds the guard's lock (the event loop may wait that long to queue a round).
"""

from __future__ import annotations

import argparse
import logging
import os
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

import structlog

if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.contracts.model import Event, Severity
from agent.runtime import spill
from agent.runtime.state import StateStore
from agent.runtime.store_guard import MAX_QUEUED_EVENTS, StoreGuard
from bench.state_adopt import filled_memory_store

BOOT = "bench-boot"


def event(n: int) -> Event:
    return Event(
        source="xid",
        kind="xid",
        severity=Severity.CRITICAL,
        subject=f"0000:{n % 256:02x}:00.0",
        message=f"GPU reported Xid 79 (fallen off the bus), entry {n} {'x' * 200}",
        attributes={"xid": 79, "pid": 4000 + n},
    )


def floor_write(store: StateStore, path: Path) -> float:
    began = time.perf_counter()
    target = sqlite3.connect(path)
    store.copy_into(target)
    target.close()
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    return time.perf_counter() - began


def floor_read(path: Path) -> float:
    began = time.perf_counter()
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    for table in ("outbox", "events", "kv"):
        for _row in conn.execute(f"SELECT * FROM {table}"):
            pass
    conn.close()
    return time.perf_counter() - began


def spill_and_adopt(store: StateStore, guard: StoreGuard, where: Path) -> tuple[float, float]:
    runtime = where / "run"
    runtime.mkdir()
    began = time.perf_counter()
    written = spill.write(store, guard, runtime, boot_id=BOOT, outbox=True)
    took_write = time.perf_counter() - began
    assert written.path is not None, written
    fresh = StateStore.open(where / "state-next")
    began = time.perf_counter()
    fresh, reports = spill.adopt_all(fresh, runtime, boot_id=BOOT)
    took_adopt = time.perf_counter() - began
    assert reports, "the spill was not found"
    assert not reports[0].error, reports
    fresh.close()
    return took_write, took_adopt


def in_memory(entries: int, base: Path) -> tuple[float, float, float, float]:
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        where = Path(tmp)
        store = filled_memory_store(where / "state", entries)
        guard = StoreGuard(store, where / "state")
        write_floor = floor_write(store, where / "floor.db")
        read_floor = floor_read(where / "floor.db")
        took_write, took_adopt = spill_and_adopt(store, guard, where)
        return took_write, write_floor, took_adopt, read_floor


def queued(entries: int, base: Path) -> tuple[float, float, float, float]:
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        where = Path(tmp)
        store = StateStore.open(where / "state")
        guard = StoreGuard(store, where / "state", max_events=max(entries, MAX_QUEUED_EVENTS))
        for n in range(entries):
            guard.queue(event(n))
        # The floor: the same events in a store in memory, backed up as the write's floor.
        memory = StateStore.in_memory()
        memory.record_events([event(n) for n in range(entries)], outbox=True)
        write_floor = floor_write(memory, where / "floor.db")
        read_floor = floor_read(where / "floor.db")
        took_write, took_adopt = spill_and_adopt(store, guard, where)
        store.close()
        return took_write, write_floor, took_adopt, read_floor


def live_costs(entries: int, base: Path, source: str) -> tuple[float, float, float, float]:
    """The spill kept while running (`spill.LiveSpill`): one write's wall and CPU time (the
    mean of 3), the wait it imposes before the next (MAX_SHARE), and the time the guard's
    lock is held for its snapshot (what the event loop may wait to queue a round)."""
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        where = Path(tmp)
        if source == "memory":
            store = filled_memory_store(where / "state", entries)
            guard = StoreGuard(store, where / "state")
        else:
            store = StateStore.open(where / "state")
            guard = StoreGuard(store, where / "state", max_events=max(entries, MAX_QUEUED_EVENTS))
            for n in range(entries):
                guard.queue(event(n))
        live = spill.LiveSpill(store, guard, where / "run", boot_id=BOOT, outbox=lambda: True)
        walls, cpus = [], []
        for _ in range(3):
            wall, cpu = time.perf_counter(), time.thread_time()
            live.write_now()
            cpus.append(time.thread_time() - cpu)
            walls.append(time.perf_counter() - wall)
            assert live.error is None, live.error
        began = time.perf_counter()
        guard.snapshot("bench")
        held = time.perf_counter() - began
        store.close()
        wall, cpu = sum(walls) / 3, sum(cpus) / 3
        return wall, cpu, max(wall, cpu) * (1 / spill.MAX_SHARE - 1), held


def live_table(sizes: list[int], base: Path) -> None:
    header = (
        f"{'live spill of':<22} {'entries':>8} {'write s':>8} {'cpu s':>8} "
        f"{'next after s':>12} {'share %':>8} {'lock held s':>11}"
    )
    print()
    print(header)
    print("-" * len(header))
    for entries in sizes:
        sources = [("store in memory", "memory")]
        if entries <= MAX_QUEUED_EVENTS:
            sources.append(("guard queue, disk full", "guard"))
        for name, source in sources:
            wall, cpu, gap, held = live_costs(entries, base, source)
            share = 100 * cpu / (max(wall, cpu) + gap)
            print(
                f"{name:<22} {entries:>8} {wall:>8.3f} {cpu:>8.3f} {gap:>12.3f} "
                f"{share:>8.1f} {held:>11.4f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--dir", type=Path, default=Path("/dev/shm"))
    args = parser.parse_args()
    # The spill's own warnings (state_spilled, state_spill_adopted) are not the table.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    print(f"spill to {args.dir}; {os.cpu_count()} CPUs")
    header = (
        f"{'source':<22} {'entries':>8} {'spill.write s':>13} {'backup floor s':>14} "
        f"{'adopt_all s':>11} {'read floor s':>12}"
    )
    print(header)
    print("-" * len(header))
    for entries in (int(s) for s in args.sizes.split(",")):
        sources = [("store in memory", in_memory)]
        if entries <= MAX_QUEUED_EVENTS:
            sources.append(("guard queue, disk full", queued))
        for name, run in sources:
            w, wf, a, rf = run(entries, args.dir)
            print(f"{name:<22} {entries:>8} {w:>13.3f} {wf:>14.3f} {a:>11.3f} {rf:>12.3f}")
    live_table([int(s) for s in args.sizes.split(",")], args.dir)


if __name__ == "__main__":
    main()
