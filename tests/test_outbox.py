"""The bounded outbox: what goes first when it is full, what is counted, what survives."""

from __future__ import annotations

import time
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.contracts.model import Event, Severity
from agent.runtime.state import StateStore
from exporters.outbox import Outbox, OutboxLimits
from tests.support.mqtt import InProcessAgent
from tests.support.ports import free_port
from tests.support.waiting import announced


def event(i: int) -> Event:
    return Event(source="test", kind="probe", severity=Severity.INFO, message=f"event {i}")


def fill(
    store: StateStore, outbox: Outbox, events: int, metrics: int, heartbeats: int
) -> list[str]:
    ids = []
    for i in range(max(events, metrics, heartbeats)):
        if i < metrics:
            outbox.put("metrics", "snapshot", b"m" * 100)
        if i < events:
            e = event(i)
            store.record_event(e, outbox=True)
            ids.append(e.id)
        if i < heartbeats:
            outbox.put("heartbeat", str(i), b"h" * 50)
    return ids


class TestBounds:
    """Snapshots go before heartbeats, heartbeats before events; every drop counted."""

    def test_snapshots_dropped_first_events_kept(self) -> None:
        """20 events + 30 snapshots into 25 entries: 25 snapshots go, every event stays."""
        store = StateStore.in_memory()
        outbox = Outbox(store, OutboxLimits(max_entries=25, max_bytes=10**9, max_age=3600))
        ids = fill(store, outbox, events=20, metrics=30, heartbeats=0)
        dropped = outbox.enforce()
        assert dropped == {"metrics": 25}
        assert store.outbox_depth() == {"event": 20, "metrics": 5}
        kept = [e.key for e in outbox.peek(100) if e.kind == "event"]
        assert kept == ids
        assert outbox.dropped["metrics"] == 25

    def test_events_dropped_last_and_oldest_first(self) -> None:
        """With no snapshots left, the newest heartbeat stays and the oldest events go."""
        store = StateStore.in_memory()
        outbox = Outbox(store, OutboxLimits(max_entries=10, max_bytes=10**9, max_age=3600))
        ids = fill(store, outbox, events=12, metrics=3, heartbeats=4)
        dropped = outbox.enforce()
        # 12 events + 3 snapshots + 1 heartbeat (each new heartbeat supersedes the older)
        assert dropped == {"metrics": 3, "event": 3}
        entries = outbox.peek(100)
        assert [e.key for e in entries if e.kind == "event"] == ids[3:]
        assert [e.key for e in entries if e.kind == "heartbeat"] == ["3"]

    def test_byte_bound(self) -> None:
        """The byte bound drops snapshots until the payload total fits."""
        store = StateStore.in_memory()
        outbox = Outbox(store, OutboxLimits(max_entries=10**6, max_bytes=1000, max_age=3600))
        for _ in range(20):
            outbox.put("metrics", "snapshot", b"m" * 100)
        assert outbox.enforce() == {"metrics": 10}
        assert store.outbox_usage() == (10, 1000)

    def test_age_bound(self) -> None:
        """Entries older than max_age go, whatever their kind."""
        store = StateStore.in_memory()
        outbox = Outbox(store, OutboxLimits(max_entries=100, max_bytes=10**9, max_age=60))
        now = time.time()
        outbox.put("metrics", "snapshot", b"x", created=now - 120)
        # An event that happened an hour ago (an old kernel-log record) is queued now: its age
        # in the outbox counts from now, or it would be dropped on arrival.
        store.record_event(
            Event(source="t", kind="k", severity=Severity.INFO, message="old", time=now - 3600),
            outbox=True,
        )
        store.record_event(event(1), outbox=True)
        assert outbox.enforce(now + 30) == {"metrics": 1}
        assert store.outbox_depth() == {"event": 2}
        assert outbox.enforce(now + 120) == {"event": 2}
        assert store.outbox_depth() == {}

    @settings(max_examples=40, deadline=None)
    @given(
        st.lists(st.sampled_from(["event", "metrics", "heartbeat"]), max_size=80),
        st.integers(10, 40),
    )
    def test_bound_holds_and_events_outlive_snapshots(self, kinds: list[str], limit: int) -> None:
        """After enforce: within the bound; an event was dropped only if no snapshot is left."""
        store = StateStore.in_memory()
        outbox = Outbox(store, OutboxLimits(max_entries=limit, max_bytes=10**9, max_age=3600))
        for i, kind in enumerate(kinds):
            if kind == "event":
                store.record_event(event(i), outbox=True)
            else:
                outbox.put(kind, str(i), b"p")
        dropped = outbox.enforce()
        entries, _ = store.outbox_usage()
        assert entries <= limit
        depth = store.outbox_depth()
        if dropped.get("event"):
            assert depth.get("metrics", 0) == 0
            assert depth.get("heartbeat", 0) <= 1
        assert depth.get("event", 0) == min(kinds.count("event"), limit)


