"""Fixtures shared by the test suite: real brokers and agent subprocesses on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.agent_proc import AgentProcess
from tests.support.deb import deb_packages  # noqa: F401 (a fixture: the .deb, built once)
from tests.support.disk import SmallDisk
from tests.support.mosquitto import Broker
from tests.support.stores import StateOnDisk


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    """A fresh mosquitto on a free loopback port, anonymous access allowed."""
    instance = Broker(tmp_path / "broker").start()
    yield instance
    instance.stop()


@pytest.fixture
def agent_process(tmp_path: Path) -> Iterator[AgentProcess]:
    """An agent subprocess (not started: set config_text, then call start())."""
    instance = AgentProcess(tmp_path / "agent")
    yield instance
    instance.stop()


@pytest.fixture
def state_on_disk(tmp_path: Path) -> Iterator[StateOnDisk]:
    """The runtime's collector state over a real store on a 4 MiB tmpfs (not yet full)."""
    with SmallDisk(tmp_path / "disk") as disk:
        state = StateOnDisk(disk)
        yield state
        state.store.close()
