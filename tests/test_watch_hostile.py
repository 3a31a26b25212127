"""The watcher cannot be fooled into paging: a real mosquitto, the real Watcher, fake nodes and
real agents as subprocesses, hostile publishers as plain MQTT clients. Loopback only; every
wait has a bound.

Each class is one defect of issue 13: decommissioned nodes that come back, forged or lenient
status, junk node ids, an unbounded /metrics on the event loop, and a broker outage that pages
N+2 times.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from agent.program.watch import metrics as watch_metrics
from agent.program.watch.fleet import SETTLE_SECONDS, State
from tests.support.agent_proc import AgentProcess
from tests.support.mosquitto import Broker
from tests.support.mqtt import Received, Subscriber
from tests.support.waiting import until
from tests.support.watch import FakeNode, metric_value, publish
from tests.test_watch_service import RecordingWatcher, metrics, watch_settings

P = "gpuwarden/v1"


@pytest.fixture
def nodes() -> Iterator[list[FakeNode]]:
    started: list[FakeNode] = []
    yield started
    for node in started:
        node.stop()


@pytest.fixture
async def run_watcher() -> AsyncIterator[Callable[..., Any]]:
    """Start a RecordingWatcher with the given settings; all are stopped at the end."""
    running: list[tuple[asyncio.Event, asyncio.Task[None]]] = []

    async def start(
        broker: Broker, inventory: list[str] | None = None, **overrides: object
    ) -> RecordingWatcher:
        watcher = RecordingWatcher(watch_settings(broker, **overrides), inventory=inventory)
        stop = asyncio.Event()
        running.append((stop, asyncio.create_task(watcher.run(stop))))
        await until(lambda: watcher.fleet.connected, what="the watcher to connect")
        return watcher

    yield start
    for stop, task in running:
        stop.set()
        await asyncio.wait_for(task, 10)


def raised_for(watcher: RecordingWatcher, node_prefix: str) -> list[tuple[str, str]]:
    return [
        c.alert.key
        for c in getattr(watcher, "changes", [])
        if c.raised and c.alert.node.startswith(node_prefix)
    ]


def publish_many(port: int, messages: list[tuple[str, bytes, bool]]) -> None:
    """Publish at QoS 1 from one client and wait for every PUBACK (a bounded burst)."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2)
    client.max_inflight_messages_set(200)
    client.max_queued_messages_set(0)
    client.connect("127.0.0.1", port)
    client.loop_start()
    try:
        infos = [client.publish(t, p, qos=1, retain=r) for t, p, r in messages]
        for info in infos:
            info.wait_for_publish(30)
    finally:
        client.disconnect()
        client.loop_stop()


def retained_now(port: int, topic_filter: str) -> list[Received]:
    """What a new subscriber is sent at once: the retained messages (a marker published after
    the SUBACK ends the wait; the broker sends the retained ones before it)."""
    subscriber = Subscriber(port, topic_filter=f"{P}/#").start()
    try:
        publish(port, f"{P}/zz-marker/x", b"end")
        subscriber.wait_for(lambda s: bool(s.on("zz-marker/x")), timeout=10, what="marker")
        return [m for m in subscriber.messages if m.retain and m.topic.startswith(topic_filter)]
    finally:
        subscriber.stop()


def wait_for_message(port: int, topic: str) -> None:
    subscriber = Subscriber(port, topic_filter=topic).start()
    try:
        subscriber.wait_for(lambda s: bool(s.messages), what=f"a message on {topic}")
    finally:
        subscriber.stop()


def status(state: str, bdseq: int, **extra: object) -> bytes:
    return json.dumps({"state": state, "bdseq": bdseq, "ts": 1.7e9, **extra}).encode()


def beat(seq: int = 1, interval: float = 0.3, health: object = "ok") -> bytes:
    return json.dumps(
        {"seq": seq, "ts": time.time(), "interval_s": interval, "health": health}
    ).encode()


def seen(watcher: RecordingWatcher) -> bool:
    return "retired" in watcher.fleet.nodes


def paged_or_forgotten(watcher: RecordingWatcher) -> bool:
    return watcher.saw(True, "node_stale", "retired") or "retired" not in watcher.fleet.nodes


def status_count_reached(watcher: RecordingWatcher, count: int) -> bool:
    return watcher.fleet.counters.messages["status"] >= count


