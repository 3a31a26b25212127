"""SIGHUP racing other work, each race made to happen, against the real agent on the fake NVML
with a real mosquitto (the benchmark's child: tests/test_reload_bench_child.py; SIGHUP in the
start and in the stop: tests/test_reload_signals.py):

- the broker hung (SIGSTOP) while a kernel-log Xid is read and the file changes: the reload
  is answered and applied while the broker hangs; the Xid reaches the broker once after it;
- a GPU hung in NVML (every call on it blocks) through three reloads that restart the GPU
  collector: each answered, no new thread stuck, no second unresponsive event, the GPU back
  once it answers again;
- paused (`gpuwarden pause`) through reloads that restart the GPU collector: not one NVML
  call until `resume`, the GPUs back after it;
- a burst of 20 SIGHUPs with the file rewritten between them: the last file is in force.

One agent goes through all four, with the promises of tests/test_reload_sequences.py checked
throughout (no counter down, health 1, no collector_stale, sink_stale or
collector_start_failed event) and at the end (heartbeats never further apart than the
watcher's stale limit and healthy, one `online` status, no traceback) and one payload per
event id.
"""

from __future__ import annotations

import collections
import itertools
import json
import signal
import time
from pathlib import Path

import pytest

from tests.support.agent_proc import AgentProcess, run_gpuwarden
from tests.support.fake_nvml_agent import calls_path, hang_gpu, stuck_calls, unhang_gpu
from tests.support.mosquitto import Broker
from tests.support.mqtt import Subscriber
from tests.support.waiting import wait_until
from tests.test_reload_sequences import HEARTBEAT, STALE_AFTER, Series, Watch, broker_violations

ENABLED = {"system", "processes", "disk", "gpu", "kernel_log"}
XID_LINE = (
    "2026-01-01T00:00:01+00:00 n kernel: NVRM: Xid (PCI:0000:18:00): 79, pid=1, "
    "GPU has fallen off the bus.\n"
)


