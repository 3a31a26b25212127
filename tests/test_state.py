"""The state store: schema version, events with the outbox, key-value, corrupt and unwritable."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.contracts.errors import StateStoreError
from agent.contracts.model import Event, Severity
from agent.runtime.state import DB_NAME, SCHEMA_VERSION, StateStore
from exporters.outbox import Outbox, OutboxLimits
from tests.support.disk import MIB, SmallDisk


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
            await runtime.settle()
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


def xid_event(i: int) -> Event:
    """An event of the size the kernel log raises (an Xid with its attributes)."""
    return Event(
        source="kernel_log",
        kind="xid",
        severity=Severity.CRITICAL,
        subject="GPU-5b3c1d2e",
        message=f"GPU 0000:3b:00.0 reported Xid 79 (fallen off the bus), record {i}",
        action="drain the node and reset the GPU; if it recurs, replace it",
        attributes={"xid": 79, "pid": 4242, "record": i},
    )


class TestSmallDisk:
    """On a small file system the WAL cannot fill the disk by itself."""

    def test_wal_stays_small_under_steady_traffic(self, tmp_path: Path) -> None:
        """Events in, delivered out, state values and heartbeats rewritten, 1,500 rounds on a
        4 MiB disk: every write works and the WAL stays under 1 MiB (SQLite's default
        checkpoint lets it reach 4 MB first, which on this disk never comes)."""
        with SmallDisk(tmp_path / "disk") as disk:
            store = StateStore.open(disk.path)
            largest = 0
            try:
                for i in range(1500):
                    store.record_event(xid_event(i), outbox=True)
                    store.outbox_put("heartbeat", str(i), b"h" * 400)
                    store.put("kmsg", "cursor", {"boot_id": "b", "seq": i})
                    store.outbox_ack([e.seq for e in store.outbox_peek(10)])
                    largest = max(largest, disk.file_size(f"{DB_NAME}-wal"))
            finally:
                store.close()
            assert store.write_failures == 0
            assert largest < 1 * MIB

    def test_wal_given_back_after_a_failed_write(self, tmp_path: Path) -> None:
        """A write that fails (disk full) makes the store give the WAL's space back as soon
        as a write works again: the WAL does not keep the disk full."""
        with SmallDisk(tmp_path / "disk") as disk:
            store = StateStore.open(disk.path)
            try:
                for i in range(100):
                    store.record_event(xid_event(i), outbox=True)
                disk.fill()
                refused = write_until_refused(store)
                assert "full" in refused
                disk.free()
                store.put("kmsg", "cursor", 1)
                assert disk.file_size(f"{DB_NAME}-wal") <= 64 * 1024
            finally:
                store.close()


def write_until_refused(store: StateStore) -> str:
    """Store events until the store refuses one (the disk is full); the error."""
    for i in range(100_000):
        try:
            store.record_event(xid_event(i), outbox=True)
        except StateStoreError as exc:
            return str(exc)
    raise AssertionError("the store never refused a write")


class TestVariableLimit:
    """No statement binds more parameters than SQLite before 3.32 allows (999)."""

    def limited_store(self) -> StateStore:
        store = StateStore.in_memory()
        store._conn.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 999)
        return store

    def test_ack_of_many_entries(self) -> None:
        store = self.limited_store()
        seqs = [store.outbox_put("metrics", "snapshot", b"m") for _ in range(3000)]
        store.outbox_ack(seqs)
        assert store.outbox_depth() == {}

    def test_bounds_drop_many_entries(self) -> None:
        store = self.limited_store()
        for _ in range(3000):
            store.outbox_put("metrics", "snapshot", b"m")
        outbox = Outbox(store, OutboxLimits(max_entries=100, max_bytes=10**9, max_age=3600))
        assert outbox.enforce() == {"metrics": 2900}
        assert store.outbox_usage() == (100, 100)


OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("put"), st.sampled_from(["event", "metrics", "heartbeat"]), st.integers(0, 300)
        ),
        st.tuples(st.just("ack"), st.just(""), st.integers(0, 20)),
        st.tuples(st.just("expire"), st.just(""), st.integers(0, 40)),
        st.tuples(st.just("enforce"), st.just(""), st.integers(1, 30)),
    ),
    max_size=60,
)


class TestOutboxAccounting:
    """The outbox's entry and byte totals are kept as it changes, not counted per question:
    they always equal what a count of the table says, also after reopening."""

    @settings(max_examples=60, deadline=None)
    @given(OPS)
    def test_totals_match_the_table(self, ops: list[tuple[str, str, int]]) -> None:
        store = StateStore.in_memory()
        outbox = Outbox(store, OutboxLimits(max_entries=10**6, max_bytes=10**9, max_age=3600))
        clock = 1000.0
        for op, kind, n in ops:
            clock += 1
            if op == "put" and kind == "event":
                store.record_events([xid_event(n)], outbox=True)
            elif op == "put":
                outbox.put(kind, str(n), b"p" * n, created=clock)
            elif op == "ack":
                store.outbox_ack([e.seq for e in store.outbox_peek(n)])
            elif op == "expire":
                store.outbox_expire(clock - n)
            else:
                Outbox(store, OutboxLimits(n, 10**9, 3600)).enforce(clock)
            assert store.outbox_depth() == counted_depth(store)
            assert store.outbox_usage() == counted_usage(store)

    def test_totals_read_once_at_open(self, tmp_path: Path) -> None:
        store = StateStore.open(tmp_path)
        store.record_events([xid_event(i) for i in range(5)], outbox=True)
        store.outbox_put("metrics", "snapshot", b"x" * 100)
        expected = counted_usage(store)
        store.close()
        again = StateStore.open(tmp_path)
        try:
            assert again.outbox_usage() == expected
            assert again.outbox_depth() == {"event": 5, "metrics": 1}
        finally:
            again.close()

    def test_questions_run_no_statement(self) -> None:
        """Depth and usage (asked by every scrape, heartbeat and bound check) are answered
        without a query: over a 100k-entry outbox the sums took 14-17 ms on the loop."""
        store = StateStore.in_memory()
        store.record_events([xid_event(i) for i in range(5)], outbox=True)
        statements: list[str] = []
        store._conn.set_trace_callback(statements.append)
        store.outbox_depth()
        store.outbox_usage()
        assert statements == []


def counted_depth(store: StateStore) -> dict[str, int]:
    rows = store._conn.execute("SELECT kind, COUNT(*) FROM outbox GROUP BY kind").fetchall()
    return {str(kind): int(count) for kind, count in rows}


def counted_usage(store: StateStore) -> tuple[int, int]:
    ((count, size),) = store._conn.execute(
        "SELECT COUNT(*), COALESCE(SUM(LENGTH(payload)), 0) FROM outbox"
    ).fetchall()
    return int(count), int(size)


class TestDuplicateEvents:
    """An event whose id the store already holds (made again from the same kernel-log record
    after a crash: `stable_event_id`) is kept once in the history, and so must be queued for
    delivery once: a second outbox entry for it is a second delivery of the same event."""

    @pytest.mark.parametrize(
        "form",
        ["queued_again", "delivered_then_again", "twice_in_one_batch", "again_among_new"],
    )
    def test_an_event_already_stored_is_not_queued_again(self, form: str) -> None:
        store = StateStore.in_memory()
        e, other = event("a"), event("b")
        if form == "queued_again":
            store.record_event(e, outbox=True)
            store.record_event(e, outbox=True)
            expected = [e.id]
        elif form == "delivered_then_again":
            store.record_event(e, outbox=True)
            store.outbox_ack([store.outbox_peek(1)[0].seq])
            store.record_event(e, outbox=True)
            expected = []
        elif form == "twice_in_one_batch":
            store.record_events([e, e], outbox=True)
            expected = [e.id]
        else:
            store.record_event(e, outbox=True)
            store.record_events([other, e], outbox=True)
            expected = [e.id, other.id]
        assert [entry.key for entry in store.outbox_peek(10)] == expected
        assert store.outbox_usage()[0] == len(expected)  # the running totals agree
        assert len(store.recent_events()) == (2 if form == "again_among_new" else 1)
        store.close()