class TestDecommissionedNodesStayGone:
    """A retired node must not come back at the next watcher restart."""

    @pytest.mark.slow
    def test_a_clean_stop_clears_the_agents_retained_heartbeat(
        self, broker: Broker, agent_process: AgentProcess
    ) -> None:
        agent_process.config_text = (
            f'[mqtt]\nenabled = true\nurl = "{broker.url}"\nkeepalive = 5\n'
            "reconnect_min = 0.2\nreconnect_max = 1.0\n[heartbeat]\ninterval = 0.5\n"
        )
        agent_process.start()
        base = f"{P}/test-node"
        wait_for_message(broker.port, f"{base}/heartbeat")
        assert agent_process.stop() == 0
        kept = {m.topic: m.payload for m in retained_now(broker.port, base)}
        assert json.loads(kept[f"{base}/status"])["reason"] == "shutdown"
        assert f"{base}/heartbeat" not in kept, (
            f"the heartbeat is still retained:\n{agent_process.log()}"
        )

    async def test_a_leftover_retained_heartbeat_is_forgotten_not_paged(
        self, broker: Broker, nodes: list[FakeNode], run_watcher: Callable[..., Any]
    ) -> None:
        # A node retired the way main's README said: stopped, then its status cleared. Its
        # retained heartbeat stays (an agent before this fix, or one that was killed).
        node = FakeNode(broker.port, "retired", interval=0.3).start()
        nodes.append(node)
        await asyncio.to_thread(wait_for_message, broker.port, f"{P}/retired/heartbeat")
        node.signal(signal.SIGTERM)
        assert node.process is not None
        await asyncio.to_thread(node.process.wait, 10)
        await asyncio.to_thread(publish, broker.port, f"{P}/retired/status", b"", True)
        assert [m.topic for m in retained_now(broker.port, f"{P}/retired")] == [
            f"{P}/retired/heartbeat"
        ]
        for n in range(2):  # every watcher restart sees the heartbeat again
            watcher = await run_watcher(broker, client_id=f"watcher-{n}")
            await until(partial(seen, watcher), what="the retained heartbeat")
            await until(partial(paged_or_forgotten, watcher), timeout=15, what="paged or forgotten")
            assert raised_for(watcher, "retired") == []
            assert watcher.fleet.counters.forgotten.get("heartbeat_only") == 1

    async def test_offline_and_silent_nodes_are_forgotten(
        self, broker: Broker, nodes: list[FakeNode], run_watcher: Callable[..., Any]
    ) -> None:
        watcher = await run_watcher(broker, forget_offline_after=2.0)
        killed = FakeNode(broker.port, "gone", interval=0.3).start()
        stopped = FakeNode(broker.port, "parked", interval=0.3).start()
        talker = FakeNode(broker.port, "talker", interval=0.3).start()  # not a fleet silence
        nodes += [killed, stopped, talker]
        await until(lambda: {"gone", "parked"} <= set(watcher.fleet.nodes), what="nodes seen")
        await until(
            lambda: watcher.fleet.connected_at + SETTLE_SECONDS < time.time(), what="settled"
        )
        killed.signal(signal.SIGKILL)
        stopped.signal(signal.SIGTERM)
        await until(lambda: watcher.saw(True, "node_dead", "gone"), what="gone dead")
        await until(lambda: watcher.saw(True, "node_stopped", "parked"), what="parked stopped")
        await until(
            lambda: not ({"gone", "parked"} & set(watcher.fleet.nodes)),
            timeout=15,
            what="both forgotten",
        )
        assert watcher.saw(False, "node_dead", "gone")
        assert watcher.saw(False, "node_stopped", "parked")
        body = await metrics(watcher)
        assert (
            metric_value(body, "gpuwarden_watch_forgotten_nodes_total", reason="offline_silent")
            == 2
        )


