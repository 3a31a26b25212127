"""The agent as a real subprocess: serves /metrics, answers /healthz, stops cleanly on SIGTERM."""

from __future__ import annotations

import signal
import time

from tests.support.agent_proc import AgentProcess, http_get


class TestAgentProcess:
    def test_serves_metrics_and_stops_on_sigterm(self, agent_process: AgentProcess) -> None:
        """/metrics has the runtime's series; SIGTERM exits 0 within 5 seconds."""
        agent_process.start()
        status, body = http_get(agent_process.metrics_url)
        assert status == 200
        assert 'gpuwarden_collector_success{collector="system"} 1.0' in body
        assert "gpuwarden_build_info{" in body
        # /metrics answers as soon as the endpoint is up; /healthz says 503 "starting" until every
        # collector's first round is done (slower on a loaded machine), then 200.
        healthz = agent_process.metrics_url.replace("/metrics", "/healthz")
        deadline = time.monotonic() + 20.0
        status, text = http_get(healthz)
        while (status, text) != (200, "ok\n") and time.monotonic() < deadline:
            assert (status, text.split(":")[0]) == (503, "starting"), (status, text)
            time.sleep(0.2)
            status, text = http_get(healthz)
        assert (status, text) == (200, "ok\n")
        began = time.monotonic()
        agent_process.signal(signal.SIGTERM)
        assert agent_process.process is not None
        code = agent_process.process.wait(10)
        assert code == 0
        assert time.monotonic() - began < 5.0
        assert '"stopped"' in agent_process.log()
