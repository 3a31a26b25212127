"""One policy for a state store that cannot write, on a real full disk (a small tmpfs):
nothing is lost up to the memory bound, past it every drop is counted, the failure is one
health problem and one event, cleared by the first write that works, and no round fails."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.contracts.model import Event, Severity
from agent.program import registry
from agent.runtime.core import Runtime
from agent.runtime.state import StateStore
from tests.support.collectors import scripted_runtime
from tests.support.disk import SmallDisk
from tests.support.mosquitto import Broker
from tests.support.mqtt import InProcessAgent, Subscriber
from tests.support.waiting import until

NO_COLLECTORS = {"collectors": {name: {"enabled": False} for name in registry.COLLECTORS}}


def xid_event(i: int) -> Event:
    return Event(
        source="kernel_log",
        kind="xid",
        severity=Severity.CRITICAL,
        subject="GPU-5b3c1d2e",
        message=f"GPU 0000:3b:00.0 reported Xid 79 (fallen off the bus), record {i}",
        action="drain the node and reset the GPU",
        attributes={"xid": 79, "record": i},
    )


def sample_values(runtime: Runtime, name: str) -> dict[tuple[str, ...], float]:
    return {s.label_values: s.value for s in runtime.samples() if s.family.name == name}


def stored_ids(store: StateStore) -> set[str]:
    return {e.id for e in store.recent_events(limit=100_000)}


def kinds(runtime: Runtime, kind: str) -> list[Event]:
    return [e for e in runtime.recent_events if e.kind == kind]


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[SmallDisk]:
    with SmallDisk(tmp_path / "disk") as mounted:
        yield mounted


@pytest.fixture
async def runtime_on_disk(disk: SmallDisk) -> AsyncIterator[Runtime]:
    store = StateStore.open(disk.path / "state")
    assert store.durable
    runtime, _ = scripted_runtime({}, store=store)
    await runtime.start()
    yield runtime
    await runtime.stop()
    store.close()


class TestEventsWaitForRoom:
    """Events raised while the disk is full are stored and delivered once it has room."""

    async def test_xids_raised_on_a_full_disk_all_arrive(
        self, disk: SmallDisk, broker: Broker
    ) -> None:
        """90 Xid events in bursts while the state disk is full, then space comes back:
        all 90 are in the event history and delivered over MQTT, none lost."""
        agent = InProcessAgent(disk.path / "state", {"url": broker.url}, extra=NO_COLLECTORS)
        sub = Subscriber(broker.port).start()
        try:
            runtime = await agent.start()
            await until(lambda: runtime.sinks["mqtt"].connected, what="connected")
            disk.fill(runtime.store)
            raised: list[str] = []
            for burst in range(9):
                for i in range(10):
                    event = xid_event(burst * 10 + i)
                    runtime.emit(event)
                    raised.append(event.id)
                await asyncio.sleep(0.1)
            assert runtime.store.write_failures > 0  # the disk really refused them
            disk.free()
            await until(
                lambda: set(raised) <= set(sub.event_ids()),
                timeout=30,
                what="every Xid delivered",
            )
            assert set(raised) <= stored_ids(runtime.store)
        finally:
            sub.stop()
            await agent.stop()

    async def test_past_the_bound_the_oldest_go_and_are_counted(
        self, disk: SmallDisk, runtime_on_disk: Runtime
    ) -> None:
        """A memory bound of 50 and 60 events on a full disk: the oldest are dropped, each
        counted; the health says so; once there is room the rest are stored, and so is one
        events_dropped event with the count."""
        runtime = runtime_on_disk
        runtime.guard.max_events = 50
        disk.fill(runtime.store)
        raised = [xid_event(i) for i in range(60)]
        for event in raised:
            runtime.emit(event)
        await until(lambda: runtime.store.write_failures > 0, what="a refused write")
        dropped = sample_values(runtime, "gpuwarden_events_dropped_total")
        lost = dropped[("store_queue_full",)]
        assert lost >= 10
        assert any(f"{lost:.0f} events dropped" in p for p in runtime.health().problems)
        disk.free()
        await until(lambda: bool(kinds(runtime, "events_dropped")), what="the drop reported")
        await until(lambda: runtime.guard.queued_events == 0, what="the queue written")
        stored = stored_ids(runtime.store)
        kept = [e.id for e in raised if e.id in stored]
        assert kept == [e.id for e in raised[int(lost) :]]  # the newest, in order
        [report] = kinds(runtime, "events_dropped")
        assert report.id in stored
        assert report.attributes["dropped"] == lost
        assert sample_values(runtime, "gpuwarden_events_dropped_total") == dropped
        assert runtime.health().ok


class TestOneProblemClearedAtOnce:
    """The failure is one problem and one event, gone with the first write that works."""

    async def test_health_event_and_gauge(self, disk: SmallDisk, runtime_on_disk: Runtime) -> None:
        runtime = runtime_on_disk
        disk.fill(runtime.store)
        first = xid_event(1)
        runtime.emit(first)
        await until(lambda: not runtime.health().ok, what="the problem")
        [problem] = runtime.health().problems
        assert "state store cannot write" in problem and "full" in problem
        assert sample_values(runtime, "gpuwarden_state_store_write_failing") == {(): 1}
        for i in range(2, 6):  # more events, more refused retries: still one problem
            runtime.emit(xid_event(i))
            await asyncio.sleep(0.3)
        assert len(kinds(runtime, "state_store_write_failing")) == 1
        assert len(runtime.health().problems) == 1
        disk.free()
        await until(lambda: runtime.health().ok, timeout=5, what="the problem cleared")
        assert sample_values(runtime, "gpuwarden_state_store_write_failing") == {(): 0}
        await until(lambda: bool(kinds(runtime, "state_store_write_recovered")), what="recovery")
        assert len(kinds(runtime, "state_store_write_failing")) == 1
        ids = stored_ids(runtime.store)
        assert first.id in ids
        assert {e.id for e in kinds(runtime, "state_store_write_failing")} <= ids


class TestCollectorWrites:
    """A collector's write on a full disk costs it nothing: not the round, not the value."""

    async def test_rounds_succeed_and_the_value_is_stored_later(self, disk: SmallDisk) -> None:
        store = StateStore.open(disk.path / "state")
        runtime, made = scripted_runtime({"writer": "write"}, store=store)
        await runtime.start()
        try:
            await until(lambda: len(made["writer"].rounds) >= 1, what="a first round")
            disk.fill(store)
            seen = len(made["writer"].rounds)
            await until(lambda: len(made["writer"].rounds) >= seen + 3, what="three rounds")
            status: Any = runtime.collectors["writer"]
            assert status.failures == 0 and status.success and status.samples
            await until(lambda: store.write_failures > 0, what="a refused write")
            state = made["writer"].deps.state
            latest = state.get("test", "writer")
            assert isinstance(latest, int) and latest >= seen + 2  # read back at once
            disk.free()
            await until(
                lambda: (store.get("test", "writer") or 0) >= latest, what="the value stored"
            )
        finally:
            await runtime.stop()
            store.close()


class TestWriterSurvives:
    """A write that fails in an unforeseen way (a bug) does not end the writes for good."""

    async def test_an_unexpected_error_is_retried(self, monkeypatch: pytest.MonkeyPatch) -> None:
        store = StateStore.in_memory()
        runtime, _ = scripted_runtime({}, store=store)
        await runtime.start()
        try:
            original = store.write_batch
            calls: list[int] = []

            def broken_once(*args: Any, **kwargs: Any) -> None:
                calls.append(1)
                if len(calls) == 1:
                    raise RuntimeError("a bug in the write path")
                original(*args, **kwargs)

            monkeypatch.setattr(store, "write_batch", broken_once)
            event = xid_event(1)
            runtime.emit(event)
            await until(lambda: event.id in stored_ids(store), what="the event stored")
            assert len(calls) >= 2
            assert not runtime._writer_task.done()  # type: ignore[union-attr]
        finally:
            await runtime.stop()
