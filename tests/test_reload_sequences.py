"""Seeded random sequences of configurations over every collector, a SIGHUP after each, against
the real agent on the fake NVML with a real mosquitto: what a reload must never do, checked
after every step and across the whole run.

Each step picks a collector and does one of: enable it, disable it, change its interval,
change one of its own keys (a threshold, a period), write a value the loader refuses, or
restore the last good file. The agent is scraped throughout. Required:

- no counter goes down over the whole run, whatever the reloads between two scrapes did, a
  collector disabled and enabled again included (a reload is not a restart:
  `gpuwarden_collector_runs_total` counts the collector's rounds in this process,
  `gpuwarden_kernel_log_records_total` counts "since the agent started", the benchmark's runs
  and failures count the agent's runs); none of a collector that stays enabled goes missing;
- no timestamp series of a collector that stays enabled goes missing either (the benchmark's
  last run and last success: `GpuwardenBenchmarkFailing` reads them, and without its last
  success `GpuwardenBenchmarkStale` pages for an idle GPU, configs/prometheus);
- `gpuwarden_health_ok` and every enabled collector's `gpuwarden_collector_success` stay 1;
  every collector changed by the step runs a round that succeeds after the SIGHUP; a disabled
  collector's series are gone;
- no `collector_stale`, `sink_stale` or `collector_start_failed` event is raised;
- a refused file keeps the running configuration, says so (`..._last_reload_successful` 0),
  and the log names the file and the key;
- over MQTT: one `online` status (no Will, no offline), heartbeats healthy and never further
  apart than the watcher's stale limit (`stale_after_intervals` x interval).

CI runs one short seed; `GPUWARDEN_RELOAD_SEEDS=1-20 GPUWARDEN_RELOAD_STEPS=30` runs more.
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.agent_proc import AgentProcess, http_get
from tests.support.chaos import parse_metrics
from tests.support.mosquitto import Broker
from tests.support.mqtt import Subscriber
from tests.support.waiting import wait_until

Series = tuple[str, tuple[tuple[str, str], ...]]

HEARTBEAT = 1.0
STALE_AFTER = 3
OWNED: dict[str, tuple[str, ...]] = {
    # Families by prefix, to tell whose series a disabled collector must take with it.
    "system": ("gpuwarden_load_", "gpuwarden_memory_", "gpuwarden_swap_", "gpuwarden_uptime_"),
    "processes": ("gpuwarden_processes_", "gpuwarden_process_", "gpuwarden_zombie_"),
    "disk": ("gpuwarden_filesystem_", "gpuwarden_mount_"),
    "gpu": ("gpuwarden_gpu_", "gpuwarden_gpus_", "gpuwarden_nvml_"),
    "kernel_log": ("gpuwarden_kernel_log_",),
    "benchmark": ("gpuwarden_benchmark_",),
    "checkpoints": ("gpuwarden_checkpoint_",),
    "io_probe": ("gpuwarden_io_",),
}
FALSE_ALARMS = ("collector_stale", "sink_stale", "collector_start_failed")


def seeds() -> list[int]:
    text = os.environ.get("GPUWARDEN_RELOAD_SEEDS", "1-3")
    out: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        out.extend(range(int(low), int(high or low) + 1))
    return out


STEPS = int(os.environ.get("GPUWARDEN_RELOAD_STEPS", "7"))


@dataclass
class Knobs:
    """One collector's table: the keys it always has here, its intervals, its own keys with
    the values a step may pick, and values the loader refuses."""

    fixed: dict[str, Any]
    intervals: tuple[float, ...]
    own: dict[str, tuple[Any, ...]]
    broken: tuple[tuple[str, Any], ...]
    enabled: bool = True


def knobs(work: Path) -> dict[str, Knobs]:
    return {
        "system": Knobs({}, (0.5, 0.8), {}, (("interval", "soon"),)),
        "processes": Knobs(
            {},
            (0.5, 0.9),
            {"zombie_threshold": (10, 20), "d_state_threshold": (120.0, 60.0)},
            (("zombie_threshold", 0),),
        ),
        "disk": Knobs(
            {"mountpoints_include": [str(work), "/"]},
            (0.6, 1.0),
            {"space_warning_percent": (90, 85), "hysteresis_percent": (5.0, 3.0)},
            (("space_warning_percent", 99),),
        ),
        "gpu": Knobs(
            {"sysfs_root": "/nonexistent", "event_wait_ms": 100},
            (0.5, 0.8),
            {"slow_interval": (60.0, 30.0), "top_processes": (8, 4)},
            (("interval", -1),),
        ),
        "kernel_log": Knobs(
            {"path": str(work / "kern.log")},
            (1.0, 1.5),
            {"repeat_holdoff": (300.0, 200.0)},
            (("repeat_holdoff", "long"),),
        ),
        "benchmark": Knobs(
            {"when": "always", "period": 60.0, "child_timeout": 5.0, "python": "/bin/false"},
            (15.0, 16.0),
            {"idle_rounds": (3, 2), "period": (60.0, 90.0)},
            (("child_timeout", 100.0),),  # does not fit in a 15 s round
        ),
        "checkpoints": Knobs(
            {"locations": [{"path": str(work / "ckpt")}]},
            (1.0, 1.5),
            {"settle_seconds": (60.0, 30.0)},
            (("shrink_ratio", 7),),
            enabled=False,
        ),
        "io_probe": Knobs(
            {"directories": [str(work / "probe")], "size_mib": 1, "free_margin_mib": 1},
            (2.0, 3.0),
            {"size_mib": (1, 2)},
            (("size_mib", 0),),
            enabled=False,
        ),
    }


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value if not isinstance(v, dict)) + "]"
    return repr(value)


@dataclass
class Model:
    """What the file says each collector is (the last good one), and one break, if any."""

    tables: dict[str, Knobs]
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    broken: tuple[str, str, Any] | None = None

    def __post_init__(self) -> None:
        for name, k in self.tables.items():
            self.settings[name] = {
                **k.fixed,
                "enabled": k.enabled,
                "interval": k.intervals[0],
                **{key: values[0] for key, values in k.own.items()},
            }

    def text(self, broker: Broker) -> str:
        out = [
            f'[mqtt]\nenabled = true\nurl = "{broker.url}"\nkeepalive = 5\n'
            "reconnect_min = 0.2\nreconnect_max = 1.0\n",
            f"[heartbeat]\ninterval = {HEARTBEAT}\nstale_after_intervals = {STALE_AFTER}\n",
        ]
        for name, configured in self.settings.items():
            values = dict(configured)
            if self.broken is not None and self.broken[0] == name:
                values[self.broken[1]] = self.broken[2]
            out.append(f"[collectors.{name}]\n")
            tables = {
                k: v
                for k, v in values.items()
                if isinstance(v, list) and v and isinstance(v[0], dict)
            }
            for key, value in values.items():
                if key not in tables:
                    out.append(f"{key} = {toml_value(value)}\n")
            for key, rows in tables.items():
                for row in rows:
                    out.append(f"[[collectors.{name}.{key}]]\n")
                    out.extend(f"{k} = {toml_value(v)}\n" for k, v in row.items())
        return "".join(out)

    def enabled(self) -> set[str]:
        return {n for n, s in self.settings.items() if s["enabled"]}

    def step(self, rng: random.Random) -> tuple[str, set[str]]:
        """Change the model; returns what was done and the collectors whose settings changed."""
        name = rng.choice(sorted(self.tables))
        k, now = self.tables[name], self.settings[name]
        if self.broken is not None and rng.random() < 0.6:
            self.broken = None
            return "restore the last good file", set()
        op = rng.choice(["toggle", "interval", "own", "own", "break"])
        if op == "break":
            key, value = rng.choice(k.broken)
            self.broken = (name, key, value)
            return f"break [collectors.{name}] {key} = {value!r}", set()
        self.broken = None
        if op == "toggle" or not now["enabled"]:
            now["enabled"] = not now["enabled"]
            return f"{'enable' if now['enabled'] else 'disable'} {name}", {name}
        if op == "interval" or not k.own:
            now["interval"] = rng.choice([i for i in k.intervals if i != now["interval"]])
            return f"{name} interval = {now['interval']}", {name}
        key = rng.choice(sorted(k.own))
        now[key] = rng.choice([v for v in k.own[key] if v != now[key]])
        return f"{name} {key} = {now[key]}", {name}


RUNTIME_OWN = ("gpuwarden_gpu_paused", "gpuwarden_gpu_pause_end_timestamp_seconds")


def owner(series: Series) -> str | None:
    name, labels = series
    if name in RUNTIME_OWN:
        return None
    by_label = dict(labels).get("collector")
    if by_label is not None and name.startswith("gpuwarden_collector_"):
        return by_label
    for collector, prefixes in OWNED.items():
        if name.startswith(prefixes):
            return collector
    return None


def timestamp(series: Series) -> bool:
    return series[0].endswith(("_total", "_timestamp_seconds"))


@dataclass
class Watch:
    """Scrapes and what they must show."""

    agent: AgentProcess
    high: dict[Series, float] = field(default_factory=dict)
    last: dict[Series, float] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    step: str = "start"

    def scrape(self, enabled: set[str]) -> dict[Series, float]:
        status, text = http_get(self.agent.metrics_url)
        assert status == 200, text
        now = parse_metrics(text)
        for series, value in now.items():
            if series[0].endswith("_total") and value < self.high.get(series, value):
                self.say(f"{self.step}: {series} went down {self.high[series]} -> {value}")
            self.high[series] = max(value, self.high.get(series, value))
        if now.get(("gpuwarden_health_ok", ())) != 1.0:
            self.say(f"{self.step}: gpuwarden_health_ok not 1")
        for name in enabled:
            ok = now.get(("gpuwarden_collector_success", (("collector", name),)))
            if ok == 0.0:
                self.say(f"{self.step}: collector {name} success 0")
        for (name, labels), value in now.items():
            kind = dict(labels).get("kind")
            if name == "gpuwarden_events_total" and kind in FALSE_ALARMS and value > 0:
                self.say(f"{self.step}: {kind} event: {dict(labels)}")
        self.last = now
        return now

    def say(self, violation: str) -> None:
        """Each violation once (a scrape repeats what the one before saw)."""
        if violation not in self.violations:
            self.violations.append(violation)


@pytest.fixture
def kernel_log_lines(tmp_path: Path) -> Path:
    path = tmp_path / "kern.log"
    path.write_text(
        "".join(f"2026-01-01T00:00:{i:02d}+00:00 n kernel: hello {i}\n" for i in range(5))
    )
    return path


Chooser = Callable[[Model, int], tuple[str, set[str]]]


def runs(scrape: dict[Series, float], name: str) -> float:
    return scrape.get(("gpuwarden_collector_runs_total", (("collector", name),)), 0.0)


def last_success(scrape: dict[Series, float], name: str) -> float | None:
    series = ("gpuwarden_collector_last_success_timestamp_seconds", (("collector", name),))
    return scrape.get(series)


@dataclass
class Reloads:
    """The agent on `model`, a broker subscriber, and the checks of each step and the end."""

    workdir: Path
    broker: Broker
    kernel_log: Path
    model: Model
    trace: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for folder in ("ckpt", "probe", "dev"):
            (self.workdir / folder).mkdir(exist_ok=True)
        self.agent = AgentProcess(
            self.workdir / "agent",
            entry=["-m", "tests.support.fake_nvml_agent", str(self.workdir / "dev"), "2"],
        )
        self.watch = Watch(self.agent)

    def run(self, steps: int, choose: Chooser) -> list[str]:
        """Start, then `steps` times: `choose` changes the model, the file is written, SIGHUP.
        Returns every violation."""
        self.agent.config_text = self.model.text(self.broker)
        sub = Subscriber(self.broker.port).start()
        try:
            self.agent.start(timeout=30)
            self._first_rounds()
            for number in range(steps):
                self._step(number, choose)
            self._the_broker_heard(sub)
            if "Traceback" in self.agent.log():
                self.watch.violations.append("a traceback in the agent's log")
        finally:
            sub.stop()
            code = self.agent.stop()
        if code != 0:
            self.watch.violations.append(f"exit code {code}: {self.agent.log()[-2000:]}")
        return self.watch.violations

    def _first_rounds(self) -> None:
        """Every enabled collector has succeeded once, and the benchmark has run (and failed:
        its interpreter is /bin/false) on one GPU, so that its counters exist."""
        enabled = self.model.enabled()

        def ready() -> bool:
            now = self.watch.scrape(enabled)
            if any(last_success(now, name) is None for name in enabled):
                return False
            return "benchmark" not in enabled or any(
                s[0] == "gpuwarden_benchmark_failures_total" for s in now
            )

        wait_until(ready, timeout=60, what="every collector's first round and a benchmark run")

    def _answers(self) -> int:
        log = self.agent.log()
        return log.count("configuration reloaded") + log.count("reload refused")

    def _step(self, number: int, choose: Chooser) -> None:
        watch, model = self.watch, self.model
        before, was = dict(watch.last), model.enabled()
        done, changed = choose(model, number)
        self.trace.append(done)
        watch.step = f"step {number} ({done})"
        enabled = model.enabled()
        # A collector disabled here keeps its high marks: its series go with it, and come
        # back no lower when a later step enables it again.
        with self.kernel_log.open("a") as log:
            log.write(f"2026-01-01T00:01:{number:02d}+00:00 n kernel: step {number}\n")
        answers = self._answers()
        self.agent.config_text = model.text(self.broker)
        self.agent.write_config()
        sent = time.time()
        self.agent.signal(signal.SIGHUP)
        wait_until(lambda: self._answers() > answers, timeout=20, what=f"the answer to {done}")
        quick = {n for n in enabled if model.settings[n]["interval"] <= 2.0}

        def settled() -> bool:
            # Each collector the step changed has succeeded since the SIGHUP, and the quick
            # ones the step left alone have started a round since.
            now = watch.scrape(enabled)
            fresh = all((last_success(now, n) or 0.0) >= sent for n in changed & enabled)
            return fresh and all(runs(now, n) > runs(before, n) for n in quick)

        wait_until(settled, timeout=30, what=f"rounds after {done}")
        self._check_series(before, was, enabled)
        self._check_refusal()

    def _check_series(self, before: dict[Series, float], was: set[str], enabled: set[str]) -> None:
        watch, now = self.watch, self.watch.last
        for series in before:
            who = owner(series)
            if who in enabled and who in was and timestamp(series) and series not in now:
                watch.violations.append(f"{watch.step}: {series} went missing")
        for series in now:
            if owner(series) in OWNED.keys() - enabled:
                watch.violations.append(f"{watch.step}: {series} of a disabled collector")

    def _check_refusal(self) -> None:
        watch = self.watch
        ok = watch.last.get(("gpuwarden_config_last_reload_successful", ()))
        if self.model.broken is None:
            if ok != 1.0:
                watch.violations.append(f"{watch.step}: a good file reported refused")
            return
        name, key, _ = self.model.broken
        if ok != 0.0:
            watch.violations.append(f"{watch.step}: the refused file is not reported")
        said = [line for line in self.agent.log().splitlines() if "reload refused" in line][-1]
        if not all(part in said for part in (self.agent.config_path.name, name, key)):
            watch.violations.append(f"{watch.step}: the refusal names no file or key: {said}")

    def _the_broker_heard(self, sub: Subscriber) -> None:
        self.watch.violations.extend(broker_violations(sub))


def broker_violations(sub: Subscriber) -> list[str]:
    """What the broker heard of test-node that a watcher would page on: a heartbeat gap past
    its stale limit, an unhealthy heartbeat, a status other than one `online`."""
    violations: list[str] = []
    beats = [m.json() for m in sub.on("test-node/heartbeat")]
    gaps = [b["ts"] - a["ts"] for a, b in itertools.pairwise(beats)]
    if gaps and max(gaps) >= HEARTBEAT * STALE_AFTER:
        violations.append(f"heartbeat gap {max(gaps):.2f} s: the watcher's stale")
    unhealthy = [b["health"] for b in beats if b["health"] != "ok"]
    if unhealthy:
        violations.append(f"unhealthy heartbeats: {unhealthy[:3]}")
    states = [m.json()["state"] for m in sub.on("test-node/status")]
    if states != ["online"]:
        violations.append(f"status messages {states}")
    return violations


@pytest.mark.slow
@pytest.mark.parametrize("seed", seeds())
def test_random_reload_sequences_page_nothing_and_drop_nothing(
    tmp_path: Path, broker: Broker, kernel_log_lines: Path, seed: int
) -> None:
    rng = random.Random(seed)
    model = Model(knobs(tmp_path))
    sequence = Reloads(tmp_path, broker, kernel_log_lines, model)
    violations = sequence.run(STEPS, lambda m, _: m.step(rng))
    trace = " | ".join(sequence.trace)
    assert not violations, "\n".join([f"seed {seed}: {trace}", *violations[:30]])


@pytest.mark.slow
def test_every_collector_restarted_in_turn_keeps_its_series(
    tmp_path: Path, broker: Broker, kernel_log_lines: Path
) -> None:
    """Each collector restarted by a change of one of its own keys, one after the other, all
    of them running: the class the random sequences sample, every member once."""
    tables = knobs(tmp_path)
    model = Model(tables)
    for name in tables:
        model.settings[name]["enabled"] = True
    order = sorted(tables)

    def restart(m: Model, number: int) -> tuple[str, set[str]]:
        name = order[number]
        key = sorted(tables[name].own)[0] if tables[name].own else "interval"
        values = tables[name].own.get(key, tables[name].intervals)
        m.settings[name][key] = next(v for v in values if v != m.settings[name][key])
        return f"{name} {key} = {m.settings[name][key]}", {name}

    sequence = Reloads(tmp_path, broker, kernel_log_lines, model)
    violations = sequence.run(len(order), restart)
    assert not violations, "\n".join([" | ".join(sequence.trace), *violations[:30]])


@pytest.mark.slow
def test_every_collector_disabled_and_enabled_again_takes_up_its_counters(
    tmp_path: Path, broker: Broker, kernel_log_lines: Path
) -> None:
    """Each collector disabled by one reload and enabled by the next, one after the other, all
    of them running otherwise: every counter of the process (the runtime's rounds and
    failures, the collector's own) comes back where it was, never from zero."""
    tables = knobs(tmp_path)
    model = Model(tables)
    for name in tables:
        model.settings[name]["enabled"] = True
    toggles = [name for name in sorted(tables) for _ in range(2)]

    def toggle(m: Model, number: int) -> tuple[str, set[str]]:
        name = toggles[number]
        m.settings[name]["enabled"] = not m.settings[name]["enabled"]
        return f"{'enable' if m.settings[name]['enabled'] else 'disable'} {name}", {name}

    sequence = Reloads(tmp_path, broker, kernel_log_lines, model)
    violations = sequence.run(len(toggles), toggle)
    assert not violations, "\n".join([" | ".join(sequence.trace), *violations[:30]])
