"""A state store that starts in memory goes back to the disk once the disk can be used.

When the state dir cannot be used at start (a fresh state dir on a full disk: no room for the
database; a file system mounted read-only; a directory the agent may not write), the store
falls back to memory. It used to stay there for the whole run: everything the agent held
(outbox, events, counters, cursors) was lost at the next restart even after the operator
fixed the disk. What must hold instead: an attempt to open the database on the disk again
(`disk_attempt`, which the runtime makes every `state_retry_interval` seconds) fails while the
fault lasts and works once it is fixed; `adopt` then moves what memory holds into the database
(merged with what that database already had, nothing lost, nothing twice), the store is
durable, its problem gone, and what was written in memory is there for the next life.

Each fault is made for real: a small tmpfs filled up, remounted read-only, a directory owned
by root that the store, run as `nobody`, may not write.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import sqlite3
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.contracts.model import Event, Severity
from agent.program import registry
from agent.runtime.state import DB_NAME, StateStore
from tests.support.agent_proc import AgentProcess, http_get
from tests.support.disk import MIB, SmallDisk
from tests.support.waiting import wait_until
from tests.support.watch import metric_value

ATTEMPT_BOUND = 20.0
"""Seconds an attempt may take at most here: a hang guard, not a timing claim."""


def event(n: int) -> Event:
    return Event(source="test", kind="probe", severity=Severity.WARNING, message=f"probe {n}")


def in_use_on_disk(store: StateStore) -> bool:
    """`store.durable`, read anew (it changes under the test: mypy must not narrow it)."""
    return store.durable


class Fault:
    """A state dir that cannot be used until `fix()`."""

    state_dir: Path

    def fix(self) -> None:
        raise NotImplementedError

    def as_user(self) -> contextlib.AbstractContextManager[None]:
        """Who the store runs as while the fault lasts (root, but for `unwritable`)."""
        return contextlib.nullcontext()


class FullDisk(Fault):
    def __init__(self, disk: SmallDisk) -> None:
        self.disk = disk
        self.state_dir = disk.path / "state"
        disk.fill()  # a fresh state dir: nothing there yet, and no room for the database

    def fix(self) -> None:
        self.disk.free()


class ReadOnly(Fault):
    def __init__(self, disk: SmallDisk) -> None:
        self.disk = disk
        self.state_dir = disk.path / "state"
        self.state_dir.mkdir(mode=0o700)
        remount(disk.path, "ro")

    def fix(self) -> None:
        remount(self.disk.path, "rw")


class Unwritable(Fault):
    """A state dir owned by root, mode 0755, the store run as nobody; fixed by a chown."""

    def __init__(self, base: Path) -> None:
        self.user = pwd.getpwnam("nobody")
        self.state_dir = base / "state"
        self.state_dir.mkdir(mode=0o755)
        self.state_dir.chmod(0o755)

    def fix(self) -> None:
        with root():
            os.chown(self.state_dir, self.user.pw_uid, self.user.pw_gid)

    @contextlib.contextmanager
    def as_user(self) -> Iterator[None]:
        os.setegid(self.user.pw_gid)
        os.seteuid(self.user.pw_uid)
        try:
            yield
        finally:
            os.seteuid(0)
            os.setegid(0)


@contextlib.contextmanager
def root() -> Iterator[None]:
    """Root for a moment, inside Unwritable.as_user."""
    uid, gid = os.geteuid(), os.getegid()
    os.seteuid(0)
    os.setegid(0)
    try:
        yield
    finally:
        os.setegid(gid)
        os.seteuid(uid)


def remount(path: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], check=True)


@pytest.fixture(params=["full_disk", "read_only", "unwritable"])
def fault(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Fault]:
    if os.geteuid() != 0:
        pytest.skip("the faults are made as root")
    if request.param == "unwritable":
        # Reachable by nobody: tmp_path's parents are root's own (0700).
        base = Path(tempfile.mkdtemp(prefix="gpuwarden-unwritable-"))
        base.chmod(0o755)
        try:
            yield Unwritable(base)
        finally:
            subprocess.run(["rm", "-rf", str(base)], check=False)
        return
    with SmallDisk(tmp_path / "disk", size=2 * MIB) as disk:
        made: Callable[[SmallDisk], Fault] = FullDisk if request.param == "full_disk" else ReadOnly
        yield made(disk)


def attempt_disk(store: StateStore) -> StateStore:
    """One attempt to open the disk again, waited for; raises what it raised."""
    attempt = store.disk_attempt()
    assert attempt is not None
    return attempt.future.result(ATTEMPT_BOUND)


def on_disk(state_dir: Path) -> tuple[list[str], list[str], dict[str, str]]:
    """(outbox keys in order, event ids, kv) as the next life reads them."""
    with contextlib.closing(sqlite3.connect(state_dir / DB_NAME)) as db:
        keys = [k for (k,) in db.execute("SELECT key FROM outbox ORDER BY seq")]
        ids = [i for (i,) in db.execute("SELECT id FROM events")]
        kv = {f"{ns}/{k}": v for ns, k, v in db.execute("SELECT namespace, key, value FROM kv")}
    return keys, ids, kv


class TestBackToDisk:
    def test_state_written_in_memory_reaches_the_disk_once_it_is_fixed(self, fault: Fault) -> None:
        with fault.as_user():
            store = StateStore.open(fault.state_dir)
            try:
                assert not in_use_on_disk(store)
                assert [p.kind for p in store.problems] == ["state_store_unwritable"]
                first = [event(n) for n in range(3)]
                store.record_events(first, outbox=True)
                store.put("kernel_log", "file_cursor", {"offset": 10})
                store.put("gone", "soon", 1)
                with pytest.raises(OSError, match=r"not writable|no room"):  # tried, refused
                    attempt_disk(store)
                assert not in_use_on_disk(store)
                store.delete("gone", "soon")
                store.outbox_ack([store.outbox_peek(1)[0].seq])  # one delivered meanwhile
                fault.fix()
                disk = attempt_disk(store)
                moved = store.adopt(disk)
                assert in_use_on_disk(store) and store.path == fault.state_dir / DB_NAME
                assert store.problems == []
                assert moved["outbox_moved"] == 2 and moved["events_moved"] == 3
                later = event(9)  # written on the disk now
                store.record_event(later, outbox=True)
                assert store.outbox_depth() == {"event": 3}
            finally:
                store.close()
            keys, ids, kv = on_disk(fault.state_dir)
            assert keys == [first[1].id, first[2].id, later.id]
            assert sorted(ids) == sorted(e.id for e in [*first, later])
            assert kv == {"kernel_log/file_cursor": '{"offset": 10}'}
            # The next life opens it, durable, with everything.
            again = StateStore.open(fault.state_dir)
            try:
                assert again.durable and again.problems == []
                assert [e.key for e in again.outbox_peek(10)] == keys
                assert again.get("kernel_log", "file_cursor") == {"offset": 10}
            finally:
                again.close()


class TestMerge:
    """What the database on the disk already held is kept, and what memory read back from it
    at start is not stored twice."""

    def test_read_back_at_start_then_merged_without_duplicates(self, tmp_path: Path) -> None:
        if os.geteuid() != 0:
            pytest.skip("a tmpfs is mounted as root")
        with SmallDisk(tmp_path / "disk", size=2 * MIB) as disk:
            state_dir = disk.path / "state"
            last = StateStore.open(state_dir)
            old = [event(n) for n in range(4)]
            last.record_events(old, outbox=True)
            last.put("kernel_log", "file_cursor", {"offset": 1})
            last.put("counters", "a", 5)
            last.close()
            remount(disk.path, "ro")
            store = StateStore.open(state_dir)
            try:
                assert not in_use_on_disk(store)
                assert len(store.outbox_peek(10)) == 4  # read back from the database
                seqs = [e.seq for e in store.outbox_peek(10)]
                store.outbox_ack(seqs[:2])  # two delivered while in memory
                new = event(7)
                store.record_event(new, outbox=True)
                store.put("kernel_log", "file_cursor", {"offset": 2})
                store.delete("counters", "a")
                before = {e.seq: e.key for e in store.outbox_peek(10)}
                remount(disk.path, "rw")
                store.adopt(attempt_disk(store))
                # What a sink knows (numbers it read) still names the same entries.
                assert {e.seq: e.key for e in store.outbox_peek(10)} == before
            finally:
                store.close()
            keys, ids, kv = on_disk(state_dir)
            assert keys == [old[2].id, old[3].id, new.id]
            assert sorted(ids) == sorted(e.id for e in [*old, new])
            assert kv == {"kernel_log/file_cursor": '{"offset": 2}'}

    def test_entries_memory_never_saw_are_kept_and_numbered_after_its_own(
        self, tmp_path: Path
    ) -> None:
        """A database that memory could not read at start (here: made while memory ran)
        keeps its entries; they come after every number memory gave, none means two."""
        state_dir = tmp_path / "state"
        store = StateStore.in_memory(state_dir=state_dir)
        mine = [event(n) for n in range(3)]
        store.record_events(mine, outbox=True)
        store.outbox_ack([store.outbox_peek(1)[0].seq])
        theirs = [event(10 + n) for n in range(4)]
        other = StateStore.open(state_dir)
        other.record_events(theirs, outbox=True)
        other.record_event(mine[2], outbox=False)  # an event both hold: kept once
        other.close()
        try:
            store.adopt(attempt_disk(store))
            entries = store.outbox_peek(20)
            assert [e.key for e in entries] == [*(e.id for e in mine[1:]), *(e.id for e in theirs)]
            assert entries[0].seq == 2 and entries[2].seq > 3
            fresh = event(20)
            store.record_event(fresh, outbox=True)
            assert store.outbox_peek(1, after_seq=entries[-1].seq)[0].key == fresh.id
            assert store.outbox_depth() == {"event": 7}
        finally:
            store.close()
        _, ids, _ = on_disk(state_dir)
        assert len(ids) == len(set(ids)) == 8


# -- the real agent -----------------------------------------------------------------------------

XIDS = 5


def xid_lines(count: int) -> str:
    return "".join(
        f"[{1000 + n:10.4f}] NVRM: Xid (PCI:0000:{n:02x}:00): 79, pid={4000 + n}, "
        f"name=python3, line {n}\n"
        for n in range(count)
    )


def kernel_log_only(log: Path) -> str:
    others = "".join(
        f"[collectors.{name}]\nenabled = false\n"
        for name in registry.COLLECTORS
        if name != "kernel_log"
    )
    return f'[collectors.kernel_log]\npath = "{log}"\ninterval = 0.5\n{others}'


def stored(state_dir: Path) -> dict[str, list[str]]:
    """Event kind -> the ids stored under it."""
    kinds: dict[str, list[str]] = {}
    with contextlib.closing(sqlite3.connect(state_dir / DB_NAME)) as db:
        for kind, event_id in db.execute("SELECT kind, id FROM events ORDER BY time"):
            kinds.setdefault(kind, []).append(event_id)
    return kinds


def durable(agent: AgentProcess) -> float | None:
    _, body = http_get(agent.metrics_url)
    return metric_value(body, "gpuwarden_state_store_durable")


def health(agent: AgentProcess) -> str:
    return http_get(agent.metrics_url.replace("/metrics", "/healthz"))[1]


@pytest.mark.slow
def test_the_real_agent_goes_back_to_the_disk_and_its_next_life_has_it(
    tmp_path: Path, agent_process: AgentProcess
) -> None:
    """A fresh state dir on a full disk: the agent reads the kernel log in memory; once the
    disk has room it moves there by itself (no restart), and the next life has the Xids and
    the cursor past them: it stores no Xid twice."""
    log = tmp_path / "kern.log"
    log.write_text(xid_lines(XIDS))
    agent_process.core_text = "state_retry_interval = 1.0\n"
    agent_process.config_text = kernel_log_only(log)
    state_dir = agent_process.workdir / "state"
    with SmallDisk(state_dir, size=2 * MIB) as disk:
        disk.fill()
        agent_process.start()
        assert durable(agent_process) == 0
        assert "state store is in memory (state dir unusable)" in health(agent_process)
        wait_until(lambda: agent_process.log().count('"kind": "xid"') >= XIDS, what="the Xids read")
        assert disk.file_size(DB_NAME) == 0  # nothing on the disk yet: no room
        disk.free()
        wait_until(lambda: durable(agent_process) == 1, what="the store on the disk again")
        assert "in memory" not in health(agent_process)
        wait_until(lambda: "state_store_durable" in agent_process.log(), what="the event said so")
        assert agent_process.stop() == 0
        first = stored(state_dir)
        assert len(first["xid"]) == XIDS, first
        assert len(first["state_store_unwritable"]) == 1
        assert len(first["state_store_durable"]) == 1
        # The next life: durable from the start, the cursor past the Xids.
        agent_process.start()
        assert durable(agent_process) == 1
        with log.open("a") as appended:  # one line more: the only one this life reads
            appended.write(xid_lines(XIDS + 1).splitlines(keepends=True)[-1])
        wait_until(
            lambda: len(stored_live(state_dir).get("xid", [])) == XIDS + 1,
            what="the new Xid, and only it",
        )
        assert agent_process.stop() == 0
        second = stored(state_dir)
        assert len(second["xid"]) == XIDS + 1, second
        assert "state_store_unwritable" not in second or len(second["state_store_unwritable"]) == 1


def stored_live(state_dir: Path) -> dict[str, list[str]]:
    """`stored`, read as `diag` reads it beside the running agent."""
    uri = f"{(state_dir / DB_NAME).as_uri()}?mode=ro"
    kinds: dict[str, list[str]] = {}
    with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=5)) as db:
        for kind, event_id in db.execute("SELECT kind, id FROM events"):
            kinds.setdefault(kind, []).append(event_id)
    return kinds
