"""A pause lasts what was asked for, whatever the wall clock does meanwhile.

`gpuwarden pause --for 30m` ends by itself at its deadline, kept as a wall-clock time (it
outlives a restart). A step of the wall clock back (a clock that was ahead, corrected) made the
deadline that much later: a year back kept the GPUs unwatched, and every alert on them
silenced, for a year. Now a step moves the pause's times with it, as they are reported and
kept, so the pause ends after the time asked for.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from agent.runtime.pause import KEY, NAMESPACE
from tests.support.clock import WallClock
from tests.support.nvml import fake_gpus
from tests.support.nvml_fake import FakeNvml
from tests.support.waiting import until
from tests.test_pause_runtime import events, make_runtime, names, stop


@pytest.mark.parametrize("step", [-3600.0, -86400.0 * 365])
async def test_a_step_back_does_not_stretch_a_pause(
    step: float, wall: WallClock, tmp_path: Path
) -> None:
    runtime = make_runtime(FakeNvml(fake_gpus(1)), tmp_path / "state")
    await runtime.start()
    try:
        await until(lambda: "gpuwarden_gpu_up" in names(runtime), what="GPU series")
        await runtime.pause.pause(1.5, "reset GPU 0")
        wall.offset += step
        await until(lambda: bool(events(runtime, "gpu_resumed")), timeout=15.0, what="the deadline")
        (resumed,) = events(runtime, "gpu_resumed")
        assert resumed.attributes["why"] == "deadline"
        assert runtime.pause_state() is None
    finally:
        await stop(runtime)


async def test_a_step_moves_the_deadline_as_reported_and_kept(
    wall: WallClock, tmp_path: Path
) -> None:
    runtime = make_runtime(FakeNvml(fake_gpus(1)), tmp_path / "state")
    await runtime.start()
    try:
        await until(lambda: "gpuwarden_gpu_up" in names(runtime), what="GPU series")
        await runtime.pause.pause(1.5, "reset GPU 0")
        state = runtime.pause_state()
        assert state is not None
        left = state.until - time.time()
        wall.offset += 7200.0
        await until(
            lambda: (s := runtime.pause_state()) is not None and s.until > time.time(),
            timeout=5.0,
            what="the deadline moved with the clock",
        )
        moved = runtime.pause_state()
        assert moved is not None
        assert abs((moved.until - time.time()) - left) < 1.5
        assert abs((moved.since - state.since) - 7200.0) < 1.0
        kept = runtime.store.get(NAMESPACE, KEY)
        assert isinstance(kept, dict) and kept["until"] == moved.until
        await until(lambda: bool(events(runtime, "gpu_resumed")), timeout=15.0, what="the end")
    finally:
        await stop(runtime)