class Races:
    def __init__(self, workdir: Path, broker: Broker) -> None:
        self.workdir, self.broker = workdir, broker
        self.devices = workdir / "dev"
        self.devices.mkdir()
        self.kernel_log = workdir / "kern.log"
        self.kernel_log.write_text("")
        self.agent = AgentProcess(
            workdir / "agent", entry=["-m", "tests.support.fake_nvml_agent", str(self.devices), "2"]
        )
        self.watch = Watch(self.agent)
        self.values: dict[str, float] = {"system": 0.5, "holdoff": 300.0, "top": 8}

    def text(self) -> str:
        v = self.values
        return (
            f'[mqtt]\nenabled = true\nurl = "{self.broker.url}"\nkeepalive = 5\n'
            "reconnect_min = 0.2\nreconnect_max = 1.0\n"
            f"[heartbeat]\ninterval = {HEARTBEAT}\nstale_after_intervals = {STALE_AFTER}\n"
            f"[collectors.system]\ninterval = {v['system']}\n"
            "[collectors.processes]\ninterval = 0.5\n"
            f'[collectors.disk]\ninterval = 0.5\nmountpoints_include = ["{self.workdir}"]\n'
            f'[collectors.kernel_log]\ninterval = 1.0\npath = "{self.kernel_log}"\n'
            f"repeat_holdoff = {v['holdoff']}\n"
            "[collectors.gpu]\ninterval = 0.5\ntimeout = 1.0\nevent_wait_ms = 100\n"
            f'sysfs_root = "/nonexistent"\ntop_processes = {int(v["top"])}\n'
            "[collectors.benchmark]\nenabled = false\n"
        )

    def scrape(self) -> dict[Series, float]:
        return self.watch.scrape(ENABLED)

    def value(self, name: str, **labels: str) -> float | None:
        for (family, have), value in self.scrape().items():
            if family == name and labels.items() <= dict(have).items():
                return value
        return None

    def answers(self) -> int:
        log = self.agent.log()
        return log.count("configuration reloaded") + log.count("reload refused")

    def hup(self, **changes: float) -> int:
        """Write the file with `changes`, SIGHUP; returns the answers counted before it."""
        before = self.answers()
        self.values.update(changes)
        self.agent.config_text = self.text()
        self.agent.write_config()
        self.agent.signal(signal.SIGHUP)
        return before

    def reload(self, **changes: float) -> None:
        before = self.hup(**changes)
        wait_until(lambda: self.answers() > before, what=f"the answer to {changes}")

    def restart_gpu(self, top: int) -> None:
        """A reload that restarts the GPU collector, and two of the new instance's rounds."""
        runs = self.value("gpuwarden_collector_runs_total", collector="gpu") or 0.0
        self.reload(top=top)
        wait_until(
            lambda: (
                (self.value("gpuwarden_collector_runs_total", collector="gpu") or 0.0) > runs + 1
            ),
            what="rounds of the restarted GPU collector",
        )

    def nvml_calls(self, since: float) -> dict[str, int]:
        """The fake's calls by name, from a report written after `since`."""
        path = calls_path(self.devices)
        wait_until(lambda: path.stat().st_mtime > since, what="a report of the fake's calls")
        counts: dict[str, int] = json.loads(path.read_text())
        return counts

    def control(self, *args: str) -> str:
        done = run_gpuwarden(*args, "--config", str(self.agent.config_path))
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    # -- the races ----------------------------------------------------------------------------

    def broker_hung(self, sub: Subscriber) -> None:
        assert self.broker.process is not None
        self.broker.process.send_signal(signal.SIGSTOP)
        try:
            with self.kernel_log.open("a") as log:
                log.write(XID_LINE)
            self.reload(system=0.8, holdoff=200.0)
            wait_until(
                lambda: (
                    self.value("gpuwarden_collector_interval_seconds", collector="system") == 0.8
                ),
                what="the new interval while the broker hangs",
            )
        finally:
            self.broker.process.send_signal(signal.SIGCONT)
        sub.wait_for(
            lambda s: any(m.json()["kind"] == "xid" for m in s.on("test-node/events")),
            what="the Xid read while the broker hung",
        )

    def gpu_hung(self) -> None:
        hang_gpu(self.devices, 1)
        unresponsive = {"name": "gpuwarden_events_total", "kind": "gpu_unresponsive"}
        wait_until(lambda: self.value(**unresponsive) == 1.0, what="GPU 1 unresponsive")
        assert stuck_calls(self.devices, 1) == 1
        for top in (4, 8, 4):
            self.restart_gpu(top)
            assert self.value("gpuwarden_collector_hung_calls", collector="gpu") == 1.0
        assert self.value(**unresponsive) == 1.0, "a reload raised the hung GPU again"
        assert stuck_calls(self.devices, 1) == 1, "a reload left another thread stuck on GPU 1"
        unhang_gpu(self.devices, 1)
        wait_until(
            lambda: self.value("gpuwarden_events_total", kind="gpu_recovered") == 1.0,
            what="GPU 1 back",
        )
        assert self.value("gpuwarden_collector_hung_calls", collector="gpu") == 0.0

    def paused(self) -> None:
        assert "gpu: released" in self.control("pause", "--for", "10m", "--reason", "reset")
        before = self.nvml_calls(since=time.time())
        for top in (8, 4):
            self.restart_gpu(top)
        assert self.value("gpuwarden_gpu_up") is None
        assert self.nvml_calls(since=time.time()) == before, "NVML called while paused"
        assert "GPU monitoring resumed" in self.control("resume")
        wait_until(lambda: self.value("gpuwarden_gpu_up", gpu="1") == 1.0, what="GPUs back")

    def burst(self) -> None:
        before = self.answers()
        for system in itertools.islice(itertools.cycle((0.6, 0.7)), 19):
            self.hup(system=system)
        self.hup(system=0.9)
        wait_until(
            lambda: self.value("gpuwarden_collector_interval_seconds", collector="system") == 0.9,
            what="the last file of the burst in force",
        )
        wait_until(lambda: self.answers() > before, what="an answer to the burst")

    def heard(self, sub: Subscriber) -> None:
        violations = self.watch.violations
        violations.extend(broker_violations(sub))
        ids = collections.Counter(m.json()["id"] for m in sub.on("test-node/events"))
        twice = [i for i, n in ids.items() if n > 1]
        if twice:
            violations.append(f"events delivered twice: {twice}")


@pytest.mark.slow
def test_reloads_racing_a_hung_broker_a_hung_gpu_a_pause_and_a_burst(
    tmp_path: Path, broker: Broker
) -> None:
    races = Races(tmp_path, broker)
    races.agent.config_text = races.text()
    sub = Subscriber(broker.port, client_id="races", persistent=True, reconnect_max=1).start()
    try:
        races.agent.start(timeout=30)
        wait_until(
            lambda: all(
                races.value("gpuwarden_collector_last_success_timestamp_seconds", collector=n)
                for n in ENABLED
            ),
            timeout=30,
            what="every collector's first round",
        )
        races.broker_hung(sub)
        races.gpu_hung()
        races.paused()
        races.burst()
        races.heard(sub)
        if "Traceback" in races.agent.log():
            races.watch.violations.append("a traceback in the agent's log")
    finally:
        sub.stop()
        code = races.agent.stop()
    assert code == 0, races.agent.log()[-2000:]
    assert not races.watch.violations, "\n".join(races.watch.violations)
