"""The MQTT sink against a real mosquitto: topics, birth and Will, auth, ACL, TLS, outages."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.contracts.errors import ConfigError
from agent.contracts.model import Event, Severity
from agent.contracts.settings import build
from exporters.mqtt_settings import MqttSettings, parse_url
from tests.support.mosquitto import Broker, password_broker, secret_file
from tests.support.mqtt import InProcessAgent, Subscriber, persistent_broker_lines
from tests.support.tls import Authority
from tests.support.waiting import until


def emit_events(agent: InProcessAgent, count: int, tag: str) -> list[str]:
    ids = []
    for i in range(count):
        event = Event(source="test", kind="probe", severity=Severity.INFO, message=f"{tag} {i}")
        agent.runtime.emit(event)
        ids.append(event.id)
    return ids


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[Callable[..., InProcessAgent]]:
    made: list[InProcessAgent] = []

    def make(mqtt: dict[str, object], **kwargs: object) -> InProcessAgent:
        instance = InProcessAgent(tmp_path / "state", mqtt, **kwargs)  # type: ignore[arg-type]
        made.append(instance)
        return instance

    yield make
    for instance in made:
        await instance.stop()


class TestSettings:
    """[mqtt] validation: URLs, keepalive, TLS file pairs."""

    @given(
        st.sampled_from(["mqtt", "mqtts"]),
        st.from_regex(r"[a-z][a-z0-9-]{0,20}(\.[a-z]{2,5})?", fullmatch=True),
        st.integers(1, 65535),
    )
    def test_url_round_trip(self, scheme: str, host: str, port: int) -> None:
        """Any host and port come back as given, TLS for mqtts."""
        address = parse_url(f"{scheme}://{host}:{port}")
        assert (address.host, address.port, address.tls) == (host, port, scheme == "mqtts")

    @given(st.text(max_size=40))
    def test_url_parser_never_crashes(self, text: str) -> None:
        """Arbitrary text is a BrokerAddress or a ConfigError, nothing else."""
        with contextlib.suppress(ConfigError):
            parse_url(text)

    def test_default_ports_and_refusals(self) -> None:
        """1883/8883 by default; credentials in the URL and other schemes are refused."""
        assert parse_url("mqtt://broker").port == 1883
        assert parse_url("mqtts://broker").port == 8883
        for bad in ("http://broker", "mqtt://user:pw@broker", "mqtt://", "mqtt://b/x"):
            with pytest.raises(ConfigError):
                parse_url(bad)

    def test_keepalive_zero_and_half_a_client_cert_are_refused(self) -> None:
        """A keepalive of 0 would disable the Will on a frozen client; cert needs key."""
        with pytest.raises(ConfigError, match="keepalive"):
            build(MqttSettings, {"keepalive": 0}, "mqtt")
        with pytest.raises(ConfigError, match="cert_file"):
            build(MqttSettings, {"url": "mqtts://b", "cert_file": "/c"}, "mqtt")
        with pytest.raises(ConfigError, match="mqtts"):
            build(MqttSettings, {"ca_file": "/c"}, "mqtt")


class TestTopics:
    """Status, heartbeat, events and metrics land on the contract's topics."""

    async def test_birth_heartbeat_events_metrics_and_offline(
        self, broker: Broker, agent: Callable[..., InProcessAgent]
    ) -> None:
        """online (retained, bdseq), heartbeats (retained), events with ids, metrics, offline."""
        sub = Subscriber(broker.port).start()
        first = agent({"url": broker.url, "metrics_interval": 1.0, "metrics_qos": 1})
        await first.start()
        ids = emit_events(first, 5, "hello")
        await until(
            lambda: (
                len(sub.on("/events")) >= 5
                and len(sub.on("/metrics")) >= 1
                and len(sub.on("/heartbeat")) >= 2
            ),
            what="events, metrics, heartbeats",
        )
        online = sub.on("node-a/status")[0].json()
        assert online["state"] == "online"
        assert online["bdseq"] >= 1
        assert set(ids) <= set(sub.event_ids())
        beat = sub.on("/heartbeat")[-1].json()
        assert beat["interval_s"] == 0.5
        assert beat["seq"] >= 2
        assert beat["health"] == "ok"
        assert "system" in beat["collectors"]
        assert beat["sinks"]["mqtt"]["last_delivery_ts"] is not None
        assert "prometheus_last_scrape_ts" in beat
        assert sub.on("/metrics")[-1].qos == 1
        assert not sub.on("/events")[-1].retain
        metrics = sub.on("/metrics")[-1].json()["metrics"]
        assert metrics["gpuwarden_build_info"]["labels"] == ["version", "python"]
        # retained: a late subscriber sees the last status and heartbeat
        running = Subscriber(broker.port).start()
        await until(lambda: bool(running.on("/status")) and bool(running.on("/heartbeat")))
        assert running.on("/heartbeat")[0].retain
        running.stop()
        await first.stop()
        await until(
            lambda: any(m.json()["state"] == "offline" for m in sub.on("/status")), what="offline"
        )
        offline = [m.json() for m in sub.on("/status")][-1]
        assert offline["bdseq"] == online["bdseq"]
        # after a clean stop, the status stays retained and the heartbeat is cleared (an empty
        # retained publish), so that a retired node's last beat does not outlive it
        assert sub.on("/heartbeat")[-1].payload == b""
        late = Subscriber(broker.port).start()
        await until(lambda: bool(late.on("/status")))
        assert late.on("/status")[0].retain
        assert late.on("/status")[0].json()["state"] == "offline"
        assert not late.on("/heartbeat")
        # a second run has a higher birth number
        second = agent({"url": broker.url})
        await second.start()
        await until(lambda: sum(m.json()["state"] == "online" for m in sub.on("/status")) >= 2)
        births = [m.json()["bdseq"] for m in sub.on("/status") if m.json()["state"] == "online"]
        assert births[-1] > births[0]
        sub.stop()
        late.stop()


