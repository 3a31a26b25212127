"""SIGHUP while the benchmark's child process runs, against the real agent on the fake NVML with
a real mosquitto: the child is a real process that blocks until the test lets it finish.

A reload that leaves the benchmark alone leaves its child alone: it finishes and its result is
recorded once. A reload that restarts the benchmark collector (its settings changed) kills the
child of the instance it replaces: that run is no run of the GPU's (not counted, not a failure,
not a crash: the GPU is tested again at once, under the new settings), and no second child may
start while the killed one is still alive. A child stuck in the driver does not die at SIGKILL
(state D until the driver lets go); here it is stuck in a FUSE mount that never answers
(tests/support/fuse_hang.py). Before, the new instance started its own child a second after the
reload, beside the stuck one: two benchmark processes on one GPU, and the same after a timeout
whose kill did not take.

The promises of tests/test_reload_sequences.py hold throughout: no counter down, health 1, no
collector_stale, sink_stale or collector_start_failed event, heartbeats over MQTT never further
apart than the watcher's stale limit, one `online` status, no traceback.

`GPUWARDEN_RACE_SLOW=1` adds the timeout case (about 20 s: the child's timeout, then the 10 s
the runner waits for a killed child).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.agent_proc import AgentProcess, run_gpuwarden
from tests.support.bench import RECORD_CHILD
from tests.support.mosquitto import Broker
from tests.support.mqtt import Subscriber
from tests.support.waiting import wait_until

# fusepy is a development dependency: a GPU host running scripts/gpu-verify.sh may lack it, and
# this module holds no gpu test.
pytest.importorskip("fuse", reason="fusepy (a development dependency) is not installed")

from tests.test_disk_hung_mount import (
    fuse_usable,
    hang_launcher,
    kill_daemon,
    process_state,
)
from tests.test_reload_sequences import HEARTBEAT, STALE_AFTER, Series, Watch

SLOW = os.environ.get("GPUWARDEN_RACE_SLOW", "") == "1"
ENABLED = {"system", "processes", "disk", "gpu", "benchmark"}


@dataclass
class Gate:
    """The benchmark's `python`: each child notes its pid in `folder` (and any other child
    still alive then: `overlaps`), waits until `release` exists, then prints a record. With
    `stuck_in`, the first child first asks that mount's statfs, which never answers."""

    folder: Path
    stuck_in: Path | None = None

    def __post_init__(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        script = self.folder.parent / "gated_child.py"
        script.write_text(
            "import os, pathlib, time\n"
            f"gate = pathlib.Path({str(self.folder)!r})\n"
            "me = os.getpid()\n"
            "for note in gate.glob('started-*'):\n"
            "    try:\n"
            "        stat = pathlib.Path(f'/proc/{note.name[8:]}/stat').read_text()\n"
            "    except OSError:\n"
            "        continue\n"
            "    state = stat.rpartition(')')[2].split()[0]\n"
            "    if state not in ('Z', 'X'):\n"
            "        (gate / f'overlap-{me}-{note.name[8:]}').write_text(state)\n"
            "first = not any(gate.glob('started-*'))\n"
            "(gate / f'started-{me}').write_text('')\n"
            + (f"if first:\n    os.statvfs({str(self.stuck_in)!r})\n" if self.stuck_in else "")
            + "while not (gate / 'release').exists():\n"
            "    time.sleep(0.02)\n" + RECORD_CHILD
        )
        self.python = self.folder.parent / "gated-python"
        self.python.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
        self.python.chmod(0o755)

    def started(self) -> list[int]:
        notes = sorted(self.folder.glob("started-*"), key=lambda p: p.stat().st_mtime_ns)
        return [int(p.name[8:]) for p in notes]

    def overlaps(self) -> list[str]:
        return sorted(p.name for p in self.folder.glob("overlap-*"))

    def release(self) -> None:
        (self.folder / "release").write_text("")


def alive(pid: int) -> bool:
    return process_state(pid) not in ("", "Z", "X")


@dataclass
class Bench:
    """The agent with the benchmark on a gated child, a subscriber, and the promises."""

    workdir: Path
    broker: Broker
    gate: Gate
    child_timeout: float = 30.0
    benchmark_interval: float = 1.0
    system_interval: float = 0.5

    def __post_init__(self) -> None:
        (self.workdir / "dev").mkdir(exist_ok=True)
        self.agent = AgentProcess(
            self.workdir / "agent",
            entry=["-m", "tests.support.fake_nvml_agent", str(self.workdir / "dev"), "2"],
        )
        self.watch = Watch(self.agent)
        self.sub = Subscriber(self.broker.port)

    def text(self) -> str:
        # The benchmark's call timeout makes room for a child timeout beside a 1 s interval
        # (child_timeout <= 2 x max(interval, timeout) - 20), and keeps it from going stale
        # while one round waits for its child (3 intervals + the timeout).
        return (
            f'[mqtt]\nenabled = true\nurl = "{self.broker.url}"\nkeepalive = 5\n'
            "reconnect_min = 0.2\nreconnect_max = 1.0\n"
            f"[heartbeat]\ninterval = {HEARTBEAT}\nstale_after_intervals = {STALE_AFTER}\n"
            f"[collectors.system]\ninterval = {self.system_interval}\n"
            "[collectors.processes]\ninterval = 0.5\n"
            f'[collectors.disk]\ninterval = 0.5\nmountpoints_include = ["{self.workdir}"]\n'
            "[collectors.kernel_log]\nenabled = false\n"
            "[collectors.gpu]\ninterval = 0.5\nevent_wait_ms = 100\n"
            'sysfs_root = "/nonexistent"\n'
            f"[collectors.benchmark]\ninterval = {self.benchmark_interval}\ntimeout = 30.0\n"
            f'when = "always"\nperiod = 600.0\nchild_timeout = {self.child_timeout}\n'
            f'python = "{self.gate.python}"\n'
        )

    @contextlib.contextmanager
    def running(self) -> Iterator[Bench]:
        self.agent.config_text = self.text()
        self.sub.start()
        try:
            self.agent.start(timeout=30)
            yield self
            self._heard()
            if "Traceback" in self.agent.log():
                self.watch.violations.append("a traceback in the agent's log")
        finally:
            self.sub.stop()
            code = self.agent.stop()
            self.gate.release()
        if code != 0:
            self.watch.violations.append(f"exit code {code}: {self.agent.log()[-2000:]}")

    def scrape(self) -> dict[Series, float]:
        return self.watch.scrape(ENABLED)

    def reload(self, **changes: float) -> None:
        """Write the file with `changes` and SIGHUP; returns once the agent has answered."""
        for key, value in changes.items():
            setattr(self, key, value)
        answers = self.agent.log().count("configuration reloaded")
        self.agent.config_text = self.text()
        self.agent.write_config()
        self.agent.signal(signal.SIGHUP)
        wait_until(
            lambda: self.agent.log().count("configuration reloaded") > answers,
            what=f"the answer to {changes}",
        )

    def gpu_series(self, name: str, gpu: str = "0") -> float | None:
        for (family, labels), value in self.scrape().items():
            if family == name and dict(labels).get("gpu") == gpu:
                return value
        return None

    def failures(self) -> dict[Series, float]:
        return {
            series: value
            for series, value in self.scrape().items()
            if series[0] == "gpuwarden_benchmark_failures_total"
        }

    def _heard(self) -> None:
        beats = [m.json() for m in self.sub.on("test-node/heartbeat")]
        gaps = [b["ts"] - a["ts"] for a, b in itertools.pairwise(beats)]
        if gaps and max(gaps) >= HEARTBEAT * STALE_AFTER:
            self.watch.violations.append(f"heartbeat gap {max(gaps):.2f} s: the watcher's stale")
        unhealthy = [b["health"] for b in beats if b["health"] != "ok"]
        if unhealthy:
            self.watch.violations.append(f"unhealthy heartbeats: {unhealthy[:3]}")
        states = [m.json()["state"] for m in self.sub.on("test-node/status")]
        if states != ["online"]:
            self.watch.violations.append(f"status messages {states}")


@pytest.mark.slow
class TestAReloadWhileTheChildRuns:
    def test_left_alone_or_killed_and_run_again_once(self, tmp_path: Path, broker: Broker) -> None:
        """A reload of another collector leaves the child running; one of the benchmark's
        own settings kills it, and the new instance runs the GPU again, alone: one run of
        GPU 0 counted in the end, with its result, no failure."""
        gate = Gate(tmp_path / "gate")
        bench = Bench(tmp_path, broker, gate)
        with bench.running():
            wait_until(lambda: len(gate.started()) == 1, timeout=30, what="the first child")
            first = gate.started()[0]
            bench.reload(system_interval=0.8)
            interval = ("gpuwarden_collector_interval_seconds", (("collector", "system"),))
            assert bench.scrape()[interval] == 0.8
            assert alive(first), "a reload of the system collector killed the benchmark child"
            assert gate.started() == [first]

            bench.reload(benchmark_interval=1.5)
            wait_until(lambda: len(gate.started()) == 2, timeout=30, what="the run again")
            assert not alive(first)
            gate.release()
            wait_until(
                lambda: (
                    bench.gpu_series("gpuwarden_benchmark_last_success_timestamp_seconds")
                    is not None
                ),
                what="GPU 0's result",
            )
            mine = ("gpuwarden_collector_interval_seconds", (("collector", "benchmark"),))
            assert bench.scrape()[mine] == 1.5
            # One run of GPU 0 gave a result; the run the reload killed is none.
            assert bench.gpu_series("gpuwarden_benchmark_runs_total") == 1.0
            assert bench.failures() == {}
            assert gate.overlaps() == []
        assert not bench.watch.violations, "\n".join(bench.watch.violations)


def fuse_or_skip() -> None:
    why = fuse_usable()
    if why:
        pytest.skip(why)


@pytest.fixture
def stuck_mount(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(mount point, FUSE state file); its daemon is SIGKILLed at the end, which frees the
    child stuck in it."""
    fuse_or_skip()
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    state = tmp_path / "fuse-state"
    yield mountpoint, state
    kill_daemon(state)


ENDS = ["reload", pytest.param("timeout", marks=pytest.mark.skipif(not SLOW, reason="slow"))]


@pytest.mark.slow
class TestAChildThatDoesNotDie:
    @pytest.mark.parametrize("end", ENDS)
    def test_no_second_child_until_it_is_gone(
        self, tmp_path: Path, broker: Broker, stuck_mount: tuple[Path, Path], end: str
    ) -> None:
        """The first child is stuck where SIGKILL cannot end it, then killed by a reload
        that restarts the benchmark or by its own timeout: no other child starts while it
        lives (the next due run waits, a skip), and one does once it is gone."""
        mountpoint, state = stuck_mount
        gate = Gate(tmp_path / "gate", stuck_in=mountpoint)
        bench = Bench(tmp_path, broker, gate, child_timeout=5.0 if end == "timeout" else 30.0)
        bench.agent.prefix = hang_launcher(mountpoint, state)
        gate.release()  # every child but the stuck one finishes at once
        with bench.running():

            def stuck() -> bool:
                started = gate.started()
                return bool(started) and process_state(started[0]) in ("S", "D")

            wait_until(stuck, timeout=30, what="the first child in the mount")
            wait_until(lambda: "statfs" in state.read_text(), what="its statfs")
            first = gate.started()[0]
            if end == "reload":
                bench.reload(benchmark_interval=1.5)
            waited = ("gpuwarden_benchmark_skips_total", "previous_child_alive")

            def decided() -> bool:
                skipped = any(
                    (name, dict(labels).get("reason")) == waited for name, labels in bench.scrape()
                )
                return skipped or len(gate.started()) > 1

            wait_until(decided, timeout=40, what="the next due run's turn")
            assert process_state(first) == "D", "the stuck child died: nothing was tested"
            assert gate.started() == [first], f"a child beside the stuck one: {gate.overlaps()}"
            kill_daemon(state)
            wait_until(lambda: not alive(first), what="the stuck child's end")
            wait_until(lambda: len(gate.started()) > 1, timeout=30, what="the next child")
            assert gate.overlaps() == []
        assert not bench.watch.violations, "\n".join(bench.watch.violations)


@pytest.mark.slow
class TestAPauseBesideAStuckChild:
    @pytest.mark.parametrize("again", ["asked again", "resumed and paused anew"])
    def test_the_benchmark_is_not_released_while_its_child_lives(
        self, tmp_path: Path, broker: Broker, stuck_mount: tuple[Path, Path], again: str
    ) -> None:
        """`gpuwarden pause` tells the operator the GPUs may be reset; a child that a reload
        killed and that is stuck in the driver outlives its SIGKILL and still holds its GPU.
        Before, the new instance, running no child of its own, answered "no benchmark child
        was running; none starts", released, exit 0, and a reset then met a GPU in use; now
        it names the live child, not released, exit 1, and says released once the child is
        gone and the pause is asked again, or a new one after a resume. (Asked again, a
        pause used to answer what the first had said: the dead child, exit 1.)"""
        mountpoint, state = stuck_mount
        gate = Gate(tmp_path / "gate", stuck_in=mountpoint)
        bench = Bench(tmp_path, broker, gate)
        bench.agent.prefix = hang_launcher(mountpoint, state)
        gate.release()
        with bench.running():
            wait_until(lambda: bool(gate.started()), timeout=30, what="the first child")
            wait_until(lambda: "statfs" in state.read_text(), what="its statfs")
            first = gate.started()[0]
            # A reload kills it, and the instance it makes waits for it (the test above).
            bench.reload(benchmark_interval=1.5)
            waited = ("gpuwarden_benchmark_skips_total", "previous_child_alive")
            wait_until(
                lambda: any(
                    (name, dict(labels).get("reason")) == waited for name, labels in bench.scrape()
                ),
                timeout=40,
                what="the new instance's wait for the stuck child",
            )
            state_dir = str(bench.agent.workdir / "state")
            done = run_gpuwarden("pause", "--state-dir", state_dir, "--for", "5m", "--json")
            assert process_state(first) == "D", "the stuck child died: nothing was tested"
            reply = json.loads(done.stdout)
            benchmark = reply["released"]["benchmark"]
            assert benchmark["released"] is False, benchmark
            assert str(first) in benchmark["detail"], benchmark
            assert done.returncode == 1, done.stdout
            if again == "asked again":  # still stuck: still said, by its pid
                done = run_gpuwarden("pause", "--state-dir", state_dir, "--for", "5m", "--json")
                benchmark = json.loads(done.stdout)["released"]["benchmark"]
                assert benchmark["released"] is False and str(first) in benchmark["detail"]
                assert done.returncode == 1, done.stdout
            kill_daemon(state)
            wait_until(lambda: not alive(first), what="the stuck child's end")
            if again != "asked again":
                done = run_gpuwarden("resume", "--state-dir", state_dir)
                assert done.returncode == 0, done.stdout
            done = run_gpuwarden("pause", "--state-dir", state_dir, "--for", "5m", "--json")
            reply = json.loads(done.stdout)
            assert reply["extended"] is (again == "asked again"), reply
            assert reply["released"]["benchmark"]["released"] is True, reply
            assert done.returncode == 0, done.stdout
            assert run_gpuwarden("resume", "--state-dir", state_dir).returncode == 0
        assert not bench.watch.violations, "\n".join(bench.watch.violations)
