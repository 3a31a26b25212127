"""One MQTT connection stack for the agent ([mqtt]) and the watcher ([watch]): the same settings
rules, credentials, PUBACK handling and reconnect backoff, against a real mosquitto."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiomqtt
import pytest
import structlog.testing
from hypothesis import given
from hypothesis import strategies as st

from agent.contracts.errors import ConfigError
from agent.contracts.model import Severity
from agent.program import config_file as config_module
from agent.program.watch.fleet import Alert, AlertChange
from agent.program.watch.service import Watcher
from agent.program.watch.settings import WatchSettings
from exporters.mqtt_settings import MqttSettings
from tests.support.mosquitto import Broker, password_broker, secret_file
from tests.support.mqtt import InProcessAgent
from tests.support.waiting import until
from tests.support.watch import ROOT

SECTIONS = ("mqtt", "watch")
PASSWORD = "s3cr3t-pw"
CONFIG_DOC = ROOT / "docs" / "configuration.md"


def load(section: str, table: dict[str, Any]) -> Any:
    """The section as the config loader builds it (the path `gpuwarden run|watch` takes)."""
    return config_module.parse({section: table}).sections[section]


def verdict(section: str, table: dict[str, Any]) -> tuple[str, str] | None:
    """None if the section accepts the table, else (key inside the section, message)."""
    try:
        load(section, table)
    except ConfigError as exc:
        return exc.key.removeprefix(f"{section}."), exc.message
    return None


def urls() -> st.SearchStrategy[str]:
    """URLs built from the parts that matter: scheme, user info, host, port, path/query."""
    return st.builds(
        lambda scheme, userinfo, host, port, tail: (
            f"{scheme}://{userinfo}{host}{'' if port is None else f':{port}'}{tail}"
        ),
        st.sampled_from(["mqtt", "mqtts", "http", "tcp"]),
        st.sampled_from(["", "user@", f"user:{PASSWORD}@", f":{PASSWORD}@", "a%40b:c%3Ad@"]),
        st.sampled_from(["broker", "10.0.0.1", "[::1]", "", "b-1.example.org"]),
        st.one_of(st.none(), st.integers(0, 70000)),
        st.sampled_from(["", "/", "/topic", "?x=1", "#frag"]),
    )


class TestOneRuleForBothSections:
    """[mqtt] and [watch] name the same broker keys and judge them with one validator."""

    @pytest.mark.parametrize("section", SECTIONS)
    @pytest.mark.parametrize(
        "url",
        [
            f"mqtt://node:{PASSWORD}@broker",
            "mqtt://node@broker:1883",
            f"mqtts://:{PASSWORD}@broker",
            f"mqtt://n%40corp:{PASSWORD}@broker:1884",
        ],
    )
    def test_credentials_in_the_url_are_refused(self, section: str, url: str) -> None:
        """A user or password in the URL is an error that says where they belong, and the
        password is not repeated in it (the message ends up in logs)."""
        with pytest.raises(ConfigError) as caught:
            load(section, {"url": url})
        assert caught.value.key == f"{section}.url"
        assert "username" in caught.value.message
        assert "password_file" in caught.value.message
        assert PASSWORD not in str(caught.value)

    @given(urls())
    def test_both_sections_judge_every_url_alike(self, url: str) -> None:
        """Whatever the URL, both sections accept it (the same broker address) or both refuse
        it with the same message, which never repeats a password typed into the URL."""
        verdicts = {section: verdict(section, {"url": url}) for section in SECTIONS}
        assert verdicts["mqtt"] == verdicts["watch"], url
        assert PASSWORD not in str(verdicts["mqtt"])  # no message repeats a password
        if verdicts["mqtt"] is None:
            agent, watcher = load("mqtt", {"url": url}), load("watch", {"url": url})
            assert agent.address == watcher.address

    @pytest.mark.parametrize(
        ("table", "key"),
        [
            # a password without a user name would be dropped without a word by the client
            ({"password_file": "/etc/gpuwarden/p"}, "password_file"),
            ({"ca_file": "/etc/ssl/ca.pem"}, "url"),  # TLS files need mqtts://
            ({"url": "mqtts://b", "cert_file": "/c.pem"}, "cert_file"),  # cert needs key
            ({"url": "mqtts://b", "key_file": "/k.pem"}, "cert_file"),
            ({"keepalive": 0}, "keepalive"),
            ({"keepalive": 65536}, "keepalive"),
            ({"reconnect_min": 5.0, "reconnect_max": 1.0}, "reconnect_min"),
            ({"reconnect_min": 0.0}, "reconnect_min"),
            ({"connect_timeout": 0.0}, "connect_timeout"),
            ({"client_id": "bad\x00id"}, "client_id"),
            ({"client_id": "x" * 65536}, "client_id"),
            ({"topic_prefix": "gpuwarden//v1"}, "topic_prefix"),
            ({"topic_prefix": "gpuwarden/+"}, "topic_prefix"),
            ({"topic_prefix": "/gpuwarden"}, "topic_prefix"),
        ],
    )
    def test_every_broker_rule_is_the_same_in_both(self, table: dict[str, Any], key: str) -> None:
        """The same broker keys refused in both sections, on the same key, with one message."""
        verdicts = {section: verdict(section, table) for section in SECTIONS}
        assert verdicts["mqtt"] is not None, table
        assert verdicts["mqtt"][0] == key
        assert verdicts["watch"] == verdicts["mqtt"]

    def test_one_settings_type_behind_both(self) -> None:
        """Both sections are BrokerSettings: one set of field definitions, one validator."""
        from exporters.mqtt_settings import BrokerSettings

        assert issubclass(MqttSettings, BrokerSettings)
        assert issubclass(WatchSettings, BrokerSettings)
        broker_keys = {f.name for f in dataclasses.fields(BrokerSettings)}
        for section in (MqttSettings, WatchSettings):
            by_name = {f.name: f for f in dataclasses.fields(section)}
            for name in broker_keys:
                # the same field object: a section cannot quietly redefine a broker key
                assert by_name[name] is BrokerSettings.__dataclass_fields__[name], name

    @pytest.mark.parametrize("section", SECTIONS)
    def test_config_check_refuses_credentials_in_the_url(
        self, section: str, tmp_path: Path
    ) -> None:
        """`gpuwarden config check`: exit 2, the file, the key and the fix; not the password."""
        config = tmp_path / "gpuwarden.toml"
        config.write_text(f'[{section}]\nurl = "mqtt://node:{PASSWORD}@broker:1883"\n')
        done = subprocess.run(
            [sys.executable, "-m", "agent", "config", "check", "--config", str(config)],
            check=False,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, done.stdout + done.stderr
        assert str(config) in done.stderr
        assert f"{section}.url" in done.stderr
        assert "password_file" in done.stderr
        assert PASSWORD not in done.stderr + done.stdout

    def test_config_doc_documents_every_key_of_both_sections(self) -> None:
        """docs/configuration.md's [mqtt] rows and [watch] table name every key the code accepts."""
        text = CONFIG_DOC.read_text()
        mqtt_rows = " ".join(line for line in text.splitlines() if line.startswith("| `[mqtt] "))
        watch_table = text.split("| key (`[watch]`) |", 1)[1].split("\n\n", 1)[0]
        watch_keys = {
            key
            for line in watch_table.splitlines()
            for key in re.findall(r"`([a-z_]+)`", line.split("|")[1] if "|" in line else "")
        }
        for spec in dataclasses.fields(MqttSettings):
            assert f"`{spec.name}`" in mqtt_rows or f"] {spec.name}`" in mqtt_rows, spec.name
        missing = {f.name for f in dataclasses.fields(WatchSettings)} - watch_keys
        assert not missing, f"docs/configuration.md [watch] table lacks {sorted(missing)}"


