"""A broker's maximum packet size against the MQTT sink, on a real mosquitto (`max_packet_size`).

mosquitto 2 advertises its limit in the CONNACK (MQTT v5 Maximum Packet Size) and disconnects
a client that sends a larger packet ("disconnected due to oversize packet"). An outbox entry
larger than that was a poison message: sent at the head of every connection, it ended each one,
and everything queued behind it waited for ever while the reconnections went on. Each kind is
tested here: an event arrives cut down to fit (its id, kind, severity and repair action
intact; the whole event stays in the node's history), a metrics snapshot that cannot fit is
left out and said so, and a heartbeat too large arrives compact, still one the watcher reads.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiomqtt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.contracts.model import Event, RepairAction, Severity
from agent.program.watch.fleet import Alert, AlertChange
from agent.program.watch.payloads import Heartbeat, parse_heartbeat
from agent.program.watch.service import Watcher
from agent.program.watch.settings import WatchSettings
from exporters import mqtt_client
from exporters.heartbeat import EVENT_KEPT, MARK, compact_heartbeat, cut_event, encode
from exporters.mqtt_client import Publisher, connection
from tests.support.mosquitto import Broker
from tests.support.mqtt import InProcessAgent, Subscriber
from tests.support.waiting import until


@pytest.fixture
def broker_of(tmp_path: Path) -> Iterator[Callable[[int], Broker]]:
    made: list[Broker] = []

    def make(limit: int) -> Broker:
        broker = Broker(
            tmp_path / f"broker-{limit}", extra_config=[f"max_packet_size {limit}", "user root"]
        )
        made.append(broker.start())
        return broker

    yield make
    for broker in made:
        broker.stop()


@pytest.fixture
async def agent_on(tmp_path: Path) -> AsyncIterator[Callable[..., InProcessAgent]]:
    made: list[InProcessAgent] = []

    def make(broker: Broker, **mqtt: object) -> InProcessAgent:
        instance = InProcessAgent(tmp_path / "state", {"url": broker.url, **mqtt})
        made.append(instance)
        return instance

    yield make
    for instance in made:
        await instance.stop()


def oversize_disconnects(broker: Broker) -> int:
    return broker.log_path.read_text(errors="replace").count("oversize packet")


def probe(tag: str) -> Event:
    return Event(source="test", kind="probe", severity=Severity.INFO, message=f"probe {tag}")


LARGE_EVENTS: dict[str, Callable[[], Event]] = {
    "one large attribute": lambda: Event(
        source="kernel_log",
        kind="xid",
        severity=Severity.CRITICAL,
        message="NVRM: Xid 79: GPU has fallen off the bus",
        subject="GPU-0",
        repair_action=RepairAction.REBOOT_NODE,
        attributes={"xid": 79, "lines": "x" * 20_000},
    ),
    "a large message": lambda: Event(
        source="kernel_log",
        kind="xid",
        severity=Severity.CRITICAL,
        message="NVRM: " + "m" * 20_000,
        subject="GPU-0",
        repair_action=RepairAction.RESET_GPU,
        attributes={"xid": 48},
    ),
    "many attributes": lambda: Event(
        source="disk",
        kind="disk_full",
        severity=Severity.WARNING,
        message="many mounts are full",
        subject="/",
        attributes={f"mount_{i}": f"/var/lib/containers/{i:05d}/merged" for i in range(600)},
    ),
    "large aliases and clears": lambda: Event(
        source="gpu",
        kind="gpu_lost",
        severity=Severity.CRITICAL,
        message="GPU lost",
        subject="GPU-0",
        repair_action=RepairAction.REBOOT_NODE,
        clears=tuple(f"kind_{i}" for i in range(400)),
        aliases=tuple(f"0000:{i:02x}:00.0" for i in range(200)),
    ),
}


class TestEvents:
    """An event too large for the broker arrives cut down, in its place; nothing waits."""

    @pytest.mark.parametrize("shape", sorted(LARGE_EVENTS))
    async def test_cut_down_in_order(
        self,
        shape: str,
        broker_of: Callable[[int], Broker],
        agent_on: Callable[..., InProcessAgent],
    ) -> None:
        limit = 4096
        broker = broker_of(limit)
        sub = Subscriber(broker.port).start()
        try:
            a = agent_on(broker, metrics_interval=3600.0)
            runtime = await a.start()
            sink = runtime.sinks["mqtt"]
            await until(lambda: sink.connected, what="connected")
            bdseq = sink.bdseq
            large = LARGE_EVENTS[shape]()
            assert len(large.to_json()) > limit
            before, after = probe("before"), probe("after")
            for event in (before, large, after):
                runtime.emit(event)
            want = [before.id, large.id, after.id]
            await until(
                lambda: set(want) <= set(sub.event_ids()),
                timeout=15.0,
                what=f"every event, the large one ({shape}) cut down",
            )
            seen = [i for i in sub.event_ids() if i in want]
            assert list(dict.fromkeys(seen)) == want
            (received,) = [m for m in sub.on("/events") if m.json()["id"] == large.id]
            assert len(received.payload) <= limit
            data = received.json()
            for key in ("id", "kind", "severity", "source", "subject", "repair_action"):
                assert data[key] == large.to_dict()[key]
            assert data["node"] == runtime.node_id
            assert data["truncated"]["bytes"] > limit
            assert Event.from_dict(data).repair_action is large.repair_action
            assert sink.bdseq == bdseq, "the sink reconnected: the large event ended connections"
            assert oversize_disconnects(broker) == 0
            # The whole event stays in the node's history (diag packs it).
            stored = await runtime.in_store_thread(runtime.store.recent_events, 50)
            (kept,) = [e for e in stored if e.id == large.id]
            assert (kept.message, kept.attributes, kept.clears, kept.aliases) == (
                large.message,
                dict(large.attributes),
                large.clears,
                large.aliases,
            )
            samples = {
                (s.family.name, s.label_values): s.value
                for s in sink.samples()
                if s.family.name == "gpuwarden_mqtt_payloads_too_large_total"
            }
            assert samples[("gpuwarden_mqtt_payloads_too_large_total", ("event", "cut"))] == 1
        finally:
            sub.stop()


class TestMetrics:
    """A snapshot that cannot fit is left out: counted, told once, a health problem."""

    async def test_left_out_and_events_flow(
        self, broker_of: Callable[[int], Broker], agent_on: Callable[..., InProcessAgent]
    ) -> None:
        limit = 4096
        broker = broker_of(limit)
        sub = Subscriber(broker.port).start()
        try:
            a = agent_on(broker, metrics_interval=1.0)
            runtime = await a.start()
            sink = runtime.sinks["mqtt"]
            await until(lambda: sink.connected, what="connected")
            bdseq = sink.bdseq
            # Snapshots queued ahead of the events: each would end the connection before them.
            await asyncio.sleep(2.5)
            ids = []
            for i in range(5):
                event = probe(f"behind snapshots {i}")
                runtime.emit(event)
                ids.append(event.id)
                await asyncio.sleep(0.2)
            await until(lambda: set(ids) <= set(sub.event_ids()), timeout=15.0, what="events")
            assert sink.bdseq == bdseq
            assert oversize_disconnects(broker) == 0
            assert not sub.on("/metrics")
            await until(
                lambda: any(e.kind == "mqtt_payload_too_large" for e in runtime.recent_events),
                what="the event saying so",
            )
            told = [e for e in runtime.recent_events if e.kind == "mqtt_payload_too_large"]
            assert len(told) == 1, "told once, not once per snapshot"
            assert told[0].attributes["kind"] == "metrics"
            assert told[0].attributes["max_packet_size"] == limit
            assert any("metrics" in p and str(limit) in p for p in sink.problems())
            assert sub.event_ids().count(told[0].id) == 1
        finally:
            sub.stop()

    async def test_fits_again_clears_the_problem(
        self, broker_of: Callable[[int], Broker], agent_on: Callable[..., InProcessAgent]
    ) -> None:
        """The broker's limit raised (a restart with a new configuration): snapshots go whole
        again and the problem ends."""
        small = broker_of(4096)
        a = agent_on(small, metrics_interval=1.0, reconnect_max=0.3)
        runtime = await a.start()
        sink = runtime.sinks["mqtt"]
        await until(lambda: bool(sink.problems()), what="the snapshot left out")
        port = small.port
        small.stop()
        large = Broker(
            small.workdir, port=port, extra_config=["max_packet_size 1000000", "user root"]
        ).start()
        try:
            sub = Subscriber(large.port).start()
            try:
                await until(lambda: bool(sub.on("/metrics")), what="a whole snapshot")
                await until(lambda: not sink.problems(), what="the problem over")
            finally:
                sub.stop()
        finally:
            large.stop()


class TestHeartbeat:
    """A heartbeat too large arrives compact: the watcher reads it, nothing reads as silence."""

    async def test_compact_and_read_by_the_watcher(
        self, broker_of: Callable[[int], Broker], agent_on: Callable[..., InProcessAgent]
    ) -> None:
        limit = 700
        broker = broker_of(limit)
        sub = Subscriber(broker.port).start()
        try:
            a = agent_on(broker, metrics_interval=3600.0)
            runtime = await a.start()
            sink = runtime.sinks["mqtt"]
            await until(lambda: len(sub.on("/heartbeat")) >= 3, timeout=15.0, what="heartbeats")
            beats = [m for m in sub.on("/heartbeat") if m.payload]
            assert all(len(m.payload) <= limit for m in beats)
            parsed = [parse_heartbeat(m.payload) for m in beats]
            assert all(isinstance(p, Heartbeat) for p in parsed), parsed
            seqs = [p.seq for p in parsed if isinstance(p, Heartbeat)]
            assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
            data: dict[str, Any] = beats[-1].json()
            assert data["truncated"] is True
            assert data["node"] == runtime.node_id and data["bdseq"] == sink.bdseq
            assert oversize_disconnects(broker) == 0
        finally:
            sub.stop()


class TestPublisher:
    """The size of a PUBLISH as the broker counts it: the largest payload that fits is
    accepted, one byte more is refused here, before it is sent (the broker would end the
    connection for it, as the raw send at the end shows)."""

    @pytest.mark.parametrize("topic", ["a", "gpuwarden/v1/node-a/events", "t/" + "é" * 70])
    @pytest.mark.parametrize("qos", [0, 1])
    async def test_boundary(self, topic: str, qos: int, broker_of: Callable[[int], Broker]) -> None:
        limit = 300
        broker = broker_of(limit)
        client = aiomqtt.Client(
            "127.0.0.1", broker.port, protocol=aiomqtt.ProtocolVersion.V5, identifier="edge"
        )
        publisher = Publisher(client)
        async with connection(client) as lost:
            assert publisher.max_packet_size == limit
            fitting = publisher.room(topic, qos)
            assert fitting is not None
            assert mqtt_client.publish_size(topic, fitting, qos) == limit
            await publisher.publish_acked(topic, b"p" * fitting, qos, False, timeout=5.0)
            await publisher.publish_acked(topic, b"p" * fitting, qos, False, timeout=5.0)
            with pytest.raises(mqtt_client.PacketTooLarge) as refused:
                publisher.publish_tracked(1, topic, b"p" * (fitting + 1), qos, False)
            assert (refused.value.size, refused.value.limit) == (limit + 1, limit)
            assert not lost.done()
            assert oversize_disconnects(broker) == 0
            # What the check spares: a packet over the limit, sent anyway, ends the connection.
            # mosquitto 2.0.11 counts the remaining length and one byte of fixed header, not
            # the length's own one to four bytes, so it takes up to 3 bytes more than the
            # specification's count (the whole packet, OASIS MQTT 5.0 3.2.2.3.6), which the
            # check uses: 4 bytes over is over for both.
            client._client.publish(topic, b"p" * (fitting + 4), qos)
            await asyncio.wait_for(asyncio.wait({lost}), 10.0)
        assert oversize_disconnects(broker) == 1


def test_large_event_json_is_large() -> None:
    """The shapes above are larger than the limits the tests give the broker."""
    for make in LARGE_EVENTS.values():
        assert len(json.dumps(make().to_dict())) > 4096


texts = st.text(alphabet=st.characters(codec="utf-8"), max_size=400)
events = st.builds(
    Event,
    source=st.sampled_from(["kernel_log", "gpu", "disk"]),
    kind=st.sampled_from(["xid", "gpu_lost", "disk_full"]),
    severity=st.sampled_from(list(Severity)),
    message=texts.filter(lambda t: bool(t.strip())),
    subject=st.text(max_size=60),
    action=texts,
    repair_action=st.sampled_from(list(RepairAction)),
    clears=st.lists(st.text(min_size=1, max_size=30), max_size=40).map(tuple),
    attributes=st.dictionaries(
        st.text(min_size=1, max_size=20),
        st.one_of(st.integers(), st.booleans(), texts, st.floats(allow_nan=False)),
        max_size=40,
    ),
    aliases=st.lists(st.text(min_size=1, max_size=30), max_size=10).map(tuple),
    node=st.just("node-a"),
    time=st.floats(min_value=1e9, max_value=2e9),
    id=st.uuids().map(lambda u: u.hex),
)


class TestCutting:
    """The cut, for any event and room: within the room, still an event, the kept fields
    whole; None only when not even those fit."""

    @settings(max_examples=300, deadline=None)
    @given(event=events, room=st.integers(min_value=0, max_value=6000))
    def test_any_event(self, event: Event, room: int) -> None:
        payload = event.to_json().encode()
        cut = cut_event(payload, room)
        kept = {key: event.to_dict()[key] for key in EVENT_KEPT}
        if cut is None:
            # the least a cut could be; the room it keeps for its note to name every part it
            # cut and count what it left out is at most 120 bytes more
            least = {**kept, "message": MARK, "truncated": {"bytes": len(payload), "cut": []}}
            assert len(encode(least)) > room - 120
            return
        assert len(cut) <= room
        data = json.loads(cut)
        assert {key: data[key] for key in EVENT_KEPT} == kept
        again = Event.from_dict(data)
        assert again.repair_action is event.repair_action
        assert set(again.clears) <= set(event.clears)
        assert all(event.attributes[name] == value for name, value in again.attributes.items())
        assert data["truncated"]["bytes"] == len(payload)
        left_out = len(event.attributes) - len(again.attributes)
        assert data["truncated"]["attributes_left_out"] == left_out
        for key in ("clears", "aliases", "attributes"):
            whole_part, sent_part = event.to_dict().get(key) or [], data.get(key) or []
            assert (key in data["truncated"]["cut"]) is (len(sent_part) < len(whole_part))
        for key in ("message", "action"):
            whole = str(event.to_dict()[key])
            sent = data.get(key, "")
            assert sent == whole or (
                key in data["truncated"]["cut"] and whole.startswith(sent.removesuffix(MARK))
            )

    @settings(max_examples=200, deadline=None)
    @given(
        problems=st.lists(texts, max_size=30),
        ok=st.booleans(),
        room=st.integers(min_value=60, max_value=3000),
    )
    def test_any_heartbeat(self, problems: list[str], ok: bool, room: int) -> None:
        beat = {
            "seq": 41,
            "bdseq": 3,
            "ts": 1796219060.25,
            "interval_s": 15.0,
            "node": "node-a",
            "health": "ok" if ok else problems,
            "collectors": {f"c{i}": {"ok": True, "interval_s": 10.0} for i in range(40)},
            "gpu": "active",
        }
        payload = json.dumps(beat).encode()
        compact = compact_heartbeat(payload, room)
        if compact is None:
            assert room < 120
            return
        assert len(compact) <= room
        parsed = parse_heartbeat(compact)
        assert isinstance(parsed, Heartbeat)
        assert (parsed.seq, parsed.ts, parsed.interval_s) == (41, beat["ts"], 15.0)
        assert parsed.health_ok is ok
        assert set(parsed.problems) <= {p[:200] for p in problems} | {"unhealthy"}


class TestWatcherAlerts:
    """An alert the broker cannot take does not hold up the alerts behind it: it is left out
    of MQTT (logged; Alertmanager still gets it) and the queue goes on."""

    async def test_a_large_alert_is_left_out(self, broker_of: Callable[[int], Broker]) -> None:
        limit = 1024
        broker = broker_of(limit)
        sub = Subscriber(broker.port, topic_filter="gpuwarden/v1/_watch/alerts").start()
        client = aiomqtt.Client(
            "127.0.0.1", broker.port, protocol=aiomqtt.ProtocolVersion.V5, identifier="watch"
        )
        watcher = Watcher(WatchSettings(url=broker.url, listen=""))
        try:
            async with connection(client) as lost:
                watcher.publisher = Publisher(client)
                watcher.publisher.max_packet_size = limit
                for node, message in (("n0", "m"), ("n1", "x" * 4000), ("n2", "m")):
                    alert = Alert("node_unhealthy", node, Severity.WARNING, message, "a", 1.0)
                    watcher.pending.append(AlertChange(True, alert, 1.0))
                await watcher.flush()
                assert not watcher.pending
                await until(lambda: len(sub.on("/alerts")) == 2, what="the two that fit")
                assert [m.json()["node"] for m in sub.on("/alerts")] == ["n0", "n2"]
                assert not lost.done()
            assert oversize_disconnects(broker) == 0
        finally:
            sub.stop()


class TestReceiveMaximum:
    """MQTT v5 3.3.4: a client must not have more QoS 1 publishes unacknowledged than the
    broker's Receive Maximum (its CONNACK; mosquitto's max_inflight_messages). A broker that
    holds to it (HiveMQ, EMQX) ends the connection of one that exceeds it (0x93), and with the
    sink's default window of 100 every drain of a backlog would end in a reconnection."""

    async def test_the_window_is_the_brokers(self, tmp_path: Path) -> None:
        broker = Broker(tmp_path / "b", extra_config=["max_inflight_messages 5", "user root"])
        broker.start()
        sub = Subscriber(broker.port).start()
        a = InProcessAgent(tmp_path / "state", {"url": broker.url, "metrics_interval": 3600.0})
        try:
            runtime = await a.start()
            sink = runtime.sinks["mqtt"]
            await until(lambda: sink.connected, what="connected")
            publisher = sink._publisher
            assert publisher is not None and publisher.receive_maximum == 5
            ids = []
            for i in range(300):
                event = probe(f"backlog {i}")
                runtime.emit(event)
                ids.append(event.id)
            await until(lambda: set(ids) <= set(sub.event_ids()), timeout=30.0, what="all")
            assert 1 <= publisher.most_in_flight <= 5
        finally:
            await a.stop()
            sub.stop()
            broker.stop()
