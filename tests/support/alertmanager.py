"""A real Alertmanager (Debian prometheus-alertmanager) on free loopback ports, alone or as a
peered cluster, and the webhook receiver its notifications go to (an HTTP server of the test)."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.program.watch.alertmanager import AlertmanagerSender
from agent.program.watch.settings import WatchSettings
from tests.support.ports import free_port, wait_for_port

ROOT = Path(__file__).resolve().parents[2]
ALERTMANAGER = shutil.which("prometheus-alertmanager") or "/usr/bin/prometheus-alertmanager"
AMTOOL = shutil.which("amtool") or "/usr/bin/amtool"
SHIPPED = ROOT / "configs/alertmanager/alertmanager.yml"


@dataclass(frozen=True)
class Notification:
    received: float
    """time.time() when the webhook got it."""
    body: Any
    path: str = "/"
    authorization: str | None = None

    @property
    def receiver(self) -> str:
        return str(self.body.get("receiver", ""))

    def alerts(self, status: str | None = None) -> list[dict[str, Any]]:
        # A webhook notification has {"alerts": [...]}; a post in the v2 API's shape (this
        # server standing in for an Alertmanager) is the list itself.
        alerts: list[dict[str, Any]] = (
            self.body if isinstance(self.body, list) else self.body.get("alerts", [])
        )
        return [a for a in alerts if status is None or a.get("status") == status]


class WebhookReceiver:
    """Collects every notification Alertmanager posts to it (webhook_configs), in a thread."""

    def __init__(self) -> None:
        self.notifications: list[Notification] = []
        self.status = 200
        """What it answers (a stand-in for a member that refuses, fails or redirects)."""
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length))
                got = Notification(time.time(), body, self.path, self.headers["Authorization"])
                with receiver._lock:
                    receiver.notifications.append(got)
                self.send_response(receiver.status)
                if 300 <= receiver.status < 400:
                    self.send_header("Location", "/elsewhere")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.server.server_address[1])
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def start(self) -> WebhookReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def received(self) -> list[Notification]:
        with self._lock:
            return list(self.notifications)

    def matching(self, status: str, **labels: str) -> list[Notification]:
        """Notifications with at least one alert of this status carrying these labels."""
        return [
            n
            for n in self.received()
            if any(
                all(a["labels"].get(k) == v for k, v in labels.items()) for a in n.alerts(status)
            )
        ]


def hook_config(
    webhook_url: str,
    group_wait: str = "200ms",
    group_interval: str = "1s",
    inhibit: list[dict[str, Any]] | None = None,
) -> str:
    """A one-route configuration: every alert to the webhook, grouped as the shipped one."""
    config: dict[str, Any] = {
        "global": {"resolve_timeout": "5m"},
        "route": {
            "receiver": "hook",
            "group_by": ["alertname", "node"],
            "group_wait": group_wait,
            "group_interval": group_interval,
            "repeat_interval": "1h",
        },
        "receivers": [
            {"name": "hook", "webhook_configs": [{"url": webhook_url, "send_resolved": True}]}
        ],
    }
    if inhibit:
        config["inhibit_rules"] = inhibit
    return yaml.safe_dump(config)


def shipped_config(webhook_url: str, group_wait: str = "200ms", group_interval: str = "1s") -> str:
    """configs/alertmanager/alertmanager.yml with every receiver's URL pointed at the webhook
    and the waits shortened: its routes and inhibit rules, for real."""
    config: dict[str, Any] = yaml.safe_load(SHIPPED.read_text())

    def shorten(route: dict[str, Any]) -> None:
        if "group_wait" in route or route is config["route"]:
            route["group_wait"] = group_wait
        if "group_interval" in route or route is config["route"]:
            route["group_interval"] = group_interval
        for child in route.get("routes", []):
            shorten(child)

    shorten(config["route"])
    for receiver in config["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = f"{webhook_url.rstrip('/')}/{receiver['name']}"
    return yaml.safe_dump(config)


@dataclass
class AlertmanagerServer:
    workdir: Path
    config_text: str
    port: int = field(default_factory=free_port)
    cluster_port: int | None = None
    """None: no cluster (--cluster.listen-address=""), a single Alertmanager."""
    peers: list[int] = field(default_factory=list)
    web_config: str = ""
    """The text of a --web.config.file (TLS, basic auth); empty: none."""
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "alertmanager.log"

    def start(self) -> AlertmanagerServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "alertmanager.yml"
        config.write_text(self.config_text)
        cluster = [f"--cluster.listen-address={self._cluster_address()}"]
        if self.web_config:
            (self.workdir / "web.yml").write_text(self.web_config)
            cluster.append(f"--web.config.file={self.workdir / 'web.yml'}")
        if self.cluster_port is not None:
            cluster += [
                f"--cluster.advertise-address=127.0.0.1:{self.cluster_port}",
                # Short gossip: the cluster settles (and notifies) in about a second, and
                # the second member waits peer-timeout for the first one's notification log.
                "--cluster.gossip-interval=50ms",
                "--cluster.pushpull-interval=1s",
                "--cluster.peer-timeout=5s",
                *(f"--cluster.peer=127.0.0.1:{p}" for p in self.peers),
            ]
        self.process = subprocess.Popen(
            [
                ALERTMANAGER,
                f"--config.file={config}",
                f"--storage.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=debug",
                *cluster,
            ],
            cwd=self.workdir,
            stdout=subprocess.DEVNULL,
            stderr=self.log_path.open("ab"),
        )
        wait_for_port(self.port, timeout=30)
        if not self.web_config:  # behind TLS or a password /-/ready needs them: the port will do
            self.wait_ready()
        return self

    def _cluster_address(self) -> str:
        return "" if self.cluster_port is None else f"127.0.0.1:{self.cluster_port}"

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"alertmanager exited:\n{self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"Alertmanager not ready after {timeout} s:\n{self.log()}")
            time.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self.process = None

    def alerts(self) -> list[dict[str, Any]]:
        """GET /api/v2/alerts: what it holds now (active, silenced and inhibited)."""
        with urllib.request.urlopen(f"{self.url}/api/v2/alerts", timeout=5) as response:
            alerts: list[dict[str, Any]] = json.load(response)
        return alerts


def cluster(workdir: Path, config_text: str, size: int = 2) -> list[AlertmanagerServer]:
    """`size` peered members; the caller stops them."""
    ports = [free_port() for _ in range(size)]
    members = []
    for i, port in enumerate(ports):
        member = AlertmanagerServer(
            workdir / f"am{i}",
            config_text,
            cluster_port=port,
            peers=[p for p in ports if p != port],
        )
        members.append(member)
    for member in members:
        member.start()
    return members


def amtool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [AMTOOL, *map(str, args)], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.fixture
def webhook() -> Iterator[WebhookReceiver]:
    """A started WebhookReceiver (tests/conftest.py makes it every test's fixture)."""
    receiver = WebhookReceiver().start()
    yield receiver
    receiver.stop()


def stamp(text: str) -> float:
    """An RFC 3339 time as Alertmanager writes it (`...Z`) -> seconds since the epoch."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def hooked_server(workdir: Path, webhook: WebhookReceiver) -> AlertmanagerServer:
    """A started Alertmanager that notifies `webhook` (stop it when done)."""
    return AlertmanagerServer(workdir, hook_config(webhook.url)).start()


async def started_sender(url: str, resend: float) -> AlertmanagerSender:
    """The watcher's sender to one member on `time.time` (as the Watcher makes it: a test's
    stepped or skewed clock is the one it reads), started; `await sender.stop()` when done."""
    settings = WatchSettings(
        url="mqtt://127.0.0.1:1883", alertmanager_urls=(url,), alertmanager_resend_interval=resend
    )
    sender = AlertmanagerSender(settings, time.time)
    sender.start()
    return sender
