"""The MQTT sink survives a failing state store (locked db, full disk): it records the failure,
backs off, and delivers again once the store works."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from agent.contracts.errors import StateStoreError
from agent.contracts.model import Event, Severity
from agent.runtime.state import StateStore
from tests.support.mosquitto import Broker
from tests.support.mqtt import InProcessAgent, Subscriber
from tests.support.waiting import until


def fail_once(
    original: Callable[..., Any], when: Callable[..., bool] = lambda *_a, **_k: True
) -> Callable[..., Any]:
    """`original`, except that its first call matching `when` raises StateStoreError."""
    failed = False

    def flaky(*args: Any, **kwargs: Any) -> Any:
        nonlocal failed
        if not failed and when(*args, **kwargs):
            failed = True
            raise StateStoreError("state store read failed: database is locked")
        return original(*args, **kwargs)

    return flaky


@pytest.fixture
async def subscribed(broker: Broker) -> AsyncIterator[Subscriber]:
    sub = Subscriber(broker.port).start()
    yield sub
    sub.stop()


@pytest.fixture
async def agent(tmp_path: Path, broker: Broker) -> AsyncIterator[InProcessAgent]:
    instance = InProcessAgent(tmp_path / "state", {"url": broker.url})
    yield instance
    await instance.stop()


async def delivers_event(agent: InProcessAgent, sub: Subscriber, tag: str) -> None:
    event = Event(source="test", kind="probe", severity=Severity.INFO, message=tag)
    agent.runtime.emit(event)
    await until(lambda: event.id in sub.event_ids(), what=f"event {tag} delivered")


def assert_survived(runtime: Any) -> None:
    assert not runtime._sink_tasks["mqtt"].done()
    entry = runtime.ledger["mqtt"]
    assert entry.failures >= 1
    assert entry.last_failure is not None and "state_store" in entry.last_failure


class TestStoreFailure:
    """One failing store call does not end MQTT delivery for good."""

    @pytest.mark.parametrize("method", ["peek", "ack"])
    async def test_outbox_fails_once_while_draining(
        self,
        agent: InProcessAgent,
        subscribed: Subscriber,
        method: str,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """outbox.peek / outbox.ack raising once: a new connection delivers what follows."""
        runtime = await agent.start()
        sink = runtime.sinks["mqtt"]
        await until(lambda: sink.connected, what="connected")
        await delivers_event(agent, subscribed, "before")
        monkeypatch.setattr(sink.outbox, method, fail_once(getattr(sink.outbox, method)))
        await until(lambda: runtime.ledger["mqtt"].failures >= 1, what="the store failure")
        await delivers_event(agent, subscribed, "after")
        assert_survived(runtime)

    async def test_birth_number_read_fails_once(
        self, agent: InProcessAgent, subscribed: Subscriber, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Reading the stored birth number raising once: the sink connects on the retry."""
        monkeypatch.setattr(
            StateStore,
            "get",
            fail_once(
                StateStore.get, lambda _store, namespace, key: (namespace, key) == ("mqtt", "bdseq")
            ),
        )
        runtime = await agent.start()
        await delivers_event(agent, subscribed, "after")
        assert runtime.sinks["mqtt"].connected
        assert_survived(runtime)

    async def test_producer_survives_a_store_failure(
        self, agent: InProcessAgent, subscribed: Subscriber, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The producer's store access (queueing a metric snapshot) raising once: it goes
        on producing heartbeats, which never wait for the store."""
        runtime = await agent.start()
        sink = runtime.sinks["mqtt"]
        await until(lambda: sink.connected, what="connected")
        monkeypatch.setattr(sink, "_queue", fail_once(sink._queue))
        await until(lambda: runtime.ledger["mqtt"].failures >= 1, what="the store failure")
        seen = len(subscribed.on("/heartbeat"))
        await until(lambda: len(subscribed.on("/heartbeat")) > seen + 1, what="heartbeats")
        assert_survived(runtime)


def always_fails(*_args: Any, **_kwargs: Any) -> Any:
    raise StateStoreError("state store write failed: database or disk is full")


class TestStoreThatCannotWrite:
    """Heartbeats never depend on the state store (issue 13): with every write the sink
    makes refused, the node goes on beating on one connection."""

    async def test_heartbeats_go_on_and_delivered_entries_are_not_resent(
        self, agent: InProcessAgent, subscribed: Subscriber, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """outbox put and ack refused (a full disk): heartbeats keep coming with the same
        birth number (the connection was never dropped), and an event delivered while the
        store cannot delete it is delivered once, not again on every pass."""
        runtime = await agent.start()
        sink = runtime.sinks["mqtt"]
        await until(lambda: sink.connected, what="connected")
        bdseq = sink.bdseq
        monkeypatch.setattr(sink.outbox, "put", always_fails)
        monkeypatch.setattr(sink.outbox, "ack", always_fails)
        event = Event(source="test", kind="probe", severity=Severity.INFO, message="full")
        runtime.emit(event)
        await until(lambda: event.id in subscribed.event_ids(), what="the event delivered")
        seen = len(subscribed.on("/heartbeat"))
        await until(lambda: len(subscribed.on("/heartbeat")) >= seen + 4, what="heartbeats")
        assert subscribed.event_ids().count(event.id) == 1
        beats = [m.json() for m in subscribed.on("/heartbeat")[seen:]]
        assert {b["bdseq"] for b in beats} == {bdseq}
        assert sink.connected and sink.bdseq == bdseq
        monkeypatch.undo()
        await until(lambda: not runtime.store.outbox_peek(10), what="the outbox emptied")
