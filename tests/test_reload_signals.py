"""SIGHUP at any moment of the real agent's life is a reload, never its end.

Before, SIGHUP kept its default action (end the process) until the event loop installed its
handler, after the imports, the configuration and the state store (a second or more), and got it
back when the loop closed: a `kill -HUP` right after a start, or during a stop, ended the agent
without a line in its log (exit by signal, systemd's on-failure restart, the watcher's dead
node)."""

from __future__ import annotations

import signal
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

from agent.runtime.state import DB_NAME, StateStore
from tests.support.agent_proc import AgentProcess, http_get
from tests.support.waiting import wait_until

SYSTEM_15 = "[collectors.system]\ninterval = 15.0\n"
SYSTEM_2 = "[collectors.system]\ninterval = 2.0\n"
INTERVAL_2 = 'gpuwarden_collector_interval_seconds{collector="system"} 2.0'


def catches_sighup(pid: int) -> bool:
    """The process has a handler for SIGHUP (bit 0 of SigCgt), or ignores it (SigIgn)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return False
    masks = {
        k: int(v, 16)
        for k, _, v in (ln.partition(":\t") for ln in lines)
        if k in {"SigCgt", "SigIgn"}
    }
    return any(mask & 1 for mask in masks.values())


def alive(agent: AgentProcess) -> bool:
    return agent.process is not None and agent.process.poll() is None


def metrics(agent: AgentProcess) -> str:
    try:
        return http_get(agent.metrics_url, timeout=2.0)[1]
    except OSError:
        return ""


def storm(agent: AgentProcess, until_done: Callable[[], bool], gap: float = 0.02) -> int:
    """SIGHUP every `gap` seconds while the agent runs and `until_done()` is false."""
    sent = 0
    deadline = time.monotonic() + 30
    while alive(agent) and not until_done() and time.monotonic() < deadline:
        agent.signal(signal.SIGHUP)
        sent += 1
        time.sleep(gap)
    return sent


class TestSighupWhileStarting:
    def test_while_the_state_store_opens(self, tmp_path: Path) -> None:
        """Deterministic: the state database is locked, so the agent waits in its open (after
        its "starting" line, before its loop takes signals); the SIGHUPs come then."""
        agent = AgentProcess(tmp_path, config_text=SYSTEM_15)
        StateStore.open(tmp_path / "state").close()
        lock = sqlite3.connect(tmp_path / "state" / DB_NAME, isolation_level=None)
        lock.execute("BEGIN EXCLUSIVE")
        try:
            agent.start(wait=False)
            wait_until(lambda: '"starting"' in agent.log() or not alive(agent), 30, "starting")
            agent.config_text = SYSTEM_2  # the file changes after the agent read it
            agent.write_config()
            for _ in range(3):
                agent.signal(signal.SIGHUP)
                time.sleep(0.05)
            assert alive(agent), agent.log()[-2000:]
        finally:
            lock.execute("ROLLBACK")
            lock.close()
        try:
            agent.wait_ready(30)
            # The SIGHUP was a reload once the loop ran: the file's change applies.
            wait_until(lambda: INTERVAL_2 in metrics(agent), 20, "the change applied")
            assert "configuration reloaded" in agent.log()
            assert "state store unusable" not in agent.log()
        finally:
            assert agent.stop() == 0, agent.log()[-2000:]

    def test_a_storm_from_the_first_handler_to_ready(self, tmp_path: Path) -> None:
        agent = AgentProcess(tmp_path, config_text=SYSTEM_15)
        agent.start(wait=False)
        assert agent.process is not None
        pid = agent.process.pid
        wait_until(lambda: catches_sighup(pid) or not alive(agent), 30, "a SIGHUP handler")
        sent = storm(agent, lambda: "gpuwarden_health_ok" in metrics(agent))
        assert alive(agent), f"ended after {sent} SIGHUPs:\n{agent.log()[-2000:]}"
        agent.config_text = SYSTEM_2
        agent.write_config()
        agent.signal(signal.SIGHUP)
        wait_until(lambda: INTERVAL_2 in metrics(agent), 20, "the change applied")
        assert agent.stop() == 0, agent.log()[-2000:]


class TestSighupWhileStopping:
    def test_a_storm_from_sigterm_to_the_exit(self, tmp_path: Path) -> None:
        agent = AgentProcess(tmp_path, config_text=SYSTEM_15)
        agent.start()
        assert agent.process is not None
        agent.signal(signal.SIGTERM)
        storm(agent, lambda: False, gap=0.002)
        agent.process.wait(20)
        assert agent.process.returncode == 0, agent.log()[-2000:]
        assert '"stopped"' in agent.log()
