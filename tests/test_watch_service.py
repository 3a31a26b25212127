"""The watcher against a real mosquitto, with fake nodes in real subprocesses (SIGKILL, SIGSTOP)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import pytest

from agent.contracts.errors import ConfigError
from agent.contracts.model import Severity
from agent.program.watch.fleet import Alert, AlertChange
from agent.program.watch.service import Watcher
from agent.program.watch.settings import WatchSettings, load_inventory
from exporters.mqtt_client import Publisher
from tests.support.mosquitto import Broker
from tests.support.ports import free_port, wait_for_port
from tests.support.waiting import until
from tests.support.watch import (
    ROOT,
    AlertListener,
    FakeNode,
    http_get,
    metric_value,
    publish,
)

P = "gpuwarden/v1"


class RecordingWatcher(Watcher):
    """Keeps every alert change it made, for the assertions."""

    changes: list[AlertChange]

    def evaluate_once(self) -> list[AlertChange]:
        changes = super().evaluate_once()
        self.__dict__.setdefault("changes", []).extend(changes)
        return changes

    def saw(self, raised: bool, kind: str, node: str = "") -> bool:
        return any(
            c.raised == raised and c.alert.key == (kind, node)
            for c in self.__dict__.get("changes", [])
        )


def watch_settings(broker: Broker, **overrides: object) -> WatchSettings:
    values: dict[str, object] = {
        "url": broker.url,
        "listen": f"127.0.0.1:{free_port()}",
        "evaluate_interval": 0.05,
        "default_interval": 0.3,
        "broker_grace": 1.0,
        "keepalive": 5,
    }
    values.update(overrides)
    return WatchSettings(**values)  # type: ignore[arg-type]


@pytest.fixture
async def watcher(broker: Broker) -> AsyncIterator[RecordingWatcher]:
    # With an inventory only its nodes are watched: every node these tests start is in it.
    inventory = ["never-seen", "n1", "n2", "hung", "talker", "q0", "q1", "q2", "b1", "good"]
    instance = RecordingWatcher(watch_settings(broker), inventory=inventory)
    stop = asyncio.Event()
    task = asyncio.create_task(instance.run(stop))
    await until(lambda: instance.fleet.connected, what="the watcher to connect")
    yield instance
    stop.set()
    await asyncio.wait_for(task, 10)


@pytest.fixture
def nodes(broker: Broker) -> AsyncIterator[list[FakeNode]]:  # type: ignore[misc]
    started: list[FakeNode] = []
    yield started
    for node in started:
        node.stop()


async def metrics(watcher: Watcher) -> str:
    assert watcher.metrics is not None
    status, body = await asyncio.to_thread(
        http_get, f"http://127.0.0.1:{watcher.metrics.port}/metrics"
    )
    assert status == 200
    return body


class TestNodeDeath:
    """A SIGKILLed node's Will marks it dead; the alert goes out on the alerts topic."""

    async def test_sigkill_is_dead(
        self, broker: Broker, watcher: RecordingWatcher, nodes: list[FakeNode]
    ) -> None:
        listener = AlertListener(broker.port, f"{P}/_watch/alerts").start()
        try:
            node = FakeNode(broker.port, "n1", bdseq=7).start()
            nodes.append(node)
            await until(lambda: "n1" in watcher.fleet.nodes, what="n1 seen")
            node.signal(signal.SIGKILL)
            await until(lambda: watcher.saw(True, "node_dead", "n1"), what="n1 dead")
            await until(
                lambda: "raise" in listener.events("node_dead", "n1"),
                what="the dead alert on the alerts topic",
            )
            body = await metrics(watcher)
            assert metric_value(body, "gpuwarden_watch_node_state", node="n1", state="dead") == 1
            assert metric_value(body, "gpuwarden_watch_node_state", node="n1", state="online") == 0
            assert metric_value(body, "gpuwarden_watch_node_birth_sequence", node="n1") == 7
            assert (
                metric_value(
                    body,
                    "gpuwarden_watch_alert_active",
                    kind="node_missing",
                    node="never-seen",
                    severity="warning",
                )
                == 1
            )
            # a rebirth clears it
            nodes.append(FakeNode(broker.port, "n1", bdseq=8).start())
            await until(lambda: watcher.saw(False, "node_dead", "n1"), what="n1 cleared")
        finally:
            listener.stop()

    async def test_clean_stop_is_stopped_not_dead(
        self, broker: Broker, watcher: RecordingWatcher, nodes: list[FakeNode]
    ) -> None:
        node = FakeNode(broker.port, "n2").start()
        nodes.append(node)
        await until(lambda: "n2" in watcher.fleet.nodes, what="n2 seen")
        node.signal(signal.SIGTERM)
        await until(lambda: watcher.saw(True, "node_stopped", "n2"), what="n2 stopped")
        assert not watcher.saw(True, "node_dead", "n2")


