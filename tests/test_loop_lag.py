"""The event loop does not stall on SQLite: no statement runs on it, and a 100k-entry outbox
bounded while the broker is down does not hold it up. The bound is gross, for a noisy machine;
bench/loop_lag.py measures the real figures."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from agent.contracts.model import Event, Severity
from agent.program import registry
from agent.runtime.state import StateStore
from exporters.heartbeat import heartbeat_payload
from tests.support.mqtt import InProcessAgent
from tests.support.ports import free_port
from tests.support.waiting import until

ENTRIES = 100_000
BOUND = 20_000
MAX_LAG = 0.2
"""Seconds the loop may be late at worst. Main's bound check dropped the excess on the loop:
about 0.16 s for 40k entries, 0.3 s and more for 80k."""


def fill(state_dir: Path, entries: int) -> None:
    """A backlog of Xid-like events from a long broker outage, written before the agent
    starts (as after a restart)."""
    store = StateStore.open(state_dir)
    batch = []
    for i in range(entries):
        batch.append(
            Event(
                source="kernel_log",
                kind="xid",
                severity=Severity.CRITICAL,
                subject="GPU-5b3c1d2e",
                message=f"GPU 0000:3b:00.0 reported Xid 79 (fallen off the bus), record {i}",
                attributes={"xid": 79, "record": i},
            )
        )
        if len(batch) == 5000:
            store.record_events(batch, outbox=True)
            batch = []
    store.close()


async def test_bounding_a_large_outbox_does_not_stall_the_loop(tmp_path: Path) -> None:
    """100k entries, a bound of 20k, the broker unreachable (a closed loopback port):
    the sink drops 80k while heartbeats, snapshots and scrapes go on, and the loop is never
    late by more than MAX_LAG."""
    fill(tmp_path / "state", ENTRIES)
    store = StateStore.open(tmp_path / "state")  # off the probe: `run` opens it in a thread
    agent = InProcessAgent(
        tmp_path / "state",
        {
            "url": f"mqtt://127.0.0.1:{free_port()}",
            "outbox_max_entries": BOUND,
            "metrics_interval": 1.0,
            "reconnect_min": 0.2,
            "reconnect_max": 0.2,
        },
        heartbeat_interval=0.2,
        extra={"collectors": {name: {"enabled": False} for name in registry.COLLECTORS}},
        store=store,
    )
    lags: list[float] = []
    stop = asyncio.Event()

    async def probe() -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            before = loop.time()
            await asyncio.sleep(0.005)
            lags.append(loop.time() - before - 0.005)

    probing = asyncio.create_task(probe())
    runtime = await agent.start()
    try:
        sink = runtime.sinks["mqtt"]
        for _ in range(40):  # scrapes and heartbeats, each reporting the outbox depth
            runtime.samples()
            await asyncio.sleep(0.1)
        await until(lambda: sink.outbox.dropped["event"] > 0, what="the bound applied")
        stop.set()
        await probing
        assert max(lags) < MAX_LAG, f"the loop was {max(lags) * 1000:.0f} ms late"
        # Bounded for real: the drops covered the excess (a heartbeat and a snapshot may
        # have come since).
        assert sink.outbox.dropped["event"] >= ENTRIES - BOUND - 2
        assert sum(sink.outbox.depth().values()) <= BOUND + 2
    finally:
        stop.set()
        await agent.stop()


async def test_no_statement_runs_on_the_loop(tmp_path: Path) -> None:
    """Scrapes, heartbeats, events and the sink's own work for two seconds with the broker
    down: every SQL statement runs in the store thread, none on the event loop (a scrape or
    a heartbeat used to count the outbox there)."""
    agent = InProcessAgent(
        tmp_path / "state",
        {"url": f"mqtt://127.0.0.1:{free_port()}", "reconnect_min": 0.2, "reconnect_max": 0.2},
        heartbeat_interval=0.2,
        extra={"collectors": {name: {"enabled": False} for name in registry.COLLECTORS}},
    )
    runtime = await agent.start()
    loop_thread = threading.get_ident()
    on_loop: list[str] = []
    elsewhere: list[str] = []

    def trace(sql: str) -> None:
        (on_loop if threading.get_ident() == loop_thread else elsewhere).append(sql)

    try:
        with runtime.store._lock:
            runtime.store._conn.set_trace_callback(trace)
        sink = runtime.sinks["mqtt"]
        for i in range(20):
            runtime.samples()  # what /metrics renders
            heartbeat_payload(
                runtime,
                seq=i,
                bdseq=1,
                now=time.time(),
                outbox_depth=sink.outbox.depth(),
                outbox_dropped={},
            )
            runtime.emit(Event(source="test", kind="probe", severity=Severity.INFO, message="m"))
            await asyncio.sleep(0.1)
        assert on_loop == []
        assert elsewhere  # the store was used meanwhile, from its thread
    finally:
        with runtime.store._lock:
            runtime.store._conn.set_trace_callback(None)
        await agent.stop()