class TestForgedOrLenientStatus:
    """A live, beating node is not killed by a replayed birth or a second spelling."""

    async def test_an_older_birth_and_its_offline_are_ignored(
        self, broker: Broker, nodes: list[FakeNode], run_watcher: Callable[..., Any]
    ) -> None:
        watcher = await run_watcher(broker)
        nodes.append(FakeNode(broker.port, "live", bdseq=5, interval=0.3).start())
        await until(lambda: watcher.fleet.nodes.get("live", None) is not None, what="live seen")
        await until(lambda: watcher.fleet.nodes["live"].bdseq == 5, what="its birth")
        for bdseq in (0, 4):
            before = watcher.fleet.counters.messages["status"]
            await asyncio.to_thread(
                publish_many,
                broker.port,
                [
                    (f"{P}/live/status", status("online", bdseq), False),
                    (f"{P}/live/status", status("offline", bdseq), False),
                ],
            )
            await until(
                partial(status_count_reached, watcher, before + 2), what="the forged pair handled"
            )
        await asyncio.sleep(0.5)  # ten evaluations
        assert not watcher.saw(True, "node_dead", "live")
        assert watcher.fleet.state_of(watcher.fleet.nodes["live"], watcher.clock()) is State.ONLINE
        body = await metrics(watcher)
        assert metric_value(body, "gpuwarden_watch_ignored_messages_total", reason="old_birth") == 2
        assert metric_value(body, "gpuwarden_watch_stale_wills_total") == 2

    async def test_other_spellings_of_an_offline_are_refused(
        self, broker: Broker, nodes: list[FakeNode], run_watcher: Callable[..., Any]
    ) -> None:
        watcher = await run_watcher(broker)
        nodes.append(FakeNode(broker.port, "live", bdseq=3, interval=0.3).start())
        await until(lambda: watcher.fleet.nodes.get("live", None) is not None, what="live seen")
        await until(lambda: watcher.fleet.nodes["live"].bdseq == 3, what="its birth")
        offline = '{"state":"offline","bdseq":3,"ts":1700000000}'
        spellings = [offline.encode(e) for e in ("utf-8-sig", "utf-16", "utf-16-be", "utf-32")]
        duplicated = [
            b'{"state":"online","bdseq":3,"state":"offline"}',
            b'{"state":"offline","bdseq":3,"bdseq":4,"bdseq":3}',
        ]
        before = watcher.fleet.counters.messages["status"]
        await asyncio.to_thread(
            publish_many,
            broker.port,
            [(f"{P}/live/status", p, False) for p in spellings + duplicated],
        )
        await until(
            lambda: watcher.fleet.counters.messages["status"] >= before + 6, what="all handled"
        )
        await asyncio.sleep(0.5)
        assert not watcher.saw(True, "node_dead", "live")
        assert watcher.fleet.nodes["live"].online is True
        assert watcher.fleet.counters.malformed == {"not_utf8": 4, "duplicate_key": 2}


class TestJunkNodeIds:
    """Invented ids on valid heartbeats page nobody, expire, and never keep a real node out."""

    async def test_without_an_inventory(
        self, broker: Broker, nodes: list[FakeNode], run_watcher: Callable[..., Any]
    ) -> None:
        watcher = await run_watcher(broker)
        watcher.fleet.max_nodes = 300
        junk = [(f"{P}/junk-{i}/heartbeat", beat(health=["disk full"]), False) for i in range(600)]
        await asyncio.to_thread(publish_many, broker.port, junk)
        await until(
            lambda: watcher.fleet.counters.messages["heartbeat"] >= 600, what="junk handled"
        )
        assert len(watcher.fleet.nodes) <= 300
        real = FakeNode(broker.port, "real", interval=0.3).start()
        nodes.append(real)
        await until(lambda: "real" in watcher.fleet.nodes, timeout=10, what="the real node in")
        await until(
            lambda: (
                not any(n.startswith("junk-") for n in watcher.fleet.nodes)
                or bool(raised_for(watcher, "junk-"))
            ),
            timeout=15,
            what="junk forgotten or paged",
        )
        assert raised_for(watcher, "junk-") == []
        assert list(watcher.fleet.nodes) == ["real"]
        assert watcher.fleet.state_of(watcher.fleet.nodes["real"], watcher.clock()) is State.ONLINE

    async def test_births_of_junk_never_push_out_a_beating_node(
        self, broker: Broker, nodes: list[FakeNode], run_watcher: Callable[..., Any]
    ) -> None:
        watcher = await run_watcher(broker)
        watcher.fleet.max_nodes = 100
        nodes.append(FakeNode(broker.port, "real", interval=0.3).start())
        await until(lambda: watcher.fleet.nodes.get("real", None) is not None, what="real in")
        await until(lambda: watcher.fleet.nodes["real"].heartbeat_at is not None, what="beat")
        junk = [(f"{P}/junk-{i}/status", status("online", 1), False) for i in range(400)]
        await asyncio.to_thread(publish_many, broker.port, junk)
        await until(lambda: watcher.fleet.counters.messages["status"] >= 401, what="handled")
        assert "real" in watcher.fleet.nodes
        late = FakeNode(broker.port, "late", interval=0.3).start()
        nodes.append(late)
        await until(lambda: "late" in watcher.fleet.nodes, timeout=10, what="a new real node in")
        assert len(watcher.fleet.nodes) <= 100

    async def test_with_an_inventory_outsiders_are_counted(
        self, broker: Broker, nodes: list[FakeNode], run_watcher: Callable[..., Any]
    ) -> None:
        watcher = await run_watcher(broker, inventory=["real"])
        junk = [(f"{P}/junk-{i}/heartbeat", beat(), False) for i in range(200)]
        junk += [(f"{P}/junk-{i}/status", status("offline", 1), False) for i in range(200)]
        await asyncio.to_thread(publish_many, broker.port, junk)
        await until(
            lambda: sum(watcher.fleet.counters.messages.values()) >= 400, what="junk handled"
        )
        nodes.append(FakeNode(broker.port, "real", interval=0.3).start())
        await until(lambda: watcher.fleet.nodes["real"].online is True, what="real online")
        await asyncio.sleep(1.5)  # k intervals: the junk would be stale or dead by now
        assert list(watcher.fleet.nodes) == ["real"]
        assert raised_for(watcher, "junk-") == []
        body = await metrics(watcher)
        assert (
            metric_value(body, "gpuwarden_watch_ignored_messages_total", reason="outside_inventory")
            == 400
        )


