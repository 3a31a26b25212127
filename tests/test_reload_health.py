"""SIGHUP reload (a bad file keeps the old configuration), /healthz that never lies, the CLI."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from agent.program.cli import COMMANDS
from exporters.prometheus import PrometheusSettings, PrometheusSink
from tests.support.agent_proc import REPO, AgentProcess, http_get
from tests.support.collectors import scripted_runtime
from tests.support.waiting import wait_until


def wait_for_text(agent: AgentProcess, needle: str, timeout: float = 15.0) -> str:
    deadline = time.monotonic() + timeout
    body = ""
    while time.monotonic() < deadline:
        _, body = http_get(agent.metrics_url)
        if needle in body:
            return body
        time.sleep(0.1)
    raise AssertionError(f"{needle!r} not in /metrics after {timeout} s:\n{agent.log()[-3000:]}")


class TestReload:
    """SIGHUP applies a good file and refuses a bad one."""

    def test_reload(self, agent_process: AgentProcess) -> None:
        agent_process.config_text = "[collectors.system]\ninterval = 15.0\n"
        agent_process.start()
        wait_for_text(
            agent_process, 'gpuwarden_collector_interval_seconds{collector="system"} 15.0'
        )
        agent_process.config_text = "[collectors.system]\ninterval = 2.0\n"
        agent_process.write_config()
        agent_process.signal(signal.SIGHUP)
        wait_for_text(agent_process, 'gpuwarden_collector_interval_seconds{collector="system"} 2.0')
        agent_process.config_path.write_text("[collectors.system]\ninterval = 'soon'\n")
        agent_process.signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "reload refused" not in agent_process.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "reload refused; keeping the old configuration" in agent_process.log()
        assert "collectors.system.interval: expected a number" in agent_process.log()
        body = wait_for_text(agent_process, 'collector="system"} 2.0')
        assert 'gpuwarden_collector_success{collector="system"} 1.0' in body
        assert agent_process.stop() == 0


class TestReloadProcess:
    """The real agent: a file the TOML parser cannot even read (RecursionError) is refused and
    said so, the next good file still applies, and a restart-only change waits for a restart."""

    def test_bad_then_good_then_restart_only(self, agent_process: AgentProcess) -> None:
        agent_process.config_text = "[collectors.system]\ninterval = 15.0\n"
        agent_process.start()
        wait_for_text(
            agent_process, 'gpuwarden_collector_interval_seconds{collector="system"} 15.0'
        )
        agent_process.config_path.write_text("deep = " + "[" * 5000 + "]" * 5000 + "\n")
        agent_process.signal(signal.SIGHUP)
        wait_until(lambda: "reload refused" in agent_process.log(), 15, "the refusal in the log")
        assert "nested too deeply" in agent_process.log()
        assert str(agent_process.config_path) in agent_process.log()
        body = wait_for_text(agent_process, "gpuwarden_config_last_reload_successful 0.0")
        assert 'gpuwarden_collector_interval_seconds{collector="system"} 15.0' in body
        status, text = http_get(agent_process.metrics_url.replace("/metrics", "/healthz"))
        assert status == 200, text
        assert "notice: last configuration reload refused" in text
        # The next SIGHUP is honoured.
        agent_process.config_text = "[collectors.system]\ninterval = 2.0\n"
        agent_process.write_config()
        agent_process.signal(signal.SIGHUP)
        body = wait_for_text(
            agent_process, 'gpuwarden_collector_interval_seconds{collector="system"} 2.0'
        )
        assert "gpuwarden_config_last_reload_successful 1.0" in body
        status, text = http_get(agent_process.metrics_url.replace("/metrics", "/healthz"))
        assert (status, text) == (200, "ok\n")
        # A restart-only change: not applied, a notice, still 200.
        agent_process.config_text += "[heartbeat]\ninterval = 5.0\n"
        agent_process.write_config()
        agent_process.signal(signal.SIGHUP)
        wait_for_text(agent_process, "gpuwarden_config_restart_pending 1.0")
        status, text = http_get(agent_process.metrics_url.replace("/metrics", "/healthz"))
        assert status == 200, text
        assert "notice: configuration change pending restart: [heartbeat] interval" in text
        assert "takes effect after a restart" not in agent_process.log()
        assert agent_process.stop() == 0


class TestHealthz:
    """/healthz answers 200 only while collection is fresh."""

    async def test_starting_then_ok_then_stale(self) -> None:
        runtime, _ = scripted_runtime({"a": "ok", "b": "raise"}, interval=0.05, timeout=0.05)
        sink = PrometheusSink(PrometheusSettings(listen="127.0.0.1:1"), runtime)
        status, body = sink.healthz()
        assert status == 503
        assert body.startswith(b"starting")
        await runtime.start()
        try:
            await asyncio.sleep(0.3)
            assert sink.healthz()[0] == 503  # b has never succeeded: stale after 3 rounds
            assert b"collector b stale" in sink.healthz()[1]
            status, _, text = sink.respond(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            assert status == 200
            assert b"gpuwarden_health_ok 0.0" in text
            assert runtime.ledger["prometheus"].last_delivery is not None
        finally:
            await runtime.stop()

    def test_bad_requests(self) -> None:
        runtime, _ = scripted_runtime({})
        sink = PrometheusSink(PrometheusSettings(), runtime)
        assert sink.respond(b"garbage\r\n\r\n")[0] == 400
        assert sink.respond(b"POST /metrics HTTP/1.1\r\n\r\n")[0] == 405
        assert sink.respond(b"GET /nope HTTP/1.1\r\n\r\n")[0] == 404


class TestCommandLine:
    """Every command has --help; commands not built yet say so with exit code 2."""

    @pytest.mark.parametrize("command", sorted(COMMANDS))
    def test_help(self, command: str) -> None:
        result = subprocess.run(
            [sys.executable, "-m", "agent", command, "--help"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert result.returncode == 0
        assert "--config" in result.stdout