class TestSurvival:
    """The outbox is on disk: it survives the process that wrote it."""

    def test_entries_survive_reopen(self, tmp_path: Path) -> None:
        """Queued entries are there, in order, after the store is reopened."""
        store = StateStore.open(tmp_path)
        ids = fill(store, Outbox(store, OutboxLimits(100, 10**9, 3600)), 5, 0, 0)
        store.close()
        again = StateStore.open(tmp_path)
        assert [e.key for e in again.outbox_peek(10)] == ids
        again.close()

    async def test_startup_problems_are_queued(self, tmp_path: Path) -> None:
        """An event raised while opening the store (a corrupt database) is in the outbox."""
        state = tmp_path / "state"
        state.mkdir()
        (state / "state.db").write_bytes(b"this is not a database" * 100)
        agent = InProcessAgent(
            state,
            {"url": f"mqtt://127.0.0.1:{free_port()}", "reconnect_min": 5.0, "reconnect_max": 5.0},
        )
        runtime = await agent.start()
        try:
            queued = [e for e in runtime.store.outbox_peek(100) if e.kind == "event"]
            assert any(b'"kind":"state_store_corrupt"' in e.payload for e in queued)
        finally:
            await agent.stop()


class TestSinkDrops:
    """The sink turns drops into one event, a counter and a health problem."""

    async def test_full_outbox_while_broker_down(self, tmp_path: Path) -> None:
        """Broker unreachable, outbox over its bound: snapshots dropped and counted, one
        outbox_dropped event, events kept."""
        agent = InProcessAgent(
            tmp_path / "state",
            {
                "url": f"mqtt://127.0.0.1:{free_port()}",
                "outbox_max_entries": 20,
                "reconnect_min": 5.0,
                "reconnect_max": 5.0,
            },
            heartbeat_interval=60.0,
        )
        runtime = await agent.start()
        try:
            sink = runtime.sinks["mqtt"]
            for _ in range(30):
                sink.outbox.put("metrics", "snapshot", b"{}")
            ids = []
            for i in range(8):
                produced = event(i)
                runtime.emit(produced)
                ids.append(produced.id)
            await runtime.settle()
            # The drop, by this call or by the sink's own enforcement in the store thread
            # (its event then follows the thread's answer, on the loop): one event either way.
            sink.enforce_now()
            await announced(runtime, "outbox_dropped")
            sink.enforce_now()
            await runtime.settle()
            drops = agent.events_of("outbox_dropped")
            assert len(drops) == 1
            assert "raise [mqtt] outbox_max_entries" in drops[0].action
            kept = {e.key for e in sink.outbox.peek(100) if e.kind == "event"}
            assert set(ids) <= kept
            samples = {(s.family.name, s.label_values): s.value for s in sink.samples()}
            assert samples[("gpuwarden_mqtt_outbox_dropped_total", ("metrics",))] >= 10
            assert samples[("gpuwarden_mqtt_outbox_dropped_total", ("event",))] == 0
            assert any("outbox dropped" in p for p in runtime.health().problems)
        finally:
            await agent.stop()
