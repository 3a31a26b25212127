"""An agent that starts on a state disk that is already full keeps its store.

The disk filled while the agent was down (or it restarted on a full disk): the database is
there, with events queued for delivery, kernel-log cursors and counters. SQLite refuses to open
a WAL database when it cannot make the `-shm` index (SQLITE_IOERR_SHMSIZE on a full disk), and
the store used to fall back to an empty in-memory database: the queued outbox was not delivered,
the cursors were gone (the kernel log read again from the start), the advice was "make it
writable", and the agent stayed in memory after the disk had room again, so that nothing it
found for the rest of its life survived a restart.

What must hold instead, however the last life ended (closed cleanly: no `-wal` or `-shm`
left; killed: both left with committed transactions in the WAL): the store opens on the disk
it has, reads what it holds, reports writes as failing (the store guard's one policy: events
wait in memory, one health problem), and writes again once the disk has room.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.contracts.model import Event, Severity
from agent.runtime.state import DB_NAME, StateStore
from agent.runtime.store_guard import StoreGuard
from tests.support.agent_proc import REPO, AgentProcess, http_get, pythonpath
from tests.support.disk import MIB, SmallDisk
from tests.support.mosquitto import Broker
from tests.support.mqtt import Subscriber
from tests.support.waiting import wait_until
from tests.test_kernel_log_sigkill import agent_config

QUEUED = 5
CURSOR = {"path": "/var/log/kern.log", "inode": 12, "offset": 4096, "line": 40, "skipping": 0}

LAST_LIFE = f"""
CURSOR = {CURSOR!r}
import os, signal, sys
from pathlib import Path
from agent.contracts.model import Event, Severity
from agent.runtime.state import StateStore
store = StateStore.open(Path(sys.argv[1]))
for i in range(int(sys.argv[2])):
    store.record_event(
        Event(source="kernel_log", kind="xid", severity=Severity.CRITICAL, message=f"queued {{i}}"),
        outbox=True,
    )
store.put("kernel_log", "file_cursor", CURSOR)
if sys.argv[3] == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
store.close()
"""


def last_life(state_dir: Path, ended: str) -> None:
    """A previous agent's store: QUEUED events queued, a cursor saved, then closed or killed."""
    done = subprocess.run(
        [sys.executable, "-c", LAST_LIFE, str(state_dir), str(QUEUED), ended],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": pythonpath()},
        capture_output=True,
        text=True,
        check=False,
    )
    expected = -signal.SIGKILL if ended == "killed" else 0
    assert done.returncode == expected, done.stderr
    left = {p.name for p in state_dir.iterdir()}
    if ended == "killed":
        assert {f"{DB_NAME}-wal", f"{DB_NAME}-shm"} <= left
        assert (state_dir / f"{DB_NAME}-wal").stat().st_size > 0  # the data is in the WAL
    else:
        assert left == {DB_NAME}


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[SmallDisk]:
    with SmallDisk(tmp_path / "disk", size=2 * MIB) as mounted:
        yield mounted


def queued_ids(store: StateStore) -> list[str]:
    return [entry.key for entry in store.outbox_peek(100)]


@pytest.mark.parametrize("ended", ["closed", "killed"])
class TestFullBeforeStart:
    def test_opens_reads_refuses_then_writes_once_freed(self, disk: SmallDisk, ended: str) -> None:
        state_dir = disk.path / "state"
        last_life(state_dir, ended)
        disk.fill()
        store = StateStore.open(state_dir)
        try:
            assert store.durable, [p.message for p in store.problems]
            assert not [p for p in store.problems if p.kind == "state_store_unwritable"]
            assert len(queued_ids(store)) == QUEUED  # the queued outbox, read from the disk
            assert store.get("kernel_log", "file_cursor") == CURSOR
            guard = StoreGuard(store, state_dir)
            failing = guard.failing
            assert failing is not None and "full" in failing  # said at once, and what it is
            found = Event(source="test", kind="probe", severity=Severity.INFO, message="now")
            guard.queue(found)
            assert not guard.flush(outbox=True)  # waits in memory
            assert guard.queued_events == 1
            disk.free()
            assert guard.flush(outbox=True)
            assert guard.failing is None
        finally:
            store.close()
        # On the disk, for the next life: what was queued and what waited meanwhile.
        with sqlite3.connect(state_dir / DB_NAME) as db:
            keys = [key for (key,) in db.execute("SELECT key FROM outbox ORDER BY seq")]
        assert len(keys) == QUEUED + 1 and keys[-1] == found.id


