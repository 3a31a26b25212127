"""A state database that cannot be opened because something other than a file is where one of
its files should be: the problem names that path and what is there.

SQLite says only "unable to open database file", "disk I/O error" or "attempt to write a
readonly database" for all of these, which names neither the file nor the fault; the operator
was told to make the directory writable, which it was. The store still falls back to memory
and keeps working.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.contracts.model import Event, Severity
from agent.runtime.state import DB_NAME, StateStore


def directory(path: Path) -> None:
    path.mkdir()


def dangling_link(path: Path) -> None:
    path.symlink_to(path.parent / "nowhere" / "state.db")


def device(path: Path) -> None:
    path.symlink_to("/dev/null")


def fifo(path: Path) -> None:
    os.mkfifo(path)


SHAPES: list[tuple[str, Callable[[Path], None], str]] = [
    ("", directory, "is a directory"),
    ("-wal", directory, "is a directory"),
    ("-shm", directory, "is a directory"),
    ("", dangling_link, "is a symbolic link to"),
    ("", device, "is a character device"),
    ("-wal", fifo, "is a FIFO"),
]


@pytest.mark.parametrize(
    ("suffix", "make", "said"), SHAPES, ids=[f"{s or 'db'} {m.__name__}" for s, m, _ in SHAPES]
)
def test_the_problem_names_the_path_and_what_is_there(
    tmp_path: Path, suffix: str, make: Callable[[Path], None], said: str
) -> None:
    if suffix:  # a database that was made and closed, then something odd beside it
        StateStore.open(tmp_path).close()
    odd = Path(f"{tmp_path / DB_NAME}{suffix}")
    make(odd)
    store = StateStore.open(tmp_path)
    assert not store.durable
    [problem] = store.problems
    assert problem.kind == "state_store_unwritable"
    assert f"{odd} {said}" in problem.message, problem.message
    assert str(odd) in problem.action
    store.record_event(
        Event(source="t", kind="k", severity=Severity.INFO, message="kept"), outbox=True
    )
    assert store.outbox_depth() == {"event": 1}
