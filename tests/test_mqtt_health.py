"""The on-node half of the heartbeat: stale sinks and collectors become events and series,
the heartbeat carries the problems, and failures are classified for one event each."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import aiomqtt
from aiomqtt.exceptions import MqttConnectError
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.reasoncodes import ReasonCode

from exporters.mqtt_client import Backoff, PublishRefused, classify
from tests.support.mosquitto import Broker
from tests.support.mqtt import InProcessAgent, Subscriber, persistent_broker_lines
from tests.support.waiting import until


def stale_value(runtime: object, kind: str, name: str) -> float | None:
    for sample in runtime.metrics.samples():  # type: ignore[attr-defined]
        if sample.family.name == "gpuwarden_stale" and sample.label_values == (kind, name):
            return float(sample.value)
    return None


class TestStaleSink:
    """No PUBACK for N heartbeat intervals: sink_stale, a series, a health problem; back: info."""

    async def test_sink_stale_and_recovered(self, tmp_path: Path) -> None:
        """Broker away: stale event, gpuwarden_stale 1, /healthz problem, and no heartbeat
        queued meanwhile; broker back: sink_recovered and 0, and the heartbeats after the
        reconnect are about now (the delivery works again), not about the outage."""
        # a persistent session: the heartbeats delivered right after the reconnect are kept
        # for the subscriber even if the agent is back before it is
        workdir = tmp_path / "broker"
        broker = Broker(workdir, extra_config=persistent_broker_lines(workdir)).start()
        sub = Subscriber(broker.port, client_id="health-sub", persistent=True).start()
        agent = InProcessAgent(tmp_path / "state", {"url": broker.url}, heartbeat_interval=0.3)
        runtime = await agent.start()
        try:
            await until(lambda: runtime.sinks["mqtt"].connected, what="connected")
            assert stale_value(runtime, "sink", "mqtt") == 0
            sub.stop()
            broker.stop()
            await until(lambda: bool(agent.events_of("sink_stale")), what="sink_stale")
            assert stale_value(runtime, "sink", "mqtt") == 1
            assert any("sink mqtt has not delivered" in p for p in runtime.health().problems)
            # Heartbeats are "now" messages: none waits in the outbox for the broker.
            await asyncio.sleep(0.9)  # three heartbeat intervals without a broker
            assert not [e for e in runtime.store.outbox_peek(100) if e.kind == "heartbeat"]
            outage_bdseq = runtime.sinks["mqtt"].bdseq
            broker.start()
            sub.start()
            await until(lambda: bool(agent.events_of("sink_recovered")), what="recovered")
            assert stale_value(runtime, "sink", "mqtt") == 0

            def after() -> list[dict[str, object]]:
                beats = [m.json() for m in sub.on("/heartbeat")]
                return [b for b in beats if int(str(b["bdseq"])) > outage_bdseq]

            await until(lambda: bool(after()), what="a heartbeat after the reconnect")
            first = after()[0]
            problems = [] if first["health"] == "ok" else list(first["health"])  # type: ignore[call-overload]
            assert not [p for p in problems if "sink mqtt" in p], problems
            assert len(agent.events_of("sink_stale")) == 1
        finally:
            await agent.stop()
            sub.stop()
            broker.stop()


class TestStaleCollector:
    """A collector with no success for N intervals is an event and a series."""

    async def test_collector_stale(self, tmp_path: Path) -> None:
        """The system collector reading an empty /proc: collector_stale, named in health."""
        empty_proc = tmp_path / "proc"
        empty_proc.mkdir()
        agent = InProcessAgent(
            tmp_path / "state",
            {"url": "mqtt://127.0.0.1:1", "reconnect_min": 5.0, "reconnect_max": 5.0},
            heartbeat_interval=0.3,
            extra={
                "collectors": {
                    "system": {"interval": 0.2, "timeout": 0.5, "proc_root": str(empty_proc)}
                }
            },
        )
        runtime = await agent.start()
        try:
            await until(lambda: bool(agent.events_of("collector_stale")), what="collector_stale")
            event = agent.events_of("collector_stale")[0]
            assert event.subject == "system"
            assert stale_value(runtime, "collector", "system") == 1
            assert any(p.startswith("collector system stale") for p in runtime.health().problems)
        finally:
            await agent.stop()


class TestClassify:
    """Each way a connection fails has its own name (and event kind)."""

    def test_kinds(self) -> None:
        """CONNACK codes, TLS, refused sockets, lost sessions and refused publishes."""
        refused = ReasonCode(PacketTypes.PUBACK, identifier=0x87)
        assert classify(PublishRefused("t", refused))[0] == "publish_refused"
        assert (
            classify(MqttConnectError(ReasonCode(PacketTypes.CONNACK, identifier=0x86)))[0]
            == "bad_credentials"
        )
        assert (
            classify(MqttConnectError(ReasonCode(PacketTypes.CONNACK, identifier=0x87)))[0]
            == "not_authorized"
        )
        assert (
            classify(MqttConnectError(ReasonCode(PacketTypes.CONNACK, identifier=0x88)))[0]
            == "refused"
        )
        tls = aiomqtt.MqttError(
            str(
                ssl.SSLCertVerificationError(
                    1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed"
                )
            )
        )
        assert classify(tls)[0] == "tls_failed"
        assert classify(aiomqtt.MqttError("[Errno 111] Connection refused"))[0] == "unreachable"
        assert classify(aiomqtt.MqttError("Operation timed out"))[0] == "connection_lost"


class TestBackoff:
    """Exponential, jittered, bounded, and reset after a success."""

    def test_delays(self) -> None:
        """delay n lies in [m*2^(n-1), m*2^(n-1) + m], capped at the maximum."""
        backoff = Backoff(0.5, 8.0)
        for attempt in range(1, 10):
            delay = backoff.next_delay()
            low = min(8.0, 0.5 * 2 ** (attempt - 1))
            assert low <= delay <= min(8.0, low + 0.5)
        backoff.reset()
        assert backoff.next_delay() <= 1.0
