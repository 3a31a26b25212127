"""A paho-mqtt subscriber for the tests: records every message under a topic filter."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from agent.program import registry


@dataclass(frozen=True)
class Received:
    topic: str
    payload: bytes
    retain: bool
    qos: int

    def json(self) -> Any:
        return json.loads(self.payload)


@dataclass
class Subscriber:
    """Subscribes at QoS 1. `client_id` + `persistent`: a session the broker keeps (and queues
    for) while the subscriber is away, so nothing published meanwhile is missed."""

    port: int
    topic_filter: str = "gpuwarden/v1/#"
    client_id: str = ""
    persistent: bool = False
    reconnect_max: int = 120
    """Seconds between reconnects at most (paho's default): lower for a broker the test
    stops and starts again."""
    messages: list[Received] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _client: paho.Client | None = None

    def start(self, timeout: float = 10.0) -> Subscriber:
        client = paho.Client(
            CallbackAPIVersion.VERSION2, client_id=self.client_id, clean_session=not self.persistent
        )
        client.reconnect_delay_set(min(1, self.reconnect_max), self.reconnect_max)
        subscribed = threading.Event()
        client.on_message = lambda _c, _u, msg: self._record(msg)
        client.on_subscribe = lambda *_args: subscribed.set()
        client.on_connect = lambda c, *_args: c.subscribe(self.topic_filter, qos=1)
        client.connect("127.0.0.1", self.port, keepalive=10)
        client.loop_start()
        self._client = client
        if not subscribed.wait(timeout):
            raise TimeoutError(f"no SUBACK from the broker on port {self.port}")
        return self

    def _record(self, msg: paho.MQTTMessage) -> None:
        with self._lock:
            self.messages.append(
                Received(msg.topic, bytes(msg.payload), bool(msg.retain), int(msg.qos))
            )

    def stop(self) -> None:
        if self._client is not None:
            self._client.disconnect()
            self._client.loop_stop()
            self._client = None

    def on(self, suffix: str) -> list[Received]:
        with self._lock:
            return [m for m in self.messages if m.topic.endswith(suffix)]

    def wait_for(
        self, predicate: Callable[[Subscriber], bool], timeout: float = 20.0, what: str = "messages"
    ) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self):
                return
            time.sleep(0.05)
        with self._lock:
            seen = [(m.topic, m.payload[:120]) for m in self.messages[-10:]]
        raise TimeoutError(f"timed out waiting for {what}; last messages: {seen}")

    def event_ids(self) -> list[str]:
        return [str(m.json()["id"]) for m in self.on("/events")]


def persistent_broker_lines(workdir: Any) -> list[str]:
    """mosquitto.conf lines that keep sessions and queued QoS 1 messages across a restart
    (the later `persistence` line overrides the generated `persistence false`). Started as
    root, mosquitto switches to its own user and then cannot write the test's private temporary
    folder: `user root` keeps it (the option does nothing for a non-root user)."""
    return ["persistence true", f"persistence_location {workdir}/", "user root"]


@dataclass
class InProcessAgent:
    """A Runtime with the MQTT sink on, in the test's own event loop."""

    state_dir: Any
    mqtt: dict[str, Any]
    heartbeat_interval: float = 0.5
    extra: dict[str, Any] = field(default_factory=dict)
    runtime: Any = None
    store: Any = None
    """A StateStore opened beforehand (as `gpuwarden run` does, off the loop); else opened here."""

    async def start(self) -> Any:
        from agent.program import config_file as config_module
        from agent.runtime.core import Runtime
        from agent.runtime.state import StateStore

        # This machine's kernel log is no finding of the agent under test: what other tests
        # made it say (a real segfault, each its own event) would fill a bounded outbox.
        collectors = dict(self.extra.get("collectors", {}))
        kernel_log = dict(collectors.get("kernel_log", {}))
        if "path" not in kernel_log:
            Path(self.state_dir).mkdir(parents=True, exist_ok=True)
            empty = Path(self.state_dir) / "kern.log"
            empty.touch()
            kernel_log["path"] = str(empty)
        collectors["kernel_log"] = kernel_log
        cfg = config_module.parse(
            {
                "node_id": "node-a",
                "state_dir": str(self.state_dir),
                "prometheus": {"enabled": False},
                "heartbeat": {"interval": self.heartbeat_interval},
                "mqtt": {
                    "enabled": True,
                    "reconnect_min": 0.1,
                    "reconnect_max": 0.5,
                    "connect_timeout": 3.0,
                    **self.mqtt,
                },
                **self.extra,
                "collectors": collectors,
            }
        )
        self.runtime = Runtime(
            cfg,
            self.store or StateStore.open(cfg.state_dir),
            collectors=registry.COLLECTORS,
            sinks=registry.SINKS,
        )
        await self.runtime.start()
        return self.runtime

    async def stop(self) -> None:
        if self.runtime is not None:
            await self.runtime.stop()
            self.runtime.store.close()
            self.runtime = None

    def events_of(self, kind: str) -> list[Any]:
        return [e for e in self.runtime.recent_events if e.kind == kind]
