"""The watcher's /metrics: promtool-clean, fresh at each scrape, and documented in docs/metrics.md."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
from pathlib import Path

from agent.program.watch.fleet import SETTLE_SECONDS, Fleet
from agent.program.watch.metrics import MetricsServer
from exporters.http import DROP_REASONS, REJECT_REASONS
from exporters.listener import ACCEPT_FAILURES

METRICS_DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
T0 = 1_700_000_000.0


def fleet_with_nodes(inventory: tuple[str, ...] = ("a", "b", "spare")) -> Fleet:
    fleet = Fleet(now=T0, inventory=inventory)
    fleet.broker_connected(T0 - SETTLE_SECONDS)
    for node in ("a", "b"):
        fleet.ingest(
            f"gpuwarden/v1/{node}/status",
            json.dumps({"state": "online", "bdseq": 2, "ts": T0}).encode(),
            False,
            T0,
        )
        fleet.ingest(
            f"gpuwarden/v1/{node}/heartbeat",
            json.dumps({"seq": 1, "ts": T0, "interval_s": 5}).encode(),
            False,
            T0,
        )
    fleet.ingest("gpuwarden/v1/a/status", b"{", False, T0)
    fleet.evaluate(T0 + 20)
    return fleet


def exposition(fleet: Fleet, now: float) -> str:
    server = MetricsServer(fleet, "127.0.0.1", 0, clock=lambda: now)
    return server.render_now().decode()


class TestExposition:
    """What a scrape returns."""

    def test_values(self) -> None:
        text = exposition(fleet_with_nodes(), T0 + 20)
        assert 'gpuwarden_watch_node_heartbeat_age_seconds{node="a"} 20.0' in text
        assert 'gpuwarden_watch_node_state{node="a",state="stale"} 1.0' in text
        assert 'gpuwarden_watch_node_state{node="a",state="online"} 0.0' in text
        assert 'gpuwarden_watch_node_state{node="spare",state="missing"} 1.0' in text
        assert 'gpuwarden_watch_malformed_messages_total{reason="not_json"} 1.0' in text
        assert 'gpuwarden_watch_nodes{state="stale"} 2.0' in text
        assert (
            'gpuwarden_watch_alert_active{kind="fleet_quiet",node="",severity="critical"} 1.0'
            in text
        )

    def test_forgotten_node_leaves_no_series(self) -> None:
        fleet = fleet_with_nodes(inventory=())
        fleet.ingest("gpuwarden/v1/b/status", b"", True, T0 + 21)
        assert 'node="b"' not in exposition(fleet, T0 + 21)

    def test_promtool_check_metrics(self) -> None:
        promtool = shutil.which("promtool") or "/usr/bin/promtool"
        done = subprocess.run(
            [promtool, "check", "metrics"],
            input=exposition(fleet_with_nodes(), T0 + 20),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr

    def test_http(self) -> None:
        server = MetricsServer(fleet_with_nodes(), "127.0.0.1", 0)
        assert server.respond(b"GET /metrics HTTP/1.1\r\n\r\n")[0] == 200
        assert server.respond(b"GET /healthz HTTP/1.1\r\n\r\n")[0] == 200
        assert server.respond(b"POST /metrics HTTP/1.1\r\n\r\n")[0] == 405
        assert server.respond(b"GET /nope HTTP/1.1\r\n\r\n")[0] == 404
        assert server.respond(b"garbage\r\n\r\n")[0] == 400
        assert server.respond(b"GET /" + b"x" * 9000 + b" HTTP/1.1\r\n\r\n")[0] == 431


class TestMetricsDoc:
    """Every watcher metric has a row in the watcher section of docs/metrics.md."""

    def test_rows(self) -> None:
        names = set(
            re.findall(r"^# TYPE (\S+)", exposition(fleet_with_nodes(), T0 + 20), re.MULTILINE)
        )
        doc = METRICS_DOC.read_text().split("\n## Watcher (`gpuwarden watch`)", 1)[1]
        for name in names:
            base = name.removesuffix("_total")
            assert f"`{name}`" in doc or f"`{base}_total`" in doc, name


class TestEndpointCounters:
    """The watcher's /metrics says what its own endpoint turned away, as the agent's does:
    the watcher is the fleet's last line, and a crowd that blinds its scraper must show."""

    async def test_a_malformed_head_is_counted_and_every_reason_shown(self) -> None:
        server = MetricsServer(fleet_with_nodes(), "127.0.0.1", 0)
        await server.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n")
            await writer.drain()
            assert (await reader.read(100)).startswith(b"HTTP/1.1 400 ")
            writer.close()
            text = (await server.metrics_body()).decode()
        finally:
            await server.stop()
        assert 'gpuwarden_http_requests_rejected_total{reason="bad_header_line"} 1.0' in text
        for reason in REJECT_REASONS:
            assert f'gpuwarden_http_requests_rejected_total{{reason="{reason}"}}' in text
        for reason in DROP_REASONS:  # every reason from 0: a late series hides its first rise
            assert f'gpuwarden_http_connections_dropped_total{{reason="{reason}"}}' in text
        for reason in ACCEPT_FAILURES:
            assert f'gpuwarden_http_accept_failed_total{{reason="{reason}"}}' in text
