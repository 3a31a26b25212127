"""The state directory and database are created owner-only, whatever the umask.

Outside systemd (whose unit sets UMask=0077 and StateDirectoryMode=0700) the agent inherits
the caller's umask; the database holds event history, process names and the outbox, so it
must not come out world-readable. Checked in process (os.umask for the duration) and with the
real agent run under umask 000.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.runtime.state import DB_NAME, StateStore
from tests.support.agent_proc import REPO
from tests.support.ports import free_port, wait_for_port
from tests.support.waiting import wait_until

DB_PARTS = ("", "-wal", "-shm")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def open_umask() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.usefixtures("open_umask")
class TestInProcess:
    @pytest.mark.parametrize("depth", [1, 3], ids=["dir", "dir-and-parents"])
    def test_new_state_dir_and_database(self, tmp_path: Path, depth: int) -> None:
        state_dir = tmp_path.joinpath(*[f"level{i}" for i in range(depth)])
        store = StateStore.open(state_dir)
        try:
            store.put("ns", "k", 1)  # the -wal and -shm files exist while the store is open
            assert store.durable
            assert mode(state_dir) == 0o700
            for parent in list(state_dir.parents)[: depth - 1]:
                assert mode(parent) & 0o022 == 0, f"{parent} writable by others"
            for suffix in DB_PARTS:
                part = state_dir / f"{DB_NAME}{suffix}"
                assert mode(part) == 0o600, part
        finally:
            store.close()

    def test_database_made_again_after_corruption(self, tmp_path: Path) -> None:
        (tmp_path / DB_NAME).write_bytes(b"not a database" * 100)
        (tmp_path / DB_NAME).chmod(0o644)
        store = StateStore.open(tmp_path)
        try:
            assert [p.kind for p in store.problems] == ["state_store_corrupt"]
            store.put("ns", "k", 1)
            for suffix in DB_PARTS:
                assert mode(tmp_path / f"{DB_NAME}{suffix}") == 0o600
        finally:
            store.close()

    def test_existing_directory_is_left_as_it_is(self, tmp_path: Path) -> None:
        """An existing directory's mode belongs to whoever made it (systemd's
        StateDirectoryMode=): it is not changed."""
        state_dir = tmp_path / "state"
        state_dir.mkdir(mode=0o750)
        state_dir.chmod(0o750)
        store = StateStore.open(state_dir)
        store.close()
        assert mode(state_dir) == 0o750
        assert mode(state_dir / DB_NAME) == 0o600


def test_agent_run_under_umask_000(tmp_path: Path) -> None:
    state_dir = tmp_path / "state" / "gpuwarden"
    config = tmp_path / "gpuwarden.toml"
    port = free_port()
    config.write_text(
        f'node_id = "n"\nstate_dir = "{state_dir}"\n'
        f'[prometheus]\nlisten = "127.0.0.1:{port}"\n'
        "[collectors.gpu]\nenabled = false\n[collectors.benchmark]\nenabled = false\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "agent", "run", "--config", str(config)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        umask=0,
    )
    try:
        parts = [state_dir / f"{DB_NAME}{suffix}" for suffix in DB_PARTS]
        wait_for_port(port)  # serving: past the store's opening, and SIGTERM is handled
        wait_until(lambda: all(p.exists() for p in parts), timeout=30, what="state db files")
        assert mode(state_dir) == 0o700
        assert mode(state_dir.parent) & 0o022 == 0
        assert {p.name: mode(p) for p in parts} == {p.name: 0o600 for p in parts}
    finally:
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=15)
    assert process.returncode == 0, err.decode()
