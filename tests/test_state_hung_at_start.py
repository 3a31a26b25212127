"""Opening the state store has a deadline: a state dir that hangs does not hold the agent.

A state dir on a mount that hangs (an NFS server gone, a FUSE daemon that never answers) used
to block the agent's start for good: no heartbeat, no metrics, the node looked dead. What must
hold instead: past `state_open_timeout` the agent runs on memory with a `state_store_hung`
problem that names the state dir and says what to do, tries the disk again as a store that
started in memory does, and the open stuck in the kernel, once it returns, never becomes the
store or writes into it: what it opened is closed. The mount is asked first by a child
process (a probe), so that no thread of the agent waits there and a stop is not held up.

The real thing: the agent with its state dir on a FUSE mount whose look-ups never answer, in a
private mount namespace (tests/support/fuse_hang.py). The other shapes (a late open that
succeeds, a hang in a later attempt) need a hang that ends on cue: a gate around the open.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import signal
import sqlite3
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.contracts.model import Event, Severity
from agent.runtime.state import DB_NAME, StateStore
from tests.support.agent_proc import AgentProcess, http_get
from tests.support.waiting import wait_until
from tests.support.watch import metric_value
from tests.test_disk_hung_mount import (
    STOP_BUDGET,
    agent_config,
    fuse_usable,
    hang_launcher,
    kill_daemon,
    process_state,
)

DEADLINE = 0.3
"""The open's deadline here (seconds)."""
BOUND = 20.0
"""Seconds the gate holds at most: a hang guard."""


def event(n: int) -> Event:
    return Event(source="test", kind="probe", severity=Severity.WARNING, message=f"probe {n}")


def in_use_on_disk(store: StateStore) -> bool:
    """`store.durable`, read anew (it changes under the test: mypy must not narrow it)."""
    return store.durable


