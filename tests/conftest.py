"""Fixtures shared by the test suite: real brokers and agent subprocesses on loopback."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tests.support.agent_proc import AgentProcess
from tests.support.alertmanager import webhook  # noqa: F401 (a fixture: a started receiver)
from tests.support.clock import WallClock
from tests.support.deb import deb_packages  # noqa: F401 (a fixture: the .deb, built once)
from tests.support.disk import SmallDisk
from tests.support.mosquitto import Broker
from tests.support.stores import StateOnDisk, slow_store

# Property tests judge what the code returns, never how fast: on a fresh clone the first draw
# of text builds Hypothesis's character tables (1.8 s here, and a too_slow health check failed
# CI once), and a loaded 2-core machine stretches any example past the 200 ms deadline. The
# timing that matters is measured in bench/, and in tests by CPU time with its own bound.
settings.register_profile("gpuwarden", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("gpuwarden")


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


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow-store",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="delay every state-store flush by SECONDS: a stalling disk or a loaded machine, "
        "under which a test that reads events before they are announced fails every time",
    )


@pytest.fixture(autouse=True)
def _slow_store(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    delay = float(request.config.getoption("--slow-store"))
    if delay > 0:
        slow_store(monkeypatch, delay)


@pytest.fixture
def wall(monkeypatch: pytest.MonkeyPatch) -> WallClock:
    """The wall clock stepped by the test (tests/support/clock.py)."""
    clock = WallClock(time.time)
    monkeypatch.setattr(time, "time", clock)
    return clock