# -- the real agent ---------------------------------------------------------------------------

OLD, NEW = 6, 4
"""Xid lines read in the last life (queued: the broker was down) and in this one."""


def xid_lines(first: int, count: int) -> str:
    return "".join(
        f"[{1000 + n:10.4f}] NVRM: Xid (PCI:0000:{n:02x}:00): 79, pid={4000 + n}, "
        f"name=python3, line {n}\n"
        for n in range(first, first + count)
    )


def gauge(agent: AgentProcess, name: str, labels: str = "") -> float | None:
    status, text = http_get(agent.metrics_url)
    assert status == 200
    for line in text.splitlines():
        if line.startswith(f"{name}{labels} ") or line.startswith(f"{name}{{{labels}}} "):
            return float(line.rsplit(" ", 1)[1])
    return None


def queued_xids(state_dir: Path) -> int:
    """Xids in the outbox, read as `diag` reads it beside the running agent."""
    uri = f"{(state_dir / DB_NAME).as_uri()}?mode=ro"
    with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=5)) as db:
        rows = db.execute("SELECT payload FROM outbox WHERE kind='event'").fetchall()
    return sum(1 for (payload,) in rows if json.loads(payload)["kind"] == "xid")


def arrived_xids(sub: Subscriber) -> dict[str, set[str]]:
    """GPU address of each arrived Xid -> the ids it arrived under."""
    seen: dict[str, set[str]] = defaultdict(set)
    for message in sub.on("/events"):
        event = message.json()
        if event["kind"] == "xid":
            seen[event["attributes"]["pci_bus_id"]].add(str(event["id"]))
    return seen


def address(n: int) -> str:
    return f"0000:{n:02x}:00.0"


@pytest.mark.slow
@pytest.mark.parametrize("ended", [signal.SIGTERM, signal.SIGKILL], ids=["stopped", "killed"])
def test_the_real_agent_delivers_what_waited_and_stores_again(
    tmp_path: Path, agent_process: AgentProcess, ended: signal.Signals
) -> None:
    """Last life: Xids read while the broker was down, queued on the state disk; it ended
    (stopped or killed), the log was rotated, the disk filled up. This life: the queued Xids
    reach the broker while the disk is still full, the node beats and says why it is sick,
    the new Xids wait and arrive once the disk has room, and are stored for the next life."""
    broker = Broker(tmp_path / "broker")  # not started yet: the last life queues
    log = tmp_path / "kern.log"
    log.write_text(xid_lines(0, OLD))
    agent_process.config_text = agent_config(broker, log, heartbeat=0.5, read_interval=0.5)
    state_dir = agent_process.workdir / "state"
    sub: Subscriber | None = None
    with SmallDisk(state_dir) as disk:
        try:
            agent_process.start()
            wait_until(lambda: queued_xids(state_dir) == OLD, what=f"{OLD} Xids queued")
            agent_process.signal(ended)
            assert agent_process.process is not None
            agent_process.process.wait(15)
            agent_process.process = None
            log.rename(tmp_path / "kern.log.1")  # rotated: the old lines cannot be read again
            log.write_text(xid_lines(OLD, NEW))
            disk.fill()

            broker.start()
            sub = Subscriber(broker.port).start()
            agent_process.start()
            old = {address(n) for n in range(OLD)}
            sub.wait_for(lambda s: old <= arrived_xids(s).keys(), what="the queued Xids")
            sub.wait_for(
                lambda s: any(
                    "state store cannot write" in problem
                    for beat in s.on("/heartbeat")[-1:]
                    for problem in beat.json().get("health", [])
                ),
                what="a heartbeat naming the full state disk",
            )
            assert gauge(agent_process, "gpuwarden_state_store_durable") == 1
            assert disk.available() == 0

            disk.free()
            new = {address(n) for n in range(OLD, OLD + NEW)}
            sub.wait_for(lambda s: new <= arrived_xids(s).keys(), what="the Xids that waited")
            twice = {k: ids for k, ids in arrived_xids(sub).items() if len(ids) > 1}
            assert not twice, f"an Xid arrived under different ids: {twice}"
            assert agent_process.stop() == 0
            with sqlite3.connect(state_dir / DB_NAME) as db:
                stored = {
                    json.loads(body)["attributes"]["pci_bus_id"]
                    for (body,) in db.execute("SELECT body FROM events WHERE kind='xid'")
                }
            assert old | new <= stored
        finally:
            if sub is not None:
                sub.stop()
            agent_process.stop()
            broker.stop()