# -- against a real mosquitto -----------------------------------------------------------------


def watcher_settings(url: str, **table: Any) -> WatchSettings:
    settings = load("watch", {"url": url, "listen": "", "evaluate_interval": 0.05, **table})
    assert isinstance(settings, WatchSettings)
    return settings


@contextlib.asynccontextmanager
async def running(watcher: Watcher) -> AsyncIterator[Watcher]:
    stop = asyncio.Event()
    task = asyncio.create_task(watcher.run(stop))
    try:
        yield watcher
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


class TestCredentials:
    """username + password_file: the agent and the watcher log in the same way."""

    async def test_agent_and_watcher_log_in_with_password_files(self, tmp_path: Path) -> None:
        """Against a broker with a password file, the agent publishes and the watcher, logged
        in as its own user, sees it online."""
        broker = password_broker(tmp_path / "broker", {"node-a": "node-pw", "watcher": "watch-pw"})
        agent = InProcessAgent(
            tmp_path / "state",
            {
                "url": broker.url,
                "username": "node-a",
                "password_file": str(secret_file(tmp_path / "node-password", "node-pw")),
            },
        )
        watcher = Watcher(
            watcher_settings(
                broker.url,
                username="watcher",
                password_file=str(secret_file(tmp_path / "watch-password", "watch-pw")),
            )
        )
        try:
            runtime = await agent.start()
            async with running(watcher):
                await until(lambda: runtime.sinks["mqtt"].connected, what="the agent logged in")
                await until(
                    lambda: "node-a" in watcher.fleet.nodes, what="the watcher seeing node-a"
                )
                assert watcher.fleet.connected
        finally:
            await agent.stop()
            broker.stop()

    async def test_a_wrong_password_is_one_classified_failure_in_both(self, tmp_path: Path) -> None:
        """The broker says no: the same failure kind for both, logged once, not per retry."""
        broker = password_broker(tmp_path / "broker", {"node-a": "node-pw", "watcher": "w"})
        wrong = str(secret_file(tmp_path / "wrong", "wrong"))
        fast = {"reconnect_min": 0.05, "reconnect_max": 0.1}
        agent = InProcessAgent(
            tmp_path / "state",
            {"url": broker.url, "username": "node-a", "password_file": wrong, **fast},
        )
        watcher = Watcher(
            watcher_settings(broker.url, username="watcher", password_file=wrong, **fast)
        )
        try:
            with structlog.testing.capture_logs() as logs:
                runtime = await agent.start()
                sink = runtime.sinks["mqtt"]
                async with running(watcher):
                    await until(
                        lambda: (
                            sum(sink.connect_failures.values()) >= 3
                            and sum(watcher.connect_failures.values()) >= 3
                        ),
                        what="three refused attempts each",
                    )
            kinds = {"not_authorized", "bad_credentials"}
            assert set(sink.connect_failures) <= kinds
            assert set(watcher.connect_failures) == set(sink.connect_failures)
            watch_lines = [
                e
                for e in logs
                if e.get("component") == "watch"
                and e.get("reason") in kinds
                and e["log_level"] != "debug"  # the retries after the first say it at debug
            ]
            assert len(watch_lines) == 1, watch_lines
            assert "password_file" in watch_lines[0]["action"]
            assert "[watch]" in watch_lines[0]["action"]
            assert not watcher.fleet.connected
        finally:
            await agent.stop()
            broker.stop()