class TestAccess:
    """Password access, ACLs and the agent's report when the broker says no."""

    def password_broker(self, tmp_path: Path, acl: bool = False) -> Broker:
        return password_broker(
            tmp_path / "broker-auth",
            {"node-a": "right", "watcher": "w"},
            "pattern write gpuwarden/v1/%u/#\nuser watcher\ntopic read gpuwarden/v1/#\n"
            if acl
            else "",
        )

    def password_file(self, tmp_path: Path, text: str) -> Path:
        return secret_file(tmp_path / "mqtt-password", text)

    async def test_right_password_delivers(
        self, tmp_path: Path, agent: Callable[..., InProcessAgent]
    ) -> None:
        """With the right password the node connects and its events arrive."""
        broker = self.password_broker(tmp_path)
        try:
            a = agent(
                {
                    "url": broker.url,
                    "username": "node-a",
                    "password_file": str(self.password_file(tmp_path, "right")),
                }
            )
            runtime = await a.start()
            await until(lambda: runtime.sinks["mqtt"].connected, what="connected")
            assert runtime.ledger["mqtt"].last_delivery is not None
        finally:
            broker.stop()

    async def test_wrong_password_is_one_clear_event(
        self, tmp_path: Path, agent: Callable[..., InProcessAgent]
    ) -> None:
        """Bad credentials: one event (not one per retry), counted per attempt. mosquitto 2
        answers a v5 CONNECT with a wrong password with 0x87 Not authorized, not 0x86."""
        broker = self.password_broker(tmp_path)
        try:
            a = agent(
                {
                    "url": broker.url,
                    "username": "node-a",
                    "password_file": str(self.password_file(tmp_path, "wrong")),
                }
            )
            runtime = await a.start()
            sink = runtime.sinks["mqtt"]
            await until(lambda: sum(sink.connect_failures.values()) >= 3, what="retries")
            events = a.events_of("broker_not_authorized") + a.events_of("broker_bad_credentials")
            assert len(events) == 1
            assert "user name or password" in events[0].message
            assert "password_file" in events[0].action
            assert not sink.connected
        finally:
            broker.stop()

    async def test_readable_password_file_is_refused(
        self, tmp_path: Path, agent: Callable[..., InProcessAgent]
    ) -> None:
        """A password file other users can read stops the start with the chmod to run."""
        path = self.password_file(tmp_path, "right")
        path.chmod(0o644)
        a = agent({"url": "mqtt://127.0.0.1:1", "username": "node-a", "password_file": str(path)})
        with pytest.raises(OSError, match="chmod 600"):
            await a.start()

    async def test_acl_denial_is_detected(
        self, tmp_path: Path, agent: Callable[..., InProcessAgent]
    ) -> None:
        """Under its own name a node delivers; under another's prefix the v5 PUBACK refusal
        becomes a publish_refused event and nothing is deleted from the outbox."""
        broker = self.password_broker(tmp_path, acl=True)
        try:
            a = agent(
                {
                    "url": broker.url,
                    "username": "node-a",
                    "topic_prefix": "elsewhere/v1",
                    "password_file": str(self.password_file(tmp_path, "right")),
                }
            )
            runtime = await a.start()
            sink = runtime.sinks["mqtt"]
            await until(lambda: bool(a.events_of("broker_publish_refused")), what="refusal")
            assert "Not authorized" in a.events_of("broker_publish_refused")[0].message
            assert runtime.ledger["mqtt"].failures >= 1
            assert sink.published["event"] == 0
            assert runtime.store.outbox_depth().get("event", 0) >= 1
        finally:
            broker.stop()


