"""The watcher posts its alerts to a real Alertmanager (Debian prometheus-alertmanager).

The sender against real Alertmanagers on loopback: labels and annotations as posted, cleared
as resolved, one member down (the other still gets every alert, the failure counted and logged
once, the member served again once it is back), a member that hangs (the event loop does not
wait), a restarted member (the periodic re-send fills it again), basic auth over TLS, a bearer
token, and a bounded queue. The settings refuse what cannot work, naming the key.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import bcrypt
import pytest
import structlog
import yaml

from agent.contracts.errors import ConfigError
from agent.contracts.model import RepairAction, Severity
from agent.contracts.settings import build
from agent.program import config_loader
from agent.program.watch import alertmanager as am
from agent.program.watch.alertmanager import AlertmanagerSender, Entry, Member
from agent.program.watch.fleet import ALERT_KINDS, SETTLE_SECONDS, Alert, AlertChange, Fleet
from agent.program.watch.metrics import MetricsServer
from agent.program.watch.settings import WatchSettings
from exporters.mqtt_client import Backoff
from tests.support.alertmanager import (
    SHIPPED,
    AlertmanagerServer,
    WebhookReceiver,
    amtool,
    hook_config,
    shipped_config,
)
from tests.support.mosquitto import Broker, secret_file
from tests.support.ports import free_port
from tests.support.rules import RULES
from tests.support.tls import Authority
from tests.support.waiting import until

T0 = 1_700_000_000.0
ROOT = Path(__file__).resolve().parents[1]
DOC = Path(__file__).resolve().parents[1] / "docs/metrics.md"


def settings(*urls: str, **overrides: object) -> WatchSettings:
    values: dict[str, object] = {
        "alertmanager_urls": urls,
        "reconnect_min": 0.1,
        "reconnect_max": 0.5,
        "alertmanager_timeout": 2.0,
        "alertmanager_runbook_url": "https://runbooks.example/gpuwarden/{alertname}#{node}",
    }
    values.update(overrides)
    return WatchSettings(**values)  # type: ignore[arg-type]


def dead(node: str, since: float | None = None) -> Alert:
    return Alert("node_dead", node, Severity.CRITICAL, f"{node} died", "look", since or time.time())


def raised(alert: Alert) -> AlertChange:
    return AlertChange(True, alert, alert.since)


def cleared(alert: Alert) -> AlertChange:
    return AlertChange(False, alert, time.time())


def held(server: AlertmanagerServer, **labels: str) -> list[dict[str, Any]]:
    """The alerts the member holds with these labels (GET /api/v2/alerts)."""
    return [a for a in server.alerts() if all(a["labels"].get(k) == v for k, v in labels.items())]


async def holds(server: AlertmanagerServer, **labels: str) -> bool:
    return bool(await asyncio.to_thread(held, server, **labels))


async def wait_held(server: AlertmanagerServer, timeout: float = 20.0, **labels: str) -> None:
    deadline = time.monotonic() + timeout
    while not await holds(server, **labels):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{server.url} never held {labels}:\n{server.log()[-2000:]}")
        await asyncio.sleep(0.1)


@pytest.fixture
def servers() -> Iterator[list[AlertmanagerServer]]:
    started: list[AlertmanagerServer] = []
    yield started
    for server in started:
        server.stop()


@pytest.fixture
def alertmanager(
    tmp_path: Path, webhook: WebhookReceiver, servers: list[AlertmanagerServer]
) -> AlertmanagerServer:
    server = AlertmanagerServer(tmp_path / "am", hook_config(webhook.url)).start()
    servers.append(server)
    return server


@pytest.fixture
async def senders() -> AsyncIterator[list[AlertmanagerSender]]:
    made: list[AlertmanagerSender] = []
    yield made
    for sender in made:
        await sender.stop()


def started(made: list[AlertmanagerSender], config: WatchSettings) -> AlertmanagerSender:
    sender = AlertmanagerSender(config)
    sender.start()
    made.append(sender)
    return sender


class TestSettings:
    """What cannot work is refused as the configuration loads, naming file and key."""

    @pytest.mark.parametrize(
        ("urls", "expected"),
        [
            (["ftp://am:9093"], "expected http://host:port"),
            (["http://user:pw@am:9093"], "no user or password in the URL"),
            (["http://am:9093?x=1"], "no query or fragment"),
            (["http://:9093"], "expected http://host:port"),
            (["http://am:0"], "port must be 1-65535"),
            (["http://am:99999"], "not a valid URL"),
            (["http://am:9093", "http://am:9093"], "named twice"),
        ],
    )
    def test_bad_urls(self, tmp_path: Path, urls: list[str], expected: str) -> None:
        path = tmp_path / "gpuwarden.toml"
        path.write_text(f"[watch]\nalertmanager_urls = {urls!r}\n".replace("'", '"'))
        with pytest.raises(ConfigError) as info:
            config_loader.load(path, config_loader.Schema(sections={"watch": WatchSettings}))
        assert str(path) in str(info.value)
        assert "watch.alertmanager_urls" in str(info.value)
        assert expected in str(info.value)
        assert "pw" not in str(info.value)

    def test_bad_combinations(self, tmp_path: Path) -> None:
        secret = secret_file(tmp_path / "secret", "s3cret")
        cases: list[tuple[dict[str, object], str]] = [
            ({"alertmanager_password_file": secret}, "alertmanager_password_file"),
            (
                {"alertmanager_username": "u", "alertmanager_bearer_token_file": secret},
                "alertmanager_bearer_token_file",
            ),
            ({"alertmanager_ca_file": secret}, "alertmanager_ca_file"),
            ({"alertmanager_runbook_url": "https://x/{host}"}, "alertmanager_runbook_url"),
            ({"alertmanager_resend_interval": 0.5}, "alertmanager_resend_interval"),
        ]
        for table, key in cases:
            values = {"alertmanager_urls": ["http://am:9093"], **table}
            values = {k: str(v) if isinstance(v, Path) else v for k, v in values.items()}
            with pytest.raises(ConfigError) as info:
                build(WatchSettings, values, "watch")
            assert info.value.key == f"watch.{key}", (table, info.value)

    def test_secrets_must_be_private(self, tmp_path: Path) -> None:
        for key in ("alertmanager_password_file", "alertmanager_bearer_token_file"):
            secret = secret_file(tmp_path / f"{key}.txt", "s3cret")
            secret.chmod(0o644)
            user = 'alertmanager_username = "u"\n' if "password" in key else ""
            path = tmp_path / "gpuwarden.toml"
            path.write_text(
                f'[watch]\nalertmanager_urls = ["http://am:9093"]\n{user}{key} = "{secret}"\n'
            )
            with pytest.raises(ConfigError) as info:
                config_loader.load(path, config_loader.Schema(sections={"watch": WatchSettings}))
            assert f"watch.{key}" in str(info.value)
            assert "chmod 600" in str(info.value)


class TestPayload:
    """Labels two watchers agree on; the v2 API's shape."""

    def test_every_kind_has_a_distinct_valid_alertname(self) -> None:
        names = [am.alertname(kind) for kind in ALERT_KINDS]
        assert len(set(names)) == len(names)
        for name in names:
            assert name.startswith("Gpuwarden") and name.isidentifier(), name
        assert am.alertname("node_dead") == "GpuwardenNodeDead"

    def test_two_watchers_produce_identical_labels(self) -> None:
        """The same messages, received a little apart by two watchers: the same label sets
        (Alertmanager's fingerprint), whatever the times and the wording."""

        def watch(offset: float) -> set[tuple[tuple[str, str], ...]]:
            fleet = Fleet(inventory=("gone", "hung", "never", "talker"), now=T0 + offset)
            fleet.broker_connected(T0 + offset)
            for node in ("gone", "hung", "talker"):
                fleet.ingest(
                    f"gpuwarden/v1/{node}/status",
                    b'{"state": "online", "bdseq": 1, "ts": 1700000000}',
                    False,
                    T0 + offset,
                )
                fleet.ingest(
                    f"gpuwarden/v1/{node}/heartbeat",
                    b'{"seq": 1, "ts": 1700000000, "interval_s": 1, "health": "ok"}',
                    False,
                    T0 + offset,
                )
            fleet.ingest(
                "gpuwarden/v1/gone/status", b'{"state": "offline", "bdseq": 1}', False, T0 + 5
            )
            later = T0 + SETTLE_SECONDS + 10 + offset
            fleet.ingest(  # someone still talks: these are node alerts, not a fleet silence
                "gpuwarden/v1/talker/heartbeat",
                b'{"seq": 2, "ts": 1700000012, "interval_s": 1, "health": "ok"}',
                False,
                later - 0.5,
            )
            fleet.evaluate(later)
            return {tuple(sorted(am.labels_of(a).items())) for a in fleet.active.values()}

        one, other = watch(0.0), watch(0.7)
        assert one == other
        kinds = {dict(labels)["kind"] for labels in one}
        assert kinds == {"node_dead", "node_stale", "node_missing"}

    def test_post_body(self) -> None:
        alert = dead("n1", since=T0)
        body = am.post_body(alert, None, "https://rb/{kind}/{node}#{anchor}")
        assert body["labels"] == {
            "alertname": "GpuwardenNodeDead",
            "node": "n1",
            "severity": "critical",
            "kind": "node_dead",
            "repair_action": RepairAction.INVESTIGATE.value,
        }
        assert body["annotations"] == {
            "summary": "n1 died",
            "action": "look",
            "runbook_url": "https://rb/node_dead/n1#gpuwardennodedead",
        }
        assert body["startsAt"] == "2023-11-14T22:13:20.000Z"
        assert "endsAt" not in body
        resolved = am.post_body(alert, T0 - 5, "")
        assert resolved["endsAt"] == resolved["startsAt"]  # never before it started
        assert "runbook_url" not in resolved["annotations"]  # type: ignore[operator]
        broker = Alert("broker_unreachable", "", Severity.CRITICAL, "m", "a", T0)
        assert "node" not in am.post_body(broker, None, "")["labels"]  # type: ignore[operator]

    def test_queue_is_bounded_and_keeps_one_entry_per_alert(self) -> None:
        member = Member("http://am:9093", Backoff(0.1, 0.5), limit=3)
        for node in ("a", "b", "c", "d", "e"):
            member.queue(("node_dead", node), Entry(dead(node), None))
        assert [key[1] for key in member.pending] == ["c", "d", "e"]
        assert member.dropped == 2
        member.queue(("node_dead", "c"), Entry(dead("c"), T0))  # a change: replaces its entry
        assert [key[1] for key in member.pending] == ["d", "e", "c"]
        assert member.pending[("node_dead", "c")].ends_at == T0
        assert member.dropped == 2