class TestMetricsBoundedAndOffTheLoop:
    """Per-node series up to a limit, fleet totals always, rendered in a worker thread."""

    async def test_limit_and_totals(
        self,
        broker: Broker,
        run_watcher: Callable[..., Any],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        threads: list[int] = []
        real_render = watch_metrics.render

        def recording_render(*args: Any) -> bytes:
            threads.append(threading.get_ident())
            return real_render(*args)

        monkeypatch.setattr(watch_metrics, "render", recording_render)
        watcher = await run_watcher(broker, metrics_node_limit=50, default_interval=30.0)
        fleet_msgs: list[tuple[str, bytes, bool]] = []
        for i in range(1000):
            fleet_msgs.append((f"{P}/n{i}/status", status("online", 1), False))
            fleet_msgs.append((f"{P}/n{i}/heartbeat", beat(interval=30.0), False))
        fleet_msgs.append((f"{P}/n7/heartbeat", beat(seq=2, interval=30.0, health=["x"]), False))
        await asyncio.to_thread(publish_many, broker.port, fleet_msgs)
        await until(lambda: sum(watcher.fleet.counters.messages.values()) >= 2001, what="fleet in")
        body = await metrics(watcher)
        assert threads and threading.get_ident() not in threads
        per_node = {
            line.split('node="')[1].split('"')[0]
            for line in body.splitlines()
            if line.startswith("gpuwarden_watch_node_state{")
        }
        assert len(per_node) == 50
        assert "n7" in per_node  # the one in trouble is shown first
        assert metric_value(body, "gpuwarden_watch_nodes", state="online") == 1000
        assert metric_value(body, "gpuwarden_watch_node_series_omitted") == 950


class TestBrokerOutageIsOneAlert:
    """Broker down and back, agents reconnecting after the watcher: one alert, nothing else.

    Real agents: they come back later than the watcher (their backoff), and mosquitto sends
    their Wills as it shuts down. (Agents before e8d9535 also delivered the heartbeats queued
    during the outage, each saying "sink mqtt has not delivered": TestOutageAftermath in
    tests/test_watch_fleet.py holds the watcher to ignoring that.)
    """

    @pytest.mark.slow
    async def test_outage_and_aftermath(
        self, tmp_path: Path, broker: Broker, run_watcher: Callable[..., Any]
    ) -> None:
        agents = [AgentProcess(tmp_path / f"agent-{i}", node_id=f"agent-{i}") for i in range(2)]
        for agent in agents:
            agent.config_text = (
                f'[mqtt]\nenabled = true\nurl = "{broker.url}"\nkeepalive = 5\n'
                "reconnect_min = 4.0\nreconnect_max = 8.0\n"
                "[heartbeat]\ninterval = 1.0\nstale_after_intervals = 2\n"
            )
        try:
            for agent in agents:
                await asyncio.to_thread(agent.start)
            watcher = await run_watcher(
                broker,
                default_interval=1.0,
                reconnect_min=0.1,
                reconnect_max=0.3,
                evaluate_interval=0.1,
            )
            names = {"agent-0", "agent-1"}

            def all_ok() -> bool:
                fleet = watcher.fleet.nodes
                return names <= set(fleet) and all(fleet[n].health_ok for n in names)

            await until(all_ok, timeout=30, what="both agents beating and healthy")
            await asyncio.sleep(1.0)
            assert [c.alert.key for c in watcher.changes if c.raised] == []
            await asyncio.to_thread(broker.stop)
            await until(lambda: watcher.saw(True, "broker_unreachable"), what="broker alert")
            # Long enough for the agents' sinks to go stale, and for their backoff to grow past
            # the watcher's settling and k intervals: they come back after it has judged.
            await asyncio.sleep(6.0)
            await asyncio.to_thread(broker.start)
            await until(
                lambda: watcher.saw(False, "broker_unreachable"),
                timeout=40,
                what="the outage over",
            )
            heard = {n: watcher.fleet.nodes[n].seq for n in names}
            await until(
                lambda: all((watcher.fleet.nodes[n].seq or 0) > (heard[n] or 0) + 3 for n in names),
                timeout=30,
                what="a few heartbeats after the outage",
            )
            raised = [c.alert.key for c in watcher.changes if c.raised]
            assert raised == [("broker_unreachable", "")], (
                [(c.at, c.raised, c.alert.key, c.alert.message) for c in watcher.changes],
                agents[0].log(),
            )
        finally:
            for agent in agents:
                agent.stop()
