"""The state store: schema version, events with the outbox, key-value, corrupt and unwritable."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from agent.contracts.model import Event, Severity
from agent.runtime.state import DB_NAME, SCHEMA_VERSION, StateStore


def event(kind: str = "k", severity: Severity = Severity.WARNING) -> Event:
    return Event(source="test", kind=kind, severity=severity, message="something happened")


class TestStore:
    """Durable events, outbox and key-value area."""

    def test_schema_version_recorded(self, tmp_path: Path) -> None:
        store = StateStore.open(tmp_path)
        assert store.schema_version() == SCHEMA_VERSION
        assert store.durable and not store.problems
        store.close()
        mode = sqlite3.connect(tmp_path / DB_NAME).execute("PRAGMA journal_mode").fetchone()[0]
        assert mode == "wal"

    def test_event_and_outbox_survive_reopen(self, tmp_path: Path) -> None:
        store = StateStore.open(tmp_path)
        first, second = event("a"), event("b", Severity.CRITICAL)
        store.record_event(first, outbox=True)
        store.record_event(second, outbox=False)
        store.put("gpu", "ecc:GPU-1", {"value": 3})
        store.close()
        store = StateStore.open(tmp_path)
        assert [e.id for e in store.recent_events()] == [second.id, first.id]
        assert [e.id for e in store.recent_events(min_severity=Severity.CRITICAL)] == [second.id]
        entries = store.outbox_peek()
        assert [(e.kind, e.key) for e in entries] == [("event", first.id)]
        assert Event.from_dict(__import__("json").loads(entries[0].payload)).id == first.id
        assert store.get("gpu", "ecc:GPU-1") == {"value": 3}
        store.outbox_ack([entries[0].seq])
        assert store.outbox_depth() == {}
        store.close()

    def test_recording_same_event_twice_is_idempotent(self, tmp_path: Path) -> None:
        store = StateStore.open(tmp_path)
        e = event()
        store.record_event(e, outbox=False)
        store.record_event(e, outbox=False)
        assert len(store.recent_events()) == 1
        store.close()

    def test_kv_namespaces(self) -> None:
        store = StateStore.in_memory()
        store.put("a", "x", 1)
        store.put("b", "x", 2)
        store.put("a", "x", 5)
        assert store.items("a") == {"x": 5}
        store.delete("a", "x")
        assert store.get("a", "x") is None
        assert store.get("b", "x") == 2


class TestDamage:
    """A corrupt or unwritable store degrades, never stops the agent."""

    def test_corrupt_database_moved_aside(self, tmp_path: Path) -> None:
        (tmp_path / DB_NAME).write_bytes(b"this is not a database" * 100)
        store = StateStore.open(tmp_path)
        assert store.durable
        assert [p.kind for p in store.problems] == ["state_store_corrupt"]
        aside = [p for p in tmp_path.iterdir() if p.name.startswith(f"{DB_NAME}.corrupt-")]
        assert len(aside) == 1
        store.record_event(event(), outbox=True)  # the new one works
        store.close()

    @pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere; see the file case")
    def test_unwritable_dir_falls_back_to_memory(self, tmp_path: Path) -> None:
        tmp_path.chmod(0o500)
        store = StateStore.open(tmp_path / "sub")
        assert not store.durable

    def test_state_dir_is_a_file(self, tmp_path: Path) -> None:
        blocker = tmp_path / "state"
        blocker.write_text("a file where the state dir should be")
        store = StateStore.open(blocker)
        assert not store.durable
        assert [p.kind for p in store.problems] == ["state_store_unwritable"]
        assert str(blocker) in store.problems[0].message
        store.record_event(event(), outbox=True)
        assert store.outbox_depth() == {"event": 1}

    def test_newer_schema_refused(self, tmp_path: Path) -> None:
        conn = sqlite3.connect(tmp_path / DB_NAME)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 5}")
        conn.close()
        store = StateStore.open(tmp_path)
        assert not store.durable
        assert "newer than this gpuwarden understands" in store.problems[0].message


class TestFullDisk:
    """A full disk: writes fail, the agent keeps going, health and a counter say why."""

    async def test_full_database(self, tmp_path: Path) -> None:
        from tests.support.collectors import scripted_runtime

        store = StateStore.open(tmp_path)
        # SQLite's own size cap stands in for a full disk: the error is the same SQLITE_FULL.
        pages = store._conn.execute("PRAGMA page_count").fetchone()[0]
        store._conn.execute(f"PRAGMA max_page_count = {pages}")
        runtime, _ = scripted_runtime({}, store=store)
        await runtime.start()
        try:
            for i in range(200):
                runtime.emit(event(f"k{i}"))
            runtime.flush_events()
            assert store.write_failures >= 1
            assert store.last_write_failure is not None
            assert "full" in store.last_write_failure[1]
            problems = runtime.health().problems
            assert any("state store cannot write" in p and "full" in p for p in problems)
            assert len(runtime.recent_events) == 200  # still logged and announced
            counters = {s.family.name: s.value for s in runtime.samples()}
            assert counters["gpuwarden_state_store_write_failures_total"] >= 1
        finally:
            await runtime.stop()
            store.close()


class TestRetention:
    """The event history keeps EVENT_RETENTION; older events are pruned, queued ones stay."""

    def test_prune_history(self) -> None:
        import time as clock

        from agent.runtime.core import EVENT_RETENTION
        from tests.support.collectors import scripted_runtime

        runtime, _ = scripted_runtime({})
        now = clock.time()
        old = Event(
            source="t",
            kind="old",
            severity=Severity.INFO,
            message="m",
            time=now - EVENT_RETENTION - 60,
        )
        runtime.store.record_event(old, outbox=True)
        runtime.store.record_event(event("new"), outbox=False)
        assert runtime.prune_history(now) == 1
        assert [e.kind for e in runtime.store.recent_events()] == ["new"]
        assert runtime.store.outbox_depth() == {"event": 1}  # delivery is the outbox's business