class TestConfigs:
    """The shipped examples pass the real tools."""

    def test_alertmanager_example_passes_amtool(self) -> None:
        done = amtool("check-config", SHIPPED)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "2 inhibit rules" in done.stdout

    def test_routes_by_severity(self) -> None:
        """The watcher's own posts by severity; every rule of the shipped rules file to the
        pager or the queue by its severity, except the rules that copy the watcher's alerts
        from its /metrics (the watcher posts those itself): those, and only those, discarded."""
        cases = [
            (labels_of_kind(kind, severity), f"gpuwarden-{route}")
            for kind in ALERT_KINDS
            for severity, route in (("critical", "pager"), ("warning", "queue"))
        ]
        rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
        for rule in rules:
            labels = {"alertname": rule["alert"], **rule.get("labels", {})}
            severity = labels["severity"]
            copies = "gpuwarden_watch_alert_active" in rule["expr"]
            labels["job"] = (
                "gpuwarden-watch" if "gpuwarden-watch" in rule["expr"] or copies else "gpuwarden"
            )
            kinds = re.findall(r'kind=~?"([^"]+)"', rule["expr"])
            for kind in kinds[0].split("|") if kinds else [labels.get("kind", "")]:
                case = {**labels, "kind": kind} if kind else labels
                route = (
                    "discard"
                    if copies
                    else f"gpuwarden-{'pager' if severity == 'critical' else 'queue'}"
                )
                cases.append((case, route))
        discarded = {labels["kind"] for labels, route in cases if route == "discard"}
        assert discarded and discarded <= set(ALERT_KINDS)  # the copies: watcher kinds only
        for labels, receiver in cases:
            args = [f"{k}={v}" for k, v in labels.items()]
            done = amtool("config", "routes", "test", f"--config.file={SHIPPED}", *args)
            assert done.returncode == 0, done.stdout + done.stderr
            assert done.stdout.strip() == receiver, (labels, done.stdout)

    def test_prometheus_example_alerts_to_alertmanager(self) -> None:
        from tests.support.rules import SCRAPE_CONFIG, promtool

        done = promtool("check", "config", SCRAPE_CONFIG)
        assert done.returncode == 0, done.stdout + done.stderr
        config = yaml.safe_load(SCRAPE_CONFIG.read_text())
        targets = config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
        assert len(targets) >= 2  # every member of the cluster, as the watcher names them


