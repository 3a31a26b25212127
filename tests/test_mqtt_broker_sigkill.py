"""A broker killed (SIGKILL) while the agent drains a long outbox: every entry the broker had
not acknowledged is published again to the broker that comes back.

A real mosquitto with 1,500 events queued behind a publish window; it is SIGKILLed with
publishes in flight, then more are queued and it is killed again, four times. At each kill the store
is held (as a stalled disk would hold it) once the agent has seen the connection go and taken
in the PUBACKs that came before, and the entries still in the outbox then are the ones the
agent never had a PUBACK for (an entry leaves the outbox only after its PUBACK): each of them
must reach a subscriber of the broker that comes back, which is subscribed before the store
is let go. What the dead broker acknowledged and did not
pass on is the broker's loss, not the agent's, and is not asked for.
"""

from __future__ import annotations

import asyncio
import random
import signal
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.contracts.model import Event, Severity
from agent.runtime.core import Runtime
from agent.runtime.state import StateStore
from tests.support.mosquitto import Broker
from tests.support.mqtt import InProcessAgent, Subscriber
from tests.support.waiting import until

EVENTS = 1500
KILLS = 4


@pytest.fixture
async def agent(tmp_path: Path, broker: Broker) -> AsyncIterator[InProcessAgent]:
    instance = InProcessAgent(tmp_path / "state", {"url": broker.url, "publish_window": 64})
    yield instance
    await instance.stop()


def kill(broker: Broker) -> None:
    assert broker.process is not None
    broker.process.send_signal(signal.SIGKILL)
    broker.process.wait(5)
    broker.process = None


class StalledStore(threading.Thread):
    """Holds the store's lock (a disk that stalls: nothing is acked or dropped meanwhile),
    having read the event entries still in the outbox."""

    def __init__(self, store: StateStore) -> None:
        super().__init__(daemon=True)
        self.store = store
        self.waiting: set[str] = set()
        self.held = threading.Event()
        self.go_on = threading.Event()

    def run(self) -> None:
        with self.store._lock:
            rows = self.store._conn.execute("SELECT key FROM outbox WHERE kind='event'")
            self.waiting = {str(key) for (key,) in rows.fetchall()}
            self.held.set()
            self.go_on.wait(30)


def queue_events(runtime: Runtime, life: int) -> None:
    for i in range(EVENTS):  # a long outbox to drain
        runtime.emit(
            Event(
                source="test",
                kind="probe",
                severity=Severity.INFO,
                message=f"event {i} of life {life}",
            )
        )


async def sent_some(sub: Subscriber, count: int) -> None:
    target = len(sub.event_ids()) + count
    await until(lambda: len(sub.event_ids()) >= target, timeout=60, what="some sent")


async def published_again(sub: Subscriber, waiting: set[str]) -> None:
    await until(
        lambda: waiting <= set(sub.event_ids()),
        timeout=60,
        what=f"{len(waiting)} unacknowledged entries published again",
    )


async def test_unacknowledged_entries_reach_the_broker_that_comes_back(
    agent: InProcessAgent, broker: Broker
) -> None:
    runtime = await agent.start()
    sink = runtime.sinks["mqtt"]
    await until(lambda: sink.connected, what="connected")
    subs = [Subscriber(broker.port, topic_filter="gpuwarden/v1/+/events").start()]
    chance = random.Random(3)
    try:
        for life in range(KILLS):
            queue_events(runtime, life)
            await runtime.settle()
            await sent_some(subs[-1], chance.randint(50, 400))
            kill(broker)
            # The PUBACKs that came before the kill taken in (their entries deleted): what
            # is left in the outbox is what no broker acknowledged.
            await until(lambda: not sink.connected, what="the connection seen lost")
            await until(lambda: not sink._delivered_unacked, what="delivered entries deleted")
            stalled = StalledStore(runtime.store)
            stalled.start()
            await asyncio.to_thread(stalled.held.wait, 10)
            assert stalled.waiting  # killed with entries still to send
            subs[-1].stop()
            broker.start()
            subs.append(Subscriber(broker.port, topic_filter="gpuwarden/v1/+/events").start())
            stalled.go_on.set()
            await asyncio.to_thread(stalled.join, 10)
            await published_again(subs[-1], stalled.waiting)
        await until(lambda: not runtime.store.outbox_peek(1), timeout=60, what="the outbox empty")
    finally:
        for sub in subs:
            sub.stop()