class Gate:
    """Every open of the database on the disk waits here until `release()`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._open = threading.Event()
        self.opened: list[StateStore] = []
        self.waiting = 0
        real = StateStore._open_on_disk.__func__  # type: ignore[attr-defined]

        def gated(cls: type[StateStore], state_dir: Path, problems: list[object]) -> StateStore:
            self.waiting += 1
            assert self._open.wait(BOUND), "the gate was never released"
            store: StateStore = real(cls, state_dir, problems)
            self.opened.append(store)
            return store

        monkeypatch.setattr(StateStore, "_open_on_disk", classmethod(gated))

    def release(self) -> None:
        self._open.set()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Gate:
    return Gate(monkeypatch)


def outbox_on_disk(state_dir: Path) -> list[str]:
    with contextlib.closing(sqlite3.connect(state_dir / DB_NAME)) as db:
        return [k for (k,) in db.execute("SELECT key FROM outbox ORDER BY seq")]


def closed(store: StateStore) -> bool:
    try:
        store._conn.execute("SELECT 1")
    except sqlite3.ProgrammingError:
        return True
    return False


def stuck_done(store: StateStore) -> bool:
    attempt = store._attempt
    return attempt is not None and not attempt.running


class TestDeadline:
    def test_a_hung_open_leaves_the_store_in_memory_and_is_never_used(
        self, tmp_path: Path, gate: Gate
    ) -> None:
        state_dir = tmp_path / "state"
        store = StateStore.open_within(state_dir, DEADLINE)
        try:
            assert not in_use_on_disk(store)
            [problem] = store.problems
            assert problem.kind == "state_store_hung"
            assert str(state_dir) in problem.message and "hangs" in problem.message
            assert str(state_dir) in problem.action
            first = event(1)
            store.record_event(first, outbox=True)
            assert store.disk_attempt() is None  # one thread waits on the mount at most
            # The mount answers: the open that hung finishes, and is thrown away.
            gate.release()
            wait_until(lambda: stuck_done(store), timeout=BOUND, what="the stuck open ends")
            [late] = gate.opened
            assert closed(late)
            assert not in_use_on_disk(store)
            second = event(2)
            store.record_event(second, outbox=True)
            assert outbox_on_disk(state_dir) == []  # nothing of memory's went there
            # The next attempt opens the disk and moves what memory holds.
            attempt = store.disk_attempt()
            assert attempt is not None
            store.adopt(attempt.future.result(BOUND))
            assert in_use_on_disk(store) and store.problems == []
        finally:
            store.close()
        assert outbox_on_disk(state_dir) == [first.id, second.id]

    def test_an_open_that_hangs_and_then_fails_leaves_nothing_open(
        self, tmp_path: Path, gate: Gate
    ) -> None:
        state_dir = tmp_path / "file"
        state_dir.write_text("not a directory")  # the open fails once it gets there
        store = StateStore.open_within(state_dir, DEADLINE)
        try:
            assert [p.kind for p in store.problems] == ["state_store_hung"]
            gate.release()
            wait_until(lambda: stuck_done(store), timeout=BOUND, what="the stuck open ends")
            assert gate.opened == []
            assert not in_use_on_disk(store)
        finally:
            store.close()

    def test_a_retry_that_hangs_is_abandoned_and_said(self, tmp_path: Path, gate: Gate) -> None:
        state_dir = tmp_path / "state"
        store = StateStore.in_memory(state_dir=state_dir)  # unusable at start, say
        try:
            store.record_event(event(1), outbox=True)
            attempt = store.disk_attempt()
            assert attempt is not None
            with pytest.raises(concurrent.futures.TimeoutError):
                attempt.future.result(DEADLINE)
            attempt.abandon()
            store.note_hung(DEADLINE)
            assert [p.kind for p in store.problems] == ["state_store_hung"]
            assert store.disk_attempt() is None
            gate.release()
            wait_until(lambda: not attempt.running, timeout=BOUND, what="the stuck open ends")
            [late] = gate.opened
            assert closed(late) and not in_use_on_disk(store)
            again = store.disk_attempt()
            assert again is not None
            store.adopt(again.future.result(BOUND))
            assert in_use_on_disk(store) and store.problems == []
        finally:
            store.close()

    def test_an_open_within_the_deadline_is_the_store(self, tmp_path: Path) -> None:
        store = StateStore.open_within(tmp_path / "state", 30.0)
        try:
            assert in_use_on_disk(store) and store.problems == []
        finally:
            store.close()


# -- the real agent on a mount that hangs -------------------------------------------------------


@pytest.fixture
def hung_state_dir(agent_process: AgentProcess, tmp_path: Path) -> Iterator[Path]:
    """The agent's state dir is a FUSE mount whose look-ups never answer; its daemon is
    SIGKILLed at the end whatever happened (that ends every wait on it)."""
    reason = fuse_usable()
    if reason:
        pytest.skip(reason)
    mountpoint = agent_process.workdir / "state"
    mountpoint.mkdir(parents=True)
    state = tmp_path / "fuse-state"
    agent_process.prefix = hang_launcher(mountpoint, state, "--lookups")
    yield state
    kill_daemon(state)


@pytest.mark.slow
def test_the_real_agent_serves_says_the_state_dir_hangs_and_stops_at_once(
    agent_process: AgentProcess, hung_state_dir: Path
) -> None:
    """No thread of the agent waits on the mount (a probe child asks it first), so SIGTERM
    ends the agent within the stop budget while the mount still hangs."""
    agent_process.core_text = "state_open_timeout = 1.0\nstate_retry_interval = 1.0\n"
    agent_process.config_text = agent_config(Path("/"))
    agent_process.start(timeout=30)  # /metrics served: the start went on without the disk
    _, body = http_get(agent_process.metrics_url)
    assert metric_value(body, "gpuwarden_state_store_durable") == 0
    status, health = http_get(agent_process.metrics_url.replace("/metrics", "/healthz"))
    assert status != 200 and "hangs" in health, health
    # Its control socket would be in that state dir: said, and nothing there touched (a
    # look at the socket file would hang the loop, and the stop below with it).
    wait_until(
        lambda: any(
            line.startswith(f"control socket {agent_process.workdir / 'state'}")
            and "the state dir hangs" in line
            for line in http_get(agent_process.metrics_url.replace("/metrics", "/healthz"))[
                1
            ].splitlines()
        ),
        timeout=20,
        what="the control socket's problem",
    )
    assert hung_state_dir.read_text()  # it did ask the mount (a statfs or a look-up)
    wait_until(
        lambda: "the last attempt to open the state store is still stuck" in agent_process.log(),
        timeout=20,
        what="a retry that waits for the stuck one",
    )
    # One asker waits on the mount, however many retries came.
    assert len(hung_state_dir.read_text().splitlines()) == 1
    _, body = http_get(agent_process.metrics_url)  # still serving
    assert metric_value(body, "gpuwarden_state_store_durable") == 0
    process = agent_process.process
    assert process is not None
    process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(STOP_BUDGET)
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"the agent did not exit within {STOP_BUDGET} s of SIGTERM (its threads: "
            f"{sorted(process_state(int(t.name)) for t in Path(f'/proc/{process.pid}/task').iterdir())})"
        )
    agent_process.process = None
    assert code == 0, agent_process.log()[-3000:]
    assert process_state(process.pid) == ""  # reaped: nothing of it waits on the mount