class TestHungNode:
    """A SIGSTOPped node keeps its connection but stops beating: stale; SIGCONT clears it."""

    async def test_sigstop_then_sigcont(
        self, broker: Broker, watcher: RecordingWatcher, nodes: list[FakeNode]
    ) -> None:
        node = FakeNode(broker.port, "hung", interval=0.3, keepalive=30).start()
        talker = FakeNode(broker.port, "talker", interval=0.3, keepalive=30).start()
        nodes += [node, talker]
        await until(lambda: {"hung", "talker"} <= set(watcher.fleet.nodes), what="nodes seen")
        node.signal(signal.SIGSTOP)
        await until(lambda: watcher.saw(True, "node_stale", "hung"), what="hung stale")
        assert not watcher.saw(True, "node_dead", "hung")
        node.signal(signal.SIGCONT)
        await until(lambda: watcher.saw(False, "node_stale", "hung"), what="hung cleared")
        assert not watcher.saw(True, "node_stale", "talker")

    async def test_everyone_hung_is_one_alert(
        self, broker: Broker, watcher: RecordingWatcher, nodes: list[FakeNode]
    ) -> None:
        group = [FakeNode(broker.port, f"q{i}", keepalive=30).start() for i in range(3)]
        nodes += group
        await until(lambda: {"q0", "q1", "q2"} <= set(watcher.fleet.nodes), what="nodes seen")
        for node in group:
            node.signal(signal.SIGSTOP)
        await until(lambda: watcher.saw(True, "fleet_quiet"), what="one fleet alert")
        assert not any(c.alert.kind == "node_stale" and c.raised for c in watcher.changes)
        for node in group:
            node.signal(signal.SIGCONT)
        await until(lambda: watcher.saw(False, "fleet_quiet"), what="fleet alert cleared")


class TestBrokerLoss:
    """Broker gone: one broker alert, no node alerts; back: reconnect, clear, publish."""

    async def test_stop_and_start_the_broker(
        self, broker: Broker, watcher: RecordingWatcher, nodes: list[FakeNode]
    ) -> None:
        listener_topic = f"{P}/_watch/alerts"
        nodes.append(FakeNode(broker.port, "b1", keepalive=30).start())
        await until(lambda: "b1" in watcher.fleet.nodes, what="b1 seen")
        broker.stop()
        await until(lambda: watcher.saw(True, "broker_unreachable"), what="broker alert")
        body = await metrics(watcher)
        assert metric_value(body, "gpuwarden_watch_broker_connected") == 0
        assert watcher.metrics is not None
        status, _ = await asyncio.to_thread(
            http_get, f"http://127.0.0.1:{watcher.metrics.port}/healthz"
        )
        assert status == 503
        broker.start()
        listener = AlertListener(broker.port, listener_topic).start()
        try:
            await until(
                lambda: watcher.saw(False, "broker_unreachable"),
                timeout=40,
                what="broker alert cleared",
            )
            assert not any(
                c.alert.kind in ("node_stale", "node_dead", "fleet_quiet") and c.raised
                for c in watcher.changes
            )
            await until(lambda: not watcher.pending, what="queued alerts published")
        finally:
            listener.stop()


class TestHostilePayloads:
    """Garbage on the node topics is counted and skipped; the watcher keeps working."""

    async def test_garbage(
        self, broker: Broker, watcher: RecordingWatcher, nodes: list[FakeNode]
    ) -> None:
        nodes.append(FakeNode(broker.port, "good").start())
        bad = [
            (f"{P}/evil/status", b"\x00\xff not json"),
            (f"{P}/evil/status", b'{"state":"online","bdseq":1e999}'),
            (f"{P}/evil/heartbeat", b'{"seq":1,"ts":NaN,"interval_s":1}'),
            (f"{P}/evil/heartbeat", b"[" * 50_000),
            (f"{P}/evil/status", b'{"state":"online","bdseq":1,"v":"' + b"x" * 1_000_000 + b'"}'),
            (f"{P}/we ird/status", b'{"state":"online","bdseq":1}'),
        ]
        for topic, payload in bad:
            await asyncio.to_thread(publish, broker.port, topic, payload)
        await until(
            lambda: sum(watcher.fleet.counters.malformed.values()) >= len(bad),
            what="every bad message counted",
        )
        body = await metrics(watcher)
        assert (
            metric_value(body, "gpuwarden_watch_malformed_messages_total", reason="too_large") == 1
        )
        assert (
            metric_value(body, "gpuwarden_watch_malformed_messages_total", reason="bad_node_id")
            == 1
        )
        assert "evil" not in watcher.fleet.nodes
        await until(lambda: "good" in watcher.fleet.nodes, what="good node still seen")


