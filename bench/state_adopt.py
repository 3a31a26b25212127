"""How long moving a store that started in memory onto the disk (`StateStore.adopt`) holds the
store, and what it costs: for outbox sizes up to the MQTT sink's bound (100k entries, 64 MiB of
payload), the move's time, the process's peak RSS during it, and the longest wait of an event
write made meanwhile from another thread (in the agent every write waits in the one store
thread behind the move: that wait is the stall of every event, and of the loop awaiting it).

    .venv/bin/python bench/state_adopt.py [--sizes 1000,10000,100000] [--dir /var/tmp]
        [--baseline CHECKOUT]

Each row runs in a child process of its own (a fresh peak RSS): a store in memory holding N
outbox entries and their N events (payloads of 671 bytes: 100k of them are 64 MiB), the
database opened on the disk as the runtime's retry opens it, then `adopt` in the store's
thread while a writer thread records one event every 5 ms, each write queued in that thread as
the runtime queues it. Side by side: the move with every row in one batch, and in batches of
`ADOPT_BATCH_ROWS` rows, each its own transaction; with `--baseline`, a checkout from before
the batches (`git archive aae40e3 | tar -x -C DIR`), whose adopt is one transaction.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.contracts.model import Event, Severity
from agent.runtime import state as state_module
from agent.runtime.state import DB_NAME, StateStore

ADOPT_BATCH_ROWS: int | None = getattr(state_module, "ADOPT_BATCH_ROWS", None)
"""None in a checkout from before the batches (--baseline)."""

PAYLOAD = 671
"""Bytes of payload an entry: 100,000 of them are the outbox's 64 MiB bound."""
WRITE_EVERY = 0.005


def vm_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def reset_peak() -> None:
    """VmHWM starts over from the current RSS (Linux: clear_refs 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def filled_memory_store(state_dir: Path, entries: int) -> StateStore:
    store = StateStore.in_memory(state_dir=state_dir)
    pad = "x" * 200
    batch: list[Event] = []
    for n in range(entries):
        batch.append(
            Event(
                source="xid",
                kind="xid",
                severity=Severity.CRITICAL,
                subject=f"0000:{n % 256:02x}:00.0",
                message=f"GPU reported Xid 79 (fallen off the bus), entry {n} {pad}",
                action="drain the node and reset the GPU; if it recurs, replace it",
                attributes={"xid": 79, "pid": 4000 + n},
            )
        )
        if len(batch) == 500:
            store.record_events(batch, outbox=True)
            batch = []
    if batch:
        store.record_events(batch, outbox=True)
    # The payloads to the bound's size, whatever the JSON came to.
    with store._lock:
        store._conn.execute("UPDATE outbox SET payload = zeroblob(?)", (PAYLOAD,))
    return store


def one(entries: int, batch_rows: int, base: Path) -> dict[str, float]:
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        state_dir = Path(tmp) / "state"
        store = filled_memory_store(state_dir, entries)
        attempt = store.disk_attempt()
        assert attempt is not None
        disk = attempt.future.result(60)
        stalls: list[float] = []
        stop = threading.Event()
        store_thread = concurrent.futures.ThreadPoolExecutor(1)  # the runtime's store thread

        def writer() -> None:
            n = 0
            while not stop.is_set():
                probe = Event(source="bench", kind="probe", severity=Severity.INFO, message=str(n))
                began = time.perf_counter()
                store_thread.submit(store.record_event, probe, outbox=True).result()
                stalls.append(time.perf_counter() - began)
                n += 1
                time.sleep(WRITE_EVERY)

        rss_before = vm_kib("VmRSS")
        reset_peak()
        thread = threading.Thread(target=writer)
        thread.start()
        time.sleep(0.05)
        began = time.perf_counter()
        # As the runtime's _move_to_disk: each step queued in the store thread, in turn with
        # the writes.
        if ADOPT_BATCH_ROWS is None:  # before the batches: one call, one transaction
            moved = store_thread.submit(store.adopt, disk).result()
            moved["batches"] = 0
        else:
            move = store.moving_into(disk, batch_rows)
            while not store_thread.submit(move.step).result():
                pass
            moved = store_thread.submit(move.finish).result()
        took = time.perf_counter() - began
        time.sleep(0.05)
        stop.set()
        thread.join()
        store_thread.shutdown()
        peak = vm_kib("VmHWM")
        assert store.durable
        assert moved["outbox_moved"] >= entries
        store.close()
        size = sum(p.stat().st_size for p in state_dir.iterdir() if p.name.startswith(DB_NAME))
        return {
            "entries": entries,
            "move_s": took,
            "rss_before_mib": rss_before / 1024,
            "peak_mib": peak / 1024,
            "stall_s": max(stalls),
            "writes": len(stalls),
            "batches": moved["batches"],
            "db_mib": size / (1 << 20),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the disk store goes")
    parser.add_argument("--baseline", type=Path, help="a checkout whose adopt is the 'before'")
    parser.add_argument(
        "--child", nargs=2, type=int, metavar=("ENTRIES", "BATCH"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one(args.child[0], args.child[1], Path(args.dir))))
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    assert ADOPT_BATCH_ROWS is not None
    here = Path(__file__).resolve().parents[1]
    ways = [
        (here, "one batch", 1 << 62),
        (here, f"batches of {ADOPT_BATCH_ROWS}", ADOPT_BATCH_ROWS),
    ]
    if args.baseline is not None:
        ways.insert(0, (args.baseline.resolve(), "before: one txn", 0))
    print(
        f"adopt: memory -> {args.dir}, payload {PAYLOAD} B/entry, an event written every "
        f"{WRITE_EVERY * 1000:g} ms meanwhile; {os.cpu_count()} CPUs"
    )
    header = (
        f"{'entries':>8} {'way':<18} {'move s':>7} {'RSS before MiB':>14} "
        f"{'peak RSS MiB':>12} {'longest write stall s':>21} {'writes':>6} {'txns':>5} {'db MiB':>7}"
    )
    print(header)
    print("-" * len(header))
    for entries in sizes:
        for tree, name, batch in ways:
            done = subprocess.run(
                [sys.executable, __file__, "--dir", args.dir, "--child", str(entries), str(batch)],
                capture_output=True,
                text=True,
                check=True,
                cwd=tree,
                env={**os.environ, "PYTHONPATH": str(tree)},
            )
            row = json.loads(done.stdout.strip().splitlines()[-1])
            print(
                f"{entries:>8} {name:<18} {row['move_s']:>7.2f} {row['rss_before_mib']:>14.0f} "
                f"{row['peak_mib']:>12.0f} {row['stall_s']:>21.3f} {row['writes']:>6.0f} "
                f"{row['batches'] + 1:>5.0f} {row['db_mib']:>7.1f}"
            )
    print(
        f"(peak RSS: the child's high-water mark during the move; ru_maxrss "
        f"{resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024:.0f} MiB at most)"
    )


if __name__ == "__main__":
    main()
