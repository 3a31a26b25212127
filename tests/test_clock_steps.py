"""A step of the wall clock (NTP or timesyncd correcting a large offset, `date -s`, a virtual
machine resumed) is no event about the node: ages are measured on a clock that does not step.

Before, the runtime's staleness compared wall-clock stamps: a step forward made every collector
and sink read as stale at once (a false `collector_stale`, an unhealthy heartbeat, /healthz
503), and a step back hid a collector that stopped succeeding for as long as the step. The
wall clock here is time.time patched with an offset, which every module reads.
"""

from __future__ import annotations

import asyncio

import pytest

from agent.contracts.model import Severity
from agent.contracts.sink import SinkLedger
from tests.support.clock import WallClock
from tests.support.collectors import scripted_runtime
from tests.support.waiting import until

STEP = 3600.0


@pytest.mark.parametrize("step", [STEP, 86400.0 * 400])
async def test_a_step_forward_is_no_staleness(wall: WallClock, step: float) -> None:
    runtime, _ = scripted_runtime({"good": "ok"}, interval=0.1, timeout=0.1)
    await runtime.start()
    try:
        await until(lambda: runtime.collectors["good"].success is True, what="a round")
        wall.offset += step
        assert runtime.health().ok, runtime.health().problems
        assert not runtime.stale_items()
        await asyncio.sleep(1.0)  # several rounds and health checks after the step
        assert not [e for e in runtime.recent_events if e.kind == "collector_stale"]
        assert runtime.health().ok
    finally:
        await runtime.stop()


@pytest.mark.parametrize("step", [STEP, 86400.0 * 400])
async def test_a_step_back_hides_no_staleness(wall: WallClock, step: float) -> None:
    """A collector that never succeeds is stale after its limit (3 intervals and its timeout,
    0.4 s here), not after the limit and the step."""
    runtime, _ = scripted_runtime({"good": "ok", "bad": "raise"}, interval=0.1, timeout=0.1)
    await runtime.start()
    try:
        wall.offset -= step
        await until(
            lambda: any(i.name == "bad" for i in runtime.stale_items()),
            timeout=5.0,
            what="the failing collector stale",
        )
        (item,) = runtime.stale_items()
        assert item.seconds < 60.0
        assert not any(i.name == "good" for i in runtime.stale_items())
    finally:
        await runtime.stop()


@pytest.mark.parametrize("step", [STEP, -STEP])
async def test_a_step_keeps_the_ages_of_a_delivery(wall: WallClock, step: float) -> None:
    """A sink's last delivery, stepped over: its age goes on from where it was, and the
    wall-clock stamp reported stays the one it was made at."""
    runtime, _ = scripted_runtime({"good": "ok"}, interval=0.1, timeout=0.1)
    entry = runtime.ledger.setdefault("mqtt", SinkLedger())
    runtime.record_delivery("mqtt")
    stamped = entry.last_delivery
    assert stamped is not None
    wall.offset += step
    assert entry.last_delivery == stamped
    age = entry.delivery_age()
    assert age is not None and 0.0 <= age < 60.0


async def test_a_step_is_told_once(wall: WallClock) -> None:
    """The store's move of its stamps is one clock_stepped event (info), not a page."""
    runtime, _ = scripted_runtime({"good": "write"}, interval=0.1, timeout=0.1)
    await runtime.start()
    try:
        await until(lambda: runtime.collectors["good"].success is True, what="a round")
        wall.offset += STEP
        await until(
            lambda: any(e.kind == "clock_stepped" for e in runtime.recent_events),
            timeout=10.0,
            what="the step told",
        )
        await asyncio.sleep(0.5)
        (told,) = [e for e in runtime.recent_events if e.kind == "clock_stepped"]
        seconds = told.attributes["seconds"]
        assert isinstance(seconds, float) and abs(seconds - STEP) < 1.0
        assert told.severity is Severity.INFO
        assert runtime.health().ok
    finally:
        await runtime.stop()