class TestInventory:
    """The inventory file: ids one a line, comments, and a clear error for a bad line."""

    def test_parse(self, tmp_path: Path) -> None:
        path = tmp_path / "inventory"
        path.write_text("# rack 1\ngpu-1\n\n  gpu-2  # spare\n")
        assert load_inventory(path) == ["gpu-1", "gpu-2"]
        path.write_text("gpu-1\nbad node\n")
        with pytest.raises(ConfigError, match=r"inventory:2: 'bad node'"):
            load_inventory(path)


class TestCommand:
    """`gpuwarden watch` as a process: serves /metrics, exits 0 on SIGTERM, 2 on bad config."""

    def test_runs_and_stops(self, broker: Broker, tmp_path: Path) -> None:
        port = free_port()
        config = tmp_path / "gpuwarden.toml"
        config.write_text(f'[watch]\nurl = "{broker.url}"\nlisten = "127.0.0.1:{port}"\n')
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        process = subprocess.Popen(
            [sys.executable, "-m", "agent", "watch", "--config", str(config)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            wait_for_port(port)
            status, body = http_get(f"http://127.0.0.1:{port}/metrics")
            assert status == 200
            assert "gpuwarden_watch_broker_connected" in body
        finally:
            process.send_signal(signal.SIGTERM)
            out, _ = process.communicate(timeout=15)
        assert process.returncode == 0, out

    def test_config_error(self, tmp_path: Path) -> None:
        config = tmp_path / "gpuwarden.toml"
        config.write_text('[watch]\nurl = "http://x"\n')
        done = subprocess.run(
            [sys.executable, "-m", "agent", "watch", "--config", str(config)],
            check=False,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert done.returncode == 2
        assert "watch.url" in done.stderr


class SlowPublisher:
    """A publisher whose publish waits for its PUBACK: other tasks run meanwhile."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    async def publish_acked(
        self, topic: str, payload: bytes, qos: int, retain: bool, timeout: float
    ) -> None:
        for _ in range(3):
            await asyncio.sleep(0)
        self.sent.append(json.loads(payload)["node"])


def dead_alert(node: str) -> AlertChange:
    return AlertChange(True, Alert("node_dead", node, Severity.CRITICAL, "m", "a", 0.0), 0.0)


class TestFlush:
    """Flushes on connect and after an evaluation may overlap: each alert goes out once."""

    async def test_concurrent_flushes_publish_each_alert_once(self) -> None:
        watcher = Watcher(WatchSettings(listen=""))
        watcher.pending.extend(dead_alert(f"n{i}") for i in range(4))
        publisher = SlowPublisher()
        watcher.publisher = cast(Publisher, publisher)
        results = await asyncio.gather(watcher.flush(), watcher.flush(), return_exceptions=True)
        assert list(results) == [None, None]
        assert publisher.sent == ["n0", "n1", "n2", "n3"]
        assert not watcher.pending


class TestLoopsSurviveBugs:
    """An unexpected exception is logged; evaluation goes on and MQTT reconnects."""

    async def test_evaluation_goes_on_after_an_exception(self) -> None:
        calls: list[int] = []

        class Flaky(Watcher):
            def evaluate_once(self) -> list[AlertChange]:
                calls.append(1)
                if len(calls) == 1:
                    raise RuntimeError("a bug")
                return super().evaluate_once()

        watcher = Flaky(WatchSettings(listen="", evaluate_interval=0.05))
        task = asyncio.create_task(watcher.evaluate_forever())
        try:
            await until(lambda: len(calls) >= 3 or task.done(), what="evaluations after a bug")
            assert not task.done()
        finally:
            task.cancel()

    async def test_session_bug_reconnects(self) -> None:
        sessions: list[int] = []

        class Flaky(Watcher):
            async def session(self) -> None:
                sessions.append(1)
                if len(sessions) == 1:
                    raise IndexError("pop from an empty deque")
                await asyncio.Event().wait()  # connected for good

        watcher = Flaky(WatchSettings(listen=""))
        task = asyncio.create_task(watcher.mqtt_forever())
        try:
            await until(lambda: len(sessions) >= 2 or task.done(), what="a second session")
            assert not task.done()
        finally:
            task.cancel()