class TestSameBackoff:
    """Both reconnect loops wait with one policy, and both come back after a broker restart."""

    async def test_both_reconnect_after_a_broker_restart(
        self,
        tmp_path: Path,
        broker: Broker,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        from exporters.mqtt_client import Backoff

        delays: list[tuple[object, float]] = []
        next_delay = Backoff.next_delay

        def recorded(self: Backoff) -> float:
            delay = next_delay(self)
            delays.append((self, delay))
            return delay

        monkeypatch.setattr(Backoff, "next_delay", recorded)
        caplog.set_level(logging.ERROR, logger="asyncio")
        fast = {"reconnect_min": 0.1, "reconnect_max": 0.5}
        agent = InProcessAgent(tmp_path / "state", {"url": broker.url, **fast})
        watcher = Watcher(watcher_settings(broker.url, **fast))
        try:
            runtime = await agent.start()
            sink = runtime.sinks["mqtt"]
            async with running(watcher):
                await until(lambda: sink.connected and watcher.fleet.connected, what="both up")
                assert type(sink.backoff) is Backoff
                assert type(watcher.backoff) is Backoff
                assert (sink.backoff.minimum, sink.backoff.maximum) == (0.1, 0.5)
                assert (watcher.backoff.minimum, watcher.backoff.maximum) == (0.1, 0.5)
                first_birth = sink.bdseq
                broker.stop()
                await until(
                    lambda: not sink.connected and not watcher.fleet.connected, what="both down"
                )
                await until(
                    lambda: {id(sink.backoff), id(watcher.backoff)} <= {id(b) for b, _ in delays},
                    what="both waiting on the backoff",
                )
                broker.start()
                await until(
                    lambda: sink.connected and watcher.fleet.connected,
                    timeout=30,
                    what="both reconnected",
                )
                assert sink.bdseq > first_birth
                # Reset once connected: the next outage starts from the shortest delay again.
                # The watcher resets after its subscription, a moment after it counts itself
                # connected (the CI run of d8508ba saw that moment).
                await until(
                    lambda: sink.backoff.attempt == 0 and watcher.backoff.attempt == 0,
                    what="both backoffs reset",
                )
        finally:
            await agent.stop()
        assert all(0.1 <= delay <= 0.5 for _, delay in delays), delays
        gc.collect()  # an unretrieved future is reported when it is collected
        never = [r.getMessage() for r in caplog.records if "never retrieved" in r.getMessage()]
        assert not never


class TestBugsCostAReconnection:
    """One loop for both: an unexpected exception in a session is retried, like a lost broker."""

    async def test_the_agent_sink_survives_a_bug_in_a_session(
        self, tmp_path: Path, broker: Broker, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        agent = InProcessAgent(tmp_path / "state", {"url": broker.url})
        try:
            runtime = await agent.start()
            sink = runtime.sinks["mqtt"]
            await until(lambda: sink.connected, what="connected")
            first_birth = sink.bdseq
            drain = type(sink)._drain
            calls: list[int] = []

            async def buggy(self: Any, *args: Any) -> None:
                calls.append(1)
                if len(calls) == 1:
                    raise IndexError("pop from an empty deque")
                await drain(self, *args)

            monkeypatch.setattr(type(sink), "_drain", buggy)
            broker.restart()  # a new session, whose drain raises once
            await until(lambda: sink.connected and len(calls) >= 2, what="a second session")
            assert sink.bdseq > first_birth
            assert not runtime._sink_tasks["mqtt"].done()
            assert "IndexError" in runtime.ledger["mqtt"].last_failure
        finally:
            await agent.stop()


# -- the PUBACK adapter: what aiomqtt does and does not tell ---------------------------------

ACL = "user node-a\ntopic write gpuwarden/v1/node-a/#\nuser watcher\ntopic read gpuwarden/v1/#\n"


class TestPubackAdapter:
    """exporters.mqtt_client.Publisher exists because aiomqtt 2.x hides PUBACK reason codes.
    These tests pin that: if aiomqtt starts raising on a refused publish, the first fails and
    the adapter can go."""

    async def test_aiomqtt_waits_for_the_puback_but_hides_a_refusal(self, tmp_path: Path) -> None:
        from exporters.mqtt_client import (
            Publisher,
            PublishRefused,
            connection,
            load_credentials,
            new_client,
        )
        from exporters.mqtt_settings import BrokerSettings

        broker = password_broker(tmp_path / "broker", {"node-a": "pw"}, ACL)
        settings = BrokerSettings(
            url=broker.url,
            username="node-a",
            password_file=secret_file(tmp_path / "pw", "pw"),
        )
        client = new_client(
            settings, load_credentials(settings, "mqtt"), default_identifier="pin", will=None
        )
        publisher = Publisher(client)
        try:
            async with connection(client):
                # aiomqtt: the refused publish returns as if delivered
                await client.publish("elsewhere/x", b"1", qos=1, timeout=5)
                with pytest.raises(PublishRefused, match="Not authorized"):
                    await publisher.publish_acked("elsewhere/x", b"1", 1, False, timeout=5)
                await publisher.publish_acked(
                    "gpuwarden/v1/node-a/status", b"1", 1, False, timeout=5
                )
                # aiomqtt's own publish still sees its PUBACK: the adapter chains, not replaces
                await client.publish("gpuwarden/v1/node-a/status", b"2", qos=1, timeout=5)
        finally:
            broker.stop()

    async def test_a_lost_connection_ends_the_connection_task(self, broker: Broker) -> None:
        """aiomqtt's public signal of a lost connection (its message iterator raising) is what
        both sides wait on."""
        from exporters.mqtt_client import connection, load_credentials, new_client
        from exporters.mqtt_settings import BrokerSettings

        settings = BrokerSettings(url=broker.url, keepalive=5)
        client = new_client(
            settings, load_credentials(settings, "mqtt"), default_identifier="lost", will=None
        )
        async with connection(client) as lost:
            assert not lost.done()
            broker.stop()
            with pytest.raises(aiomqtt.MqttError):
                await asyncio.wait_for(lost, 15)


class TestWatcherRefusals:
    """The watcher reads PUBACK codes too: an alert the broker refused is not thrown away."""

    async def test_a_refused_alert_stays_queued(self, tmp_path: Path) -> None:
        broker = password_broker(tmp_path / "broker", {"watcher": "w"}, ACL)
        watcher = Watcher(
            watcher_settings(
                broker.url,
                username="watcher",
                password_file=str(secret_file(tmp_path / "pw", "w")),
            )
        )
        change = AlertChange(True, Alert("node_dead", "n1", Severity.CRITICAL, "m", "a", 0.0), 0.0)
        try:
            with structlog.testing.capture_logs() as logs:
                async with running(watcher):
                    await until(lambda: watcher.fleet.connected, what="connected (read only)")
                    watcher.pending.append(change)
                    await watcher.flush()
                    await watcher.flush()
                    assert list(watcher.pending) == [change]
            refused = [
                e
                for e in logs
                if e.get("reason") == "publish_refused" and e["log_level"] != "debug"
            ]
            assert len(refused) == 1, refused  # once, not per flush
            assert "Not authorized" in refused[0]["error"]
        finally:
            broker.stop()
