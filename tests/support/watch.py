"""Helpers for the watcher's tests: fake node subprocesses, an alerts listener, HTTP GET."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class FakeNode:
    port: int
    node: str
    bdseq: int = 1
    interval: float = 0.3
    keepalive: int = 5
    process: subprocess.Popen[str] | None = None

    def start(self) -> FakeNode:
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.support.fake_node",
                "--port",
                str(self.port),
                "--node",
                self.node,
                "--bdseq",
                str(self.bdseq),
                "--interval",
                str(self.interval),
                "--keepalive",
                str(self.keepalive),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"fake node {self.node} did not start: {line!r}")
        return self

    def signal(self, signum: int) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
            self.process.wait(5)


@dataclass
class AlertListener:
    """Collects what the watcher publishes on its alerts topic (paho, its own thread)."""

    port: int
    topic: str
    received: list[dict[str, Any]] = field(default_factory=list)

    def start(self) -> AlertListener:
        self.client = mqtt.Client(CallbackAPIVersion.VERSION2)
        self.client.on_message = lambda c, u, m: self.received.append(json.loads(m.payload))
        self.client.connect("127.0.0.1", self.port)
        self.client.subscribe(self.topic, qos=1)
        self.client.loop_start()
        return self

    def stop(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()

    def events(self, kind: str, node: str = "") -> list[str]:
        return [a["event"] for a in self.received if a["kind"] == kind and a["node"] == node]


def publish(port: int, topic: str, payload: bytes, retain: bool = False) -> None:
    client = mqtt.Client(CallbackAPIVersion.VERSION2)
    client.connect("127.0.0.1", port)
    client.loop_start()
    client.publish(topic, payload, qos=1, retain=retain).wait_for_publish(5)
    client.disconnect()
    client.loop_stop()


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()


def metric_value(text: str, name: str, **labels: str) -> float | None:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        metric, _, rest = series.partition("{")
        got = ",".join(sorted(rest.rstrip("}").split(","))) if rest else ""
        if metric == name and got == want:
            return float(value)
    return None