class TestMetrics:
    """The sender's series in the watcher's /metrics: promtool-clean, documented."""

    async def test_exposition(self, senders: list[AlertmanagerSender]) -> None:
        down = f"http://127.0.0.1:{free_port()}"
        sender = started(senders, settings(down))
        sender.change(raised(dead("n1")))
        await until(lambda: sender.members[0].failures["connect"] >= 1, what="a failure")
        server = MetricsServer(Fleet(now=T0), "127.0.0.1", 0, extra=sender.families)
        text = server.render_now().decode()
        assert f'gpuwarden_watch_alertmanager_up{{url="{down}"}} 0.0' in text
        assert f'gpuwarden_watch_alertmanager_pending_alerts{{url="{down}"}} 1.0' in text
        assert re.search(
            rf'gpuwarden_watch_alertmanager_failures_total{{reason="connect",url="{down}"}} [1-9]',
            text,
        ), text
        done = subprocess.run(
            [shutil.which("promtool") or "/usr/bin/promtool", "check", "metrics"],
            input=text,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        documented = DOC.read_text()
        for name in set(re.findall(r"^# TYPE (gpuwarden_watch_alertmanager_\S+)", text, re.M)):
            base = name.removesuffix("_total")
            assert f"`{name}`" in documented or f"`{base}_total`" in documented, name


def labels_of_kind(kind: str, severity: str) -> dict[str, str]:
    level = Severity.CRITICAL if severity == "critical" else Severity.WARNING
    return am.labels_of(Alert(kind, "n1", level, "m", "a", T0))


class TestSender:
    async def test_raise_then_clear(
        self,
        alertmanager: AlertmanagerServer,
        webhook: WebhookReceiver,
        senders: list[AlertmanagerSender],
    ) -> None:
        sender = started(senders, settings(alertmanager.url))
        alert = dead("n1")
        sender.change(raised(alert))
        await wait_held(alertmanager, alertname="GpuwardenNodeDead", node="n1")
        [got] = await asyncio.to_thread(held, alertmanager, node="n1")
        assert got["annotations"] == {
            "summary": "n1 died",
            "action": "look",
            "runbook_url": "https://runbooks.example/gpuwarden/GpuwardenNodeDead#n1",
        }
        assert got["labels"]["repair_action"] == "investigate"
        await until(lambda: bool(webhook.matching("firing", node="n1")), what="firing")
        sender.change(cleared(alert))
        await until(
            lambda: bool(webhook.matching("resolved", node="n1")), what="resolved notification"
        )
        assert len(webhook.matching("firing", node="n1")) == 1

    async def test_one_member_down(
        self,
        tmp_path: Path,
        alertmanager: AlertmanagerServer,
        servers: list[AlertmanagerServer],
        senders: list[AlertmanagerSender],
    ) -> None:
        """The other member gets every alert at once; the down one is counted per attempt,
        logged once, and served once it is back (retried, with backoff)."""
        down = free_port()
        with structlog.testing.capture_logs() as logs:
            sender = started(senders, settings(f"http://127.0.0.1:{down}", alertmanager.url))
            for node in ("n1", "n2"):
                sender.change(raised(dead(node)))
            await wait_held(alertmanager, node="n1")
            await wait_held(alertmanager, node="n2")
            late = sender.members[0]
            await until(lambda: late.failures["connect"] >= 3, what="several retries")
            failed = [e for e in logs if e.get("url", "").startswith(f"http://127.0.0.1:{down}")]
            assert [e["reason"] for e in failed] == ["connect"], failed  # once per outage
            assert len(late.pending) == 2
            server = AlertmanagerServer(tmp_path / "late", hook_config("http://127.0.0.1:1/"))
            server.port = down
            servers.append(await asyncio.to_thread(server.start))
            await wait_held(server, node="n1")
            await wait_held(server, node="n2")
            await until(lambda: not late.pending, what="the queue emptied")
        assert any(e["event"] == "Alertmanager member reachable again" for e in logs)
        families = {f.name: samples for f, samples in sender.families()}
        up = {s.labels["url"]: s.value for s in families["gpuwarden_watch_alertmanager_up"]}
        assert up == {f"http://127.0.0.1:{down}": 1.0, alertmanager.url: 1.0}

    async def test_restarted_member_gets_active_alerts_again(
        self,
        tmp_path: Path,
        alertmanager: AlertmanagerServer,
        senders: list[AlertmanagerSender],
    ) -> None:
        """Alertmanager keeps alerts in memory: a restarted member knows nothing until the
        next periodic re-send (without one it would also resolve them after resolve_timeout)."""
        sender = started(senders, settings(alertmanager.url, alertmanager_resend_interval=1.0))
        sender.change(raised(dead("n1")))
        await wait_held(alertmanager, node="n1")
        await asyncio.to_thread(alertmanager.stop)
        alertmanager.workdir = tmp_path / "fresh"
        await asyncio.to_thread(alertmanager.start)
        assert not await holds(alertmanager, node="n1")
        await wait_held(alertmanager, node="n1", timeout=10)

    async def test_hung_member_blocks_neither_the_loop_nor_the_other(
        self,
        alertmanager: AlertmanagerServer,
        senders: list[AlertmanagerSender],
    ) -> None:
        with socket.socket() as hung:  # accepts connections (backlog), never answers
            hung.bind(("127.0.0.1", 0))
            hung.listen(16)
            url = f"http://127.0.0.1:{hung.getsockname()[1]}"
            sender = started(senders, settings(url, alertmanager.url, alertmanager_timeout=1.0))
            loop = asyncio.get_running_loop()
            lags: list[float] = []
            for i in range(20):
                before = loop.time()
                sender.change(raised(dead(f"n{i}")))
                await asyncio.sleep(0.05)
                lags.append(loop.time() - before - 0.05)
            await wait_held(alertmanager, node="n19")
            assert max(lags) < 0.5, lags  # a gross bound: nothing on the loop waits on a post
            await until(
                lambda: sender.members[0].failures["timeout"] >= 1, timeout=10, what="timeout"
            )
            assert len(sender.members[0].pending) == 20

    async def test_basic_auth_over_tls(
        self,
        tmp_path: Path,
        webhook: WebhookReceiver,
        servers: list[AlertmanagerServer],
        senders: list[AlertmanagerSender],
    ) -> None:
        ca = Authority(tmp_path / "pki").create()
        cert = ca.issue("localhost", dns_names=("localhost",))
        digest = bcrypt.hashpw(b"right", bcrypt.gensalt(rounds=4)).decode()
        web = yaml.safe_dump(
            {
                "tls_server_config": {"cert_file": str(cert.cert), "key_file": str(cert.key)},
                "basic_auth_users": {"watch": digest},
            }
        )
        server = AlertmanagerServer(tmp_path / "am", hook_config(webhook.url), web_config=web)
        servers.append(await asyncio.to_thread(server.start))
        url = f"https://localhost:{server.port}"
        wrong = secret_file(tmp_path / "wrong", "wrong")
        right = secret_file(tmp_path / "right", "right")
        auth = {"alertmanager_username": "watch", "alertmanager_ca_file": ca.cert}
        refused = started(senders, settings(url, alertmanager_password_file=wrong, **auth))
        refused.change(raised(dead("refused")))
        await until(lambda: refused.members[0].failures["unauthorized"] >= 1, what="401")
        untrusted = started(senders, settings(url))  # the system CAs do not know this one
        untrusted.change(raised(dead("untrusted")))
        await until(lambda: untrusted.members[0].failures["tls"] >= 1, what="TLS refused")
        sender = started(senders, settings(url, alertmanager_password_file=right, **auth))
        sender.change(raised(dead("n1")))
        await until(lambda: sender.members[0].sent >= 1, what="delivered")
        await until(lambda: bool(webhook.matching("firing", node="n1")), what="notified")
        assert not webhook.matching("firing", node="refused")
        assert not webhook.matching("firing", node="untrusted")

    async def test_bearer_token(
        self, tmp_path: Path, webhook: WebhookReceiver, senders: list[AlertmanagerSender]
    ) -> None:
        """Alertmanager itself takes no bearer tokens (a proxy in front of it does): the
        header is checked on a stand-in that records what it is sent."""
        token = secret_file(tmp_path / "token", "t0ken")
        sender = started(
            senders, settings(webhook.url.rstrip("/"), alertmanager_bearer_token_file=token)
        )
        sender.change(raised(dead("n1")))
        await until(lambda: _posted(webhook, "n1"), what="the post")
        posts = [n for n in webhook.received() if n.path == am.API_PATH]
        assert posts
        assert {n.authorization for n in posts} == {"Bearer t0ken"}


class TestAnswers:
    """Each kind of answer from a member: what is retried, what is dropped."""

    @pytest.mark.parametrize(
        ("status", "reason", "kept"),
        [
            (400, "rejected", False),  # invalid as sent: the same body would fail forever
            (401, "unauthorized", True),
            (403, "unauthorized", True),
            (429, "server_error", True),
            (500, "server_error", True),
            (503, "server_error", True),
            (302, "error", True),  # urllib would have re-sent it as a GET, without the alerts
        ],
    )
    async def test_status(
        self,
        webhook: WebhookReceiver,
        senders: list[AlertmanagerSender],
        monkeypatch: pytest.MonkeyPatch,
        *,
        status: int,
        reason: str,
        kept: bool,
    ) -> None:
        # A proxy from the environment is not used for the cluster's own Alertmanagers.
        monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{free_port()}")
        webhook.status = status
        sender = started(senders, settings(webhook.url.rstrip("/")))
        sender.change(raised(dead("n1")))
        member = sender.members[0]
        await until(lambda: member.failures[reason] >= 1, what=f"{status} counted as {reason}")
        assert sum(member.failures.values()) == member.failures[reason]
        assert bool(member.pending) is kept
        assert member.dropped == (0 if kept else 1)
        assert all(n.path == am.API_PATH for n in webhook.received())
        webhook.status = 200
        if kept:  # retried until the member takes it
            await until(lambda: not member.pending, what="delivered once the member is fine")


class TestBug:
    async def test_a_failing_post_does_not_end_the_member(
        self,
        alertmanager: AlertmanagerServer,
        senders: list[AlertmanagerSender],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """An unexpected exception in a post (a bug) is counted as `error`, logged, retried:
        the member's task goes on."""
        calls: list[str] = []
        real = am.post

        def flaky(url: str, body: bytes, auth: am.Auth, timeout: float) -> None:
            calls.append(url)
            if len(calls) <= 2:
                raise RuntimeError("a bug")
            real(url, body, auth, timeout)

        monkeypatch.setattr(am, "post", flaky)
        sender = started(senders, settings(alertmanager.url))
        sender.change(raised(dead("n1")))
        await wait_held(alertmanager, node="n1")
        assert sender.members[0].failures["error"] == 2


class TestExit:
    async def test_a_hung_member_does_not_hold_the_exit(
        self, tmp_path: Path, broker: Broker
    ) -> None:
        """`gpuwarden watch` with a member that accepts and never answers, and a timeout of a
        minute: SIGTERM ends it within systemd's TimeoutStopSec (10 s), the post abandoned."""
        with socket.socket() as hung:
            hung.bind(("127.0.0.1", 0))
            hung.listen(16)
            config = tmp_path / "gpuwarden.toml"
            config.write_text(
                f'[watch]\nurl = "{broker.url}"\nlisten = ""\n'
                f'alertmanager_urls = ["http://127.0.0.1:{hung.getsockname()[1]}"]\n'
                "alertmanager_timeout = 60.0\n"
            )
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "agent",
                "watch",
                "--config",
                str(config),
                cwd=ROOT,
                stdout=asyncio.subprocess.PIPE,  # the log
                stderr=asyncio.subprocess.DEVNULL,
            )
            assert process.stdout is not None
            try:
                while b"watching" not in await asyncio.wait_for(process.stdout.readline(), 20):
                    pass
                await asyncio.sleep(1.0)  # the first post is in flight, stuck on the socket
                began = time.monotonic()
                process.send_signal(signal.SIGTERM)
                code = await asyncio.wait_for(process.wait(), 30)
                assert code == 0
                assert time.monotonic() - began < 10.0  # a gross bound: not the 60 s timeout
            finally:
                if process.returncode is None:
                    process.kill()
                    await process.wait()


def _posted(webhook: WebhookReceiver, node: str) -> bool:
    return any(a["labels"].get("node") == node for n in webhook.received() for a in n.alerts())


def post_alerts(server: AlertmanagerServer, alerts: list[dict[str, Any]]) -> None:
    """What a Prometheus or a watcher does: POST /api/v2/alerts."""
    request = urllib.request.Request(
        f"{server.url}/api/v2/alerts",
        data=json.dumps(alerts).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert answer.status == 200


class TestGrouping:
    """The shipped routes, for real: one fault's alerts reach a person as one notification."""

    async def test_one_page_per_node(
        self, tmp_path: Path, webhook: WebhookReceiver, servers: list[AlertmanagerServer]
    ) -> None:
        server = AlertmanagerServer(tmp_path / "am", shipped_config(webhook.url)).start()
        servers.append(server)
        # A lost GPU on node a raises three alerts at once; node b has its own fault.
        fault = ("GpuwardenGpuLost", "GpuwardenCriticalXid", "GpuwardenRepairRequired")
        alerts = [
            {"labels": {"alertname": name, "node": "a", "severity": "critical", "job": "gpuwarden"}}
            for name in fault
        ] + [
            {
                "labels": {
                    "alertname": "GpuwardenGpuLost",
                    "node": "b",
                    "severity": "critical",
                    "job": "gpuwarden",
                }
            }
        ]
        post_alerts(server, alerts)
        await until(lambda: len(webhook.received()) >= 2, timeout=20)
        await asyncio.sleep(1.5)  # a third notification would come within group_interval
        pages = webhook.received()
        by_node = {
            tuple(sorted({a["labels"]["node"] for a in n.alerts()})): sorted(
                a["labels"]["alertname"] for a in n.alerts()
            )
            for n in pages
        }
        assert len(pages) == 2, [n.body for n in pages]
        assert by_node == {("a",): sorted(fault), ("b",): ["GpuwardenGpuLost"]}
        assert {n.receiver for n in pages} == {"gpuwarden-pager"}
