"""A state dir that starts to hang after the agent started never holds the loop up through the
control socket's keeping.

The control socket's file is looked at every CHECK_INTERVAL seconds (is it still ours?) and
bound again where it is gone. A state dir on a file server that stops answering (NFS, FUSE)
after the store's probe at start answered would leave such an lstat, bind or unlink hung in
the kernel: on the loop, that would stop heartbeats, /metrics and every collector, and the
node would read as dead. What must hold: while the state dir hangs, the loop runs on, the
look is given up after LOOK_TIMEOUT and said in health, no second look piles up behind the
hung one, and a stop returns at once. The hang is a file-system call of the control module
that blocks until the test lets it go (the real FUSE hang is in test_state_hung_at_start.py,
for the start); the loop's ticks are counted while it blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.program.control import LOOK_TIMEOUT, ControlServer
from agent.program.control_client import socket_path
from tests.support.control import started_runtime

REAL_LSTAT = os.lstat


@dataclasses.dataclass
class Hang:
    """Makes the control module's lstat of the socket (or its directory) block while set."""

    gate: threading.Event = dataclasses.field(default_factory=threading.Event)
    hanging: bool = False
    entered: int = 0

    def lstat(self, path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if self.hanging:
            self.entered += 1
            self.gate.wait(30.0)
        return REAL_LSTAT(path, *args, **kwargs)


@pytest.fixture
async def hung(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[ControlServer, Hang]]:
    """The socket bound, its lstat in the control module's hands (`Hang`)."""
    async with started_runtime(tmp_path / "state") as runtime:
        server = ControlServer(runtime, socket_path(tmp_path / "state"))
        hang = Hang()
        monkeypatch.setattr(os, "lstat", hang.lstat)
        await server.start()
        yield server, hang


def problem(server: ControlServer) -> str | None:
    """What health says of the socket now (a call: no narrowing across the awaits)."""
    return server.problem


async def ticks_while(work: asyncio.Future[Any], every: float = 0.05) -> int:
    """How often the loop ran a 50 ms timer while `work` was not done."""
    count = 0
    while not work.done():
        await asyncio.sleep(every)
        count += 1
    return count


async def test_a_look_that_hangs_holds_no_loop_and_is_said(
    hung: tuple[ControlServer, Hang],
) -> None:
    server, hang = hung
    assert problem(server) is None
    hang.hanging = True
    began = time.monotonic()
    check = asyncio.ensure_future(server.check())
    ticks = await ticks_while(check)
    took = time.monotonic() - began
    assert hang.entered == 1
    # The loop ran throughout: a 50 ms timer fired about as often as the look took.
    assert ticks >= int(took / 0.05) // 2 >= 1, (ticks, took)
    assert took < LOOK_TIMEOUT * 3
    assert "did not answer" in (problem(server) or "")
    # A second look while the first is stuck starts no second thread there.
    await server.check()
    assert hang.entered == 1
    assert "did not answer" in (problem(server) or "")
    began = time.monotonic()
    await server.stop()
    assert time.monotonic() - began < LOOK_TIMEOUT, "the stop waited for the hung look"
    hang.gate.set()


async def test_the_look_comes_back_once_the_state_dir_answers(
    hung: tuple[ControlServer, Hang],
) -> None:
    server, hang = hung
    hang.hanging = True
    await server.check()
    assert problem(server) is not None
    hang.hanging = False
    hang.gate.set()
    for _ in range(100):  # the hung look returns; the next one is the socket's again
        await asyncio.sleep(0.05)
        await server.check()
        if problem(server) is None:
            break
    assert problem(server) is None
    assert os.path.exists(server.path)
    await server.stop()
    assert not os.path.exists(server.path)