class TestTls:
    """mqtts:// with a CA made by the test; a wrong CA or host name fails loudly."""

    def tls_broker(
        self, tmp_path: Path, authority: Authority, host: str, client_certs: bool = False
    ) -> Broker:
        server = authority.issue(
            host, dns_names=(host,), ip_addresses=("127.0.0.1",) if host == "127.0.0.1" else ()
        )
        workdir = tmp_path / "broker-tls"
        # These lines make the generated listener a TLS one.
        lines = [
            f"certfile {server.cert}",
            f"keyfile {server.key}",
            f"cafile {authority.cert}",
            "user root",
        ]
        if client_certs:
            lines.append("require_certificate true")
        return Broker(workdir, extra_config=lines).start()

    async def test_client_certificate(
        self, tmp_path: Path, agent: Callable[..., InProcessAgent]
    ) -> None:
        """A broker that requires client certificates accepts the node's cert and key."""
        authority = Authority(tmp_path / "ca").create()
        broker = self.tls_broker(tmp_path, authority, "127.0.0.1", client_certs=True)
        client = authority.issue("node-a", client=True)
        try:
            a = agent(
                {
                    "url": f"mqtts://127.0.0.1:{broker.port}",
                    "ca_file": str(authority.cert),
                    "cert_file": str(client.cert),
                    "key_file": str(client.key),
                }
            )
            runtime = await a.start()
            await until(lambda: runtime.sinks["mqtt"].connected, what="mutual TLS connection")
        finally:
            broker.stop()

    async def test_good_ca_connects(
        self, tmp_path: Path, agent: Callable[..., InProcessAgent]
    ) -> None:
        """The CA that signed the broker's certificate, and the right host name: connected."""
        authority = Authority(tmp_path / "ca").create()
        broker = self.tls_broker(tmp_path, authority, "127.0.0.1")
        try:
            a = agent({"url": f"mqtts://127.0.0.1:{broker.port}", "ca_file": str(authority.cert)})
            runtime = await a.start()
            await until(lambda: runtime.sinks["mqtt"].connected, what="TLS connection")
        finally:
            broker.stop()

    @pytest.mark.parametrize("problem", ["wrong_ca", "wrong_host"])
    async def test_wrong_ca_or_host_fails_loudly(
        self, tmp_path: Path, agent: Callable[..., InProcessAgent], problem: str
    ) -> None:
        """Another CA, or a certificate for another host: a tls_failed event, no connection."""
        authority = Authority(tmp_path / "ca").create()
        host = "127.0.0.1" if problem == "wrong_ca" else "other.example"
        broker = self.tls_broker(tmp_path, authority, host)
        trusted = (
            Authority(tmp_path / "other-ca", "other").create()
            if problem == "wrong_ca"
            else authority
        )
        try:
            a = agent({"url": f"mqtts://127.0.0.1:{broker.port}", "ca_file": str(trusted.cert)})
            runtime = await a.start()
            await until(lambda: bool(a.events_of("broker_tls_failed")), what="tls event")
            assert not runtime.sinks["mqtt"].connected
            assert "certificate" in a.events_of("broker_tls_failed")[0].message.lower()
        finally:
            broker.stop()


class TestOutage:
    """Broker down for a while: the outbox keeps everything and delivers it in order."""

    async def test_every_event_arrives_after_the_outage(
        self, tmp_path: Path, agent: Callable[..., InProcessAgent]
    ) -> None:
        """Exactly the ids produced before, during and after the outage arrive."""
        workdir = tmp_path / "broker-p"
        broker = Broker(workdir, extra_config=persistent_broker_lines(workdir)).start()
        sub = Subscriber(broker.port, client_id="test-sub", persistent=True).start()
        try:
            a = agent({"url": broker.url})
            runtime = await a.start()
            sink = runtime.sinks["mqtt"]
            ids = emit_events(a, 10, "before")
            await until(lambda: len(set(sub.event_ids()) & set(ids)) == 10, what="before")
            sub.stop()
            broker.stop()
            await until(lambda: not sink.connected, what="disconnect")
            ids += emit_events(a, 50, "during")
            await asyncio.sleep(0.5)
            broker.start()
            sub.start()
            ids += emit_events(a, 10, "after")
            own = set(ids)
            await until(lambda: own <= set(sub.event_ids()), what="all events")
            received = [i for i in sub.event_ids() if i in own]
            assert set(received) == own
            # in order: the ids of this test appear in the order they were produced
            first_seen = list(dict.fromkeys(received))
            assert first_seen == ids

            # The sink's own events are announced after they are stored, a moment after the
            # reconnection delivered the outbox (a loaded run saw that moment).
            def said_so() -> bool:
                kinds = {e.kind for e in runtime.recent_events}
                return "broker_connected" in kinds and bool(
                    {"broker_connection_lost", "broker_unreachable"} & kinds
                )

            await until(said_so, what="the outage and the reconnection told")
        finally:
            sub.stop()
            broker.stop()


class TestExposition:
    """The sink's own series pass promtool and show the age of the last PUBACK."""

    async def test_promtool_clean(
        self, broker: Broker, agent: Callable[..., InProcessAgent]
    ) -> None:
        """/metrics rendering of the delivery series: promtool check metrics exits 0."""
        from exporters.exposition import render

        a = agent({"url": broker.url})
        runtime = await a.start()
        await until(lambda: runtime.sinks["mqtt"].published["heartbeat"] >= 1, what="a PUBACK")
        text = render(runtime.families(), runtime.samples())
        check = subprocess.run(
            ["promtool", "check", "metrics"], input=text, capture_output=True, check=False
        )
        assert check.returncode == 0, check.stdout + check.stderr
        assert b"gpuwarden_mqtt_last_ack_age_seconds " in text
        assert b'gpuwarden_stale{kind="sink",name="mqtt"} 0.0' in text
