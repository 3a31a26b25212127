"""A step of the watcher host's wall clock is no news about the nodes.

The watcher measured silence on the wall clock: a step forward (NTP correcting a clock left
behind, a virtual machine resumed) made every node read as silent at once, a fleet_quiet or
node_stale page for nothing; a step back hid a node that stopped beating for as long as the
step. Now a step moves every time the fleet holds by as much (Fleet.shift), so ages go on
where they were, and what the watcher reports stays on the wall clock.

A real mosquitto, fake nodes in subprocesses (their own clocks), the watcher in this process
with time.time stepped.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator

import pytest

from agent.program.watch.fleet import AlertChange, Fleet
from agent.program.watch.service import Watcher
from tests.support.clock import WallClock
from tests.support.mosquitto import Broker
from tests.support.waiting import until
from tests.support.watch import FakeNode
from tests.test_watch_service import watch_settings

STEPS = [3600.0, -3600.0, 86400.0 * 400]


class Recording(Watcher):
    changes: list[AlertChange]

    def evaluate_once(self) -> list[AlertChange]:
        changes = super().evaluate_once()
        self.__dict__.setdefault("changes", []).extend(changes)
        return changes

    def raised(self) -> list[tuple[str, str]]:
        return [c.alert.key for c in self.__dict__.get("changes", []) if c.raised]


@pytest.fixture
async def started(
    broker: Broker, wall: WallClock
) -> AsyncIterator[tuple[Recording, list[FakeNode]]]:
    watcher = Recording(watch_settings(broker), inventory=["s0", "s1", "s2"])
    stop = asyncio.Event()
    task = asyncio.create_task(watcher.run(stop))
    nodes = [FakeNode(broker.port, f"s{i}", interval=0.3, keepalive=30).start() for i in range(3)]
    try:
        await until(lambda: watcher.fleet.connected, what="the watcher connected")
        await until(
            lambda: all(watcher.fleet.nodes[f"s{i}"].heartbeat_at is not None for i in range(3)),
            what="every node beating",
        )
        await asyncio.sleep(0.5)
        yield watcher, nodes
    finally:
        for node in nodes:
            node.stop()
        stop.set()
        await asyncio.wait_for(task, 10)


@pytest.mark.parametrize("step", STEPS)
async def test_a_step_is_no_silence(
    step: float, wall: WallClock, started: tuple[Recording, list[FakeNode]]
) -> None:
    watcher, _ = started
    assert watcher.raised() == []
    wall.offset += step
    await asyncio.sleep(2.0)  # k x interval is 0.9 s: any false silence would show
    assert watcher.raised() == []
    views = {v.node: v for v in watcher.fleet.views(time.time())}
    assert all(v.heartbeat_age is not None and v.heartbeat_age < 5 for v in views.values())


@pytest.mark.parametrize("step", STEPS)
async def test_a_step_hides_no_silence(
    step: float, wall: WallClock, started: tuple[Recording, list[FakeNode]]
) -> None:
    watcher, nodes = started
    wall.offset += step
    nodes[1].signal(signal.SIGSTOP)
    try:
        await until(lambda: ("node_stale", "s1") in watcher.raised(), timeout=10.0, what="s1 stale")
    finally:
        nodes[1].signal(signal.SIGCONT)
    (change,) = [c for c in watcher.changes if c.raised]
    # what is reported stays on the wall clock, as it reads after the step
    assert abs(change.alert.since - time.time()) < 10.0
    assert abs(change.at - time.time()) < 10.0


def _fleet() -> Fleet:
    """Two nodes seen at 1001 and 1002, evaluated until one (b) has gone stale."""
    fleet = Fleet(inventory=["a", "b", "c"], now=1000.0, default_interval=10.0)
    fleet.broker_connected(1000.0)
    for node, at in (("a", 1001.0), ("b", 1002.0)):
        topic = f"gpuwarden/v1/{node}"
        fleet.ingest(f"{topic}/status", b'{"state":"online","bdseq":1}', False, at)
        beat = b'{"seq":1,"ts":5.0,"interval_s":10,"health":"ok"}'
        fleet.ingest(f"{topic}/heartbeat", beat, False, at)
    for when in (1010.0, 1020.0):
        fleet.evaluate(when)
    beat = b'{"seq":2,"ts":6.0,"interval_s":10,"health":"ok"}'
    fleet.ingest("gpuwarden/v1/a/heartbeat", beat, False, 1025.0)
    for when in (1031.5, 1045.0):
        fleet.evaluate(when)
    return fleet


@pytest.mark.parametrize("delta", [-500.0, 7.25, 86400.0 * 400])
def test_shift_moves_every_time_the_fleet_holds(delta: float) -> None:
    """After a shift by the clock's step, the fleet reads every later moment as a fleet
    that never saw the step reads the same moment unstepped: same states, ages and alert
    changes; the alerts' times moved by the step."""
    shifted, plain = _fleet(), _fleet()
    assert plain.active, "the fixture has alerts to move"
    shifted.shift(delta)
    assert {k: a.since + delta for k, a in plain.active.items()} == {
        k: a.since for k, a in shifted.active.items()
    }
    for later in (1046.0, 1060.0, 1100.0, 1500.0, 1000.0 + 8 * 86400.0):
        ours = [(v.node, v.state, v.heartbeat_age) for v in shifted.views(later + delta)]
        theirs = [(v.node, v.state, v.heartbeat_age) for v in plain.views(later)]
        assert ours == theirs
        ours_changes = [
            (c.raised, c.alert.key, c.at - delta) for c in shifted.evaluate(later + delta)
        ]
        theirs_changes = [(c.raised, c.alert.key, c.at) for c in plain.evaluate(later)]
        assert ours_changes == theirs_changes
