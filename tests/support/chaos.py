"""A seeded random schedule of faults over the real agent and a real broker, and the
delivery invariants checked at the end (tests/test_chaos.py; many seeds: scripts/chaos.py).

The node: the agent as a process on the fake NVML (tests/support/fake_nvml_agent.py, two
GPUs), its state dir a real tmpfs that fills up (tests/support/disk.py), its kernel log a file
the harness appends real `NVRM: Xid` lines to, a real mosquitto with persistence (so a broker
stopped and started loses nothing it acknowledged) and a persistent subscriber on the events
topic. `Chaos(seed).run(steps)` draws each step from `random.Random(seed)`: the same seed is
the same schedule (its timing is the machine's). Every step is logged in `trace`, so a failure
names the schedule that produced it.

What is required at the end (docs/mqtt.md, docs/metrics.md "Xid correlation"):

- every Xid put in is delivered as an `xid` event of its GPU (PCI address) and code whose time
  lies from 301 s before the Xid (the 300 s holdoff: a repeat raises no event of its own, the
  earlier event stands for it) to 60 s after it. A kernel-log line is always required (the
  file and the cursor outlive the process). An NVML Xid whose injection was taken is
  required unless the process died before it was safe: neither delivered nor in the state
  database on the disk or a spill in the runtime dir when the process was gone, after a
  kill -9 within STORE_BOUND of it (NVML's queue dies with the process) or, with the disk
  full, within SPILL_BOUND of when it waited in memory (the spill kept while the store
  cannot write holds it after that: agent/runtime/spill.py); a clean stop loses nothing, the disk full or not (what waits in memory is spilled to
  the runtime dir and adopted by the next start: agent/runtime/spill.py);
- an Xid and its twin of the other source within 5 s are one incident: at most one `xid`
  event per GPU and code in any 5 s;
- no event id is delivered with two different payloads;
- the counters carried across restarts on the same boot (`gpuwarden_events_total`, the Xid
  counters) never go down between two scrapes (after a kill -9 within SPILL_BOUND of a
  change while the store was not durable, or in a start, they may);
- the agent runs whenever it should (its process lives, /healthz answers), a broken config
  on SIGHUP leaves it running on the last good one;
- no traceback in its log.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from agent.program import registry
from tests.support.agent_proc import AgentProcess, http_get
from tests.support.disk import MIB, SmallDisk
from tests.support.fake_nvml_agent import calls_path, inject_xid, injected
from tests.support.mosquitto import Broker
from tests.support.mqtt import Received, Subscriber, persistent_broker_lines
from tests.support.waiting import wait_until

GPUS = 2
PCI = [f"0000:{0x18 + i * 0x10:02x}:00.0" for i in range(GPUS)]
"""The fake GPUs' addresses (tests/support/nvml_fake.py, FakeGpu.h200)."""
CODES = (13, 31, 43, 45, 48, 63, 64, 74, 79, 94, 95, 119)
"""Xid codes whose lines ask nothing beyond their number (no 149, no 154)."""
NODE = "chaos-node"
HOLDOFF = 300.0
TWIN_WINDOW = 5.0
STORE_BOUND = 15.0
"""Seconds within which an NVML Xid taken with the disk writable is stored (the event thread
hands it on at once, the store writes it within a second): one older is no longer excused
by a kill -9."""
SPILL_BOUND = 3.0
"""Seconds within which what waits in memory while the store is not durable (the disk full,
the store in memory) is in the spill kept in the runtime dir (agent/runtime/spill.py
`LiveSpill`: 0.2 s for an event, 1 s for a value, with a loaded machine's slack): only what
changed within it before a kill -9 is excused."""
LATE = 60.0
"""An event's time may lie this far after the Xid it stands for (a loaded machine)."""
CARRIED = ("gpuwarden_events_total", "gpuwarden_xid_errors_total", "gpuwarden_xid_confirmed_total")


@dataclass
class Xid:
    gpu: int
    code: int
    at: float
    via: str
    """`nvml` or `kmsg`."""
    required: bool = True
    safe: bool = False
    """Known delivered or on the disk (NVML only: nothing of it can be lost any more)."""
    excused: str = ""
    """Why a required Xid stopped being required (the process died before it was safe)."""

    @property
    def pci(self) -> str:
        return PCI[self.gpu]


def parse_metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, body = head.partition("{")
        labels: list[tuple[str, str]] = []
        for part in body.rstrip("}").split('",'):
            if "=" in part:
                key, _, val = part.partition("=")
                labels.append((key.strip(","), val.strip('"')))
        out[(name, tuple(sorted(labels)))] = float(value)
    return out


def carried(text: str) -> dict[tuple[str, ...], float]:
    """The carried counters, keyed so that GPU labels filled in later do not split a series:
    events by (source, kind, severity), the Xid counters by (PCI address, code)."""
    out: dict[tuple[str, ...], float] = {}
    for (name, labels), value in parse_metrics(text).items():
        if name not in CARRIED:
            continue
        have = dict(labels)
        parts = ("source", "kind", "severity") if name == CARRIED[0] else ("pci_bus_id", "xid")
        key = (name, *(have.get(part, "") for part in parts))
        out[key] = out.get(key, 0.0) + value
    return out


def metric(text: str, name: str, **labels: str) -> float | None:
    for (have, body), value in parse_metrics(text).items():
        if have == name and all(dict(body).get(k) == v for k, v in labels.items()):
            return value
    return None


def kernel_line(gpu: int, code: int, when: float) -> str:
    stamp = datetime.fromtimestamp(when, UTC).isoformat()
    bus = PCI[gpu][:-2]
    return f"{stamp} {NODE} kernel: NVRM: Xid (PCI:{bus}): {code}, pid=4242, name=train.py, Ch 00000010\n"


@dataclass
class Chaos:
    seed: int
    workdir: Path
    verbose: bool = False
    trace: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    xids: list[Xid] = field(default_factory=list)
    counters: dict[tuple[str, ...], float] = field(default_factory=dict)
    """The highest value each carried counter was scraped at."""
    lowered: set[tuple[str, ...]] = field(default_factory=set)
    stats: dict[str, int] = field(default_factory=dict)
    gpu_interval: float = 0.5
    disk_full: bool = False
    disk_full_until: float = -1.0
    """When the disk was last freed (-1: never full): an NVML Xid taken before that may have
    waited in memory."""
    disk_full_since: float = -1.0
    """When the disk was last filled (-1: never)."""
    changed_at: float = -1.0
    """When the last operation that can change the agent's state began (all but a wait)."""
    broker_up: bool = True
    broker_hung: bool = False

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.devices = self.workdir / "dev"
        self.klog = self.workdir / "kern.log"
        self.disk = SmallDisk(self.workdir / "agent" / "state", size=16 * MIB)
        self.runtime_dir = self.workdir / "run"
        """The agent's runtime dir (a spill of a clean stop on a full disk), outside the
        state disk as /run is."""
        self.broker = Broker(
            self.workdir / "broker",
            extra_config=persistent_broker_lines(self.workdir / "broker"),
        )
        self.agent = AgentProcess(
            self.workdir / "agent",
            node_id=NODE,
            entry=["-m", "tests.support.fake_nvml_agent", str(self.devices), str(GPUS)],
            core_text=f'state_retry_interval = 1.0\nruntime_dir = "{self.runtime_dir}"\n',
        )
        self.subscriber = Subscriber(
            self.broker.port,
            topic_filter=f"gpuwarden/v1/{NODE}/events",
            client_id=f"chaos-{self.seed}",
            persistent=True,
            reconnect_max=1,
        )

    # -- set-up ------------------------------------------------------------------------------

    def config(self, gpu_interval: float | None = None) -> str:
        others = "".join(
            f"[collectors.{name}]\nenabled = false\n"
            for name in registry.COLLECTORS
            if name not in ("gpu", "kernel_log")
        )
        return (
            f'[mqtt]\nenabled = true\nurl = "{self.broker.url}"\nreconnect_min = 0.1\n'
            "reconnect_max = 1.0\nconnect_timeout = 3.0\nkeepalive = 5\n"
            "metrics_interval = 3600\n"
            "[heartbeat]\ninterval = 1.0\n"
            f"[collectors.gpu]\ninterval = {gpu_interval or self.gpu_interval}\n"
            'event_wait_ms = 100\nsysfs_root = "/nonexistent"\n'
            f'[collectors.kernel_log]\npath = "{self.klog}"\ninterval = 1.0\n{others}'
        )

    @contextmanager
    def running(self) -> Iterator[Chaos]:
        self.devices.mkdir(parents=True)
        self.klog.write_text("")
        with self.disk:
            self.broker.start()
            try:
                self.subscriber.start()
                self.agent.config_text = self.config()
                self.start_agent()
                yield self
            finally:
                self.subscriber.stop()
                self.agent.stop()
                if self.broker.process is not None and self.broker_hung:
                    self.broker.process.send_signal(signal.SIGCONT)
                self.broker.stop()

    def note(self, text: str) -> None:
        line = f"{time.monotonic():.2f} {text}"
        self.trace.append(line)
        if self.verbose:
            print(f"[seed {self.seed}] {line}", flush=True)

    def fail(self, text: str) -> None:
        self.note(f"VIOLATION: {text}")
        self.violations.append(text)

    def _count(self, what: str) -> None:
        self.stats[what] = self.stats.get(what, 0) + 1

    def start_agent(self) -> None:
        calls_path(self.devices).unlink(missing_ok=True)
        self.agent.config_text = self.config()
        self.agent.start(timeout=60.0)
        self._wait_event_thread()
        # /metrics answers before the collectors' first rounds: the kernel_log collector's
        # series (the Xid counters) are absent until its first, which is no counter going
        # down; a carried counter that is absent after it is one.
        healthz = self.agent.metrics_url.replace("/metrics", "/healthz")
        wait_until(
            lambda: not http_get(healthz, 10.0)[1].startswith("starting"),
            60.0,
            "every collector's first round",
        )

    def stop_agent(self) -> None:
        """A clean stop, for a scenario of its own (the schedule restarts at once)."""
        self.agent.stop(timeout=60.0)
        self._settle_nvml("stop")
        self.note("agent stopped")

    def _wait_event_thread(self) -> None:
        """Until the new process's NVML event thread waits for events (registered for every
        GPU): an Xid pushed before that is not delivered by NVML either."""

        def waiting() -> bool:
            try:
                calls = json.loads(calls_path(self.devices).read_text())
            except (OSError, ValueError):
                return False
            return int(calls.get("nvmlEventSetWait_v2", 0)) > 0

        wait_until(waiting, 60.0, "the NVML event thread")

    # -- observations ------------------------------------------------------------------------

    def events(self) -> list[dict[str, Any]]:
        out = []
        for message in self.subscriber.on("/events"):
            try:
                out.append(message.json())
            except ValueError:
                self.fail(f"an events payload that is not JSON: {message.payload[:200]!r}")
        return out

    def scrape(self, what: str, excused: bool = False) -> str | None:
        """/metrics and /healthz of the running agent; a violation if it is dead or mute, or a
        carried counter went down. `excused`: the first scrape after a restart whose previous
        life held unsaved state (a counter may be lower: what it counted was lost with it)."""
        process = self.agent.process
        if process is None or process.poll() is not None:
            code = None if process is None else process.returncode
            self.fail(f"{what}: the agent is not running (exit {code})")
            return None
        deadline = time.monotonic() + 30.0
        while True:
            try:
                status, text = http_get(self.agent.metrics_url, timeout=10.0)
                health, _ = http_get(self.agent.metrics_url.replace("/metrics", "/healthz"), 10.0)
                if status == 200 and health in (200, 503):
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.fail(f"{what}: /metrics or /healthz does not answer")
                return None
            time.sleep(0.2)
        now = carried(text)
        for key, before in list(self.counters.items()):
            after = now.get(key, 0.0)
            if after >= before:
                continue
            if excused:
                self._count("counters lower after a life with unsaved state")
                self.note(f"{what}: {key} {before} -> {after}, excused (unsaved state)")
                self.counters[key] = after
            elif key not in self.lowered:
                self.lowered.add(key)
                self.fail(f"{what}: {key} went down from {before} to {after}")
        self.counters = {k: max(v, self.counters.get(k, 0.0)) for k, v in now.items()}
        return text

    def _matches(self, event: dict[str, Any], xid: Xid, kinds: tuple[str, ...]) -> bool:
        attributes = event.get("attributes") or {}
        return (
            event.get("kind") in kinds
            and attributes.get("pci_bus_id") == xid.pci
            and attributes.get("xid") == xid.code
            and xid.at - HOLDOFF - 1.0 <= float(event.get("time", 0)) <= xid.at + LATE
        )

    def _stored(self) -> list[dict[str, Any]]:
        """The events of the state database on the disk and of the spills in the runtime dir
        (a clean stop's), read from copies (the process is gone; the copy leaves the disk as
        the next process finds it)."""
        out = self._stored_in(self.disk.path / "state.db")
        for spilled in sorted(self.runtime_dir.glob("spill-*.db")):
            out += self._stored_in(spilled)
        return out

    def _stored_in(self, database: Path) -> list[dict[str, Any]]:
        with tempfile.TemporaryDirectory() as folder:
            for suffix in ("", "-wal", "-shm"):
                source = Path(f"{database}{suffix}")
                if source.exists():
                    shutil.copy(source, Path(folder) / source.name)
            if not (Path(folder) / database.name).exists():
                return []
            try:
                conn = sqlite3.connect(Path(folder) / database.name)
                try:
                    rows = conn.execute("SELECT body FROM events").fetchall()
                finally:
                    conn.close()
            except sqlite3.Error as exc:
                self.note(f"the stored events cannot be read: {exc}")
                return []
        out = []
        for (body,) in rows:
            try:
                out.append(json.loads(body))
            except ValueError:
                continue
        return out

    def _settle_nvml(self, how: str) -> None:
        """The process is gone: each NVML Xid not yet known safe is safe now if delivered,
        stored on the disk or spilled; else it died with the process, excused after a kill -9
        (with the disk full since it was taken, or within STORE_BOUND of it), a violation
        after a clean stop, the disk full or not."""
        open_ones = [x for x in self.xids if x.via == "nvml" and x.required and not x.safe]
        if not open_ones:
            return
        seen = self.events() + self._stored()
        kinds = ("xid", "xid_confirmed", "xid_escalated")
        for xid in open_ones:
            if any(self._matches(e, xid, kinds) for e in seen):
                xid.safe = True
            elif how == "kill" and self._lost_with_a_kill(xid):
                xid.required = False
                xid.excused = f"{how} before it was stored (disk full: {self.disk_full})"
                self._count("nvml xids lost with the process")
                self.note(
                    f"NVML Xid {xid.code} on GPU {xid.gpu} died with the process ({how}, "
                    f"{time.time() - xid.at:.2f} s after it was taken)"
                )
            else:
                self.fail(
                    f"NVML Xid {xid.code} on GPU {xid.gpu} taken at {xid.at:.2f} is neither "
                    f"delivered nor stored after a {how} {time.time() - xid.at:.1f} s later "
                    "with the disk writable"
                )
                xid.required = False

    def _lost_with_a_kill(self, xid: Xid) -> bool:
        """Whether a kill -9 now may have lost `xid` (NVML's): with the disk writable since it
        was taken, not yet stored (STORE_BOUND); with the disk full meanwhile, not yet in the
        spill kept while the store cannot write (SPILL_BOUND from when it waited there)."""
        now = time.time()
        full_meanwhile = self.disk_full or self.disk_full_until >= xid.at - 1.0
        if not full_meanwhile:
            return now - xid.at < STORE_BOUND
        waited_from = max(xid.at, self.disk_full_since)
        return now - waited_from < SPILL_BOUND

    # -- the operations ----------------------------------------------------------------------

    def op_nvml_xid(self, gpu: int | None = None, code: int | None = None) -> None:
        gpu = self.rng.randrange(GPUS) if gpu is None else gpu
        code = self.rng.choice(CODES) if code is None else code
        request = inject_xid(self.devices, gpu, code)
        wait_until(lambda: injected(request), 30.0, f"the fake to take Xid {code}")
        self.xids.append(Xid(gpu, code, time.time(), "nvml"))
        self.note(f"NVML Xid {code} on GPU {gpu}")

    def op_kmsg_xid(self, gpu: int | None = None, code: int | None = None) -> None:
        gpu = self.rng.randrange(GPUS) if gpu is None else gpu
        code = self.rng.choice(CODES) if code is None else code
        now = time.time()
        with self.klog.open("a") as log:
            log.write(kernel_line(gpu, code, now))
        self.xids.append(Xid(gpu, code, now, "kmsg"))
        self.note(f"kernel-log Xid {code} on GPU {gpu}")

    def op_twin_xid(self) -> None:
        gpu, code = self.rng.randrange(GPUS), self.rng.choice(CODES)
        first, second = (
            (self.op_nvml_xid, self.op_kmsg_xid)
            if self.rng.random() < 0.5
            else (self.op_kmsg_xid, self.op_nvml_xid)
        )
        first(gpu, code)
        time.sleep(self.rng.uniform(0.0, 1.0))
        second(gpu, code)

    def op_kill9(self) -> None:
        self._restart(signal.SIGKILL, "kill")

    def op_term(self) -> None:
        self._restart(signal.SIGTERM, "stop")

    def op_term_then_kill(self) -> None:
        """SIGTERM, then kill -9 in the stop (a unit manager's stop timeout, made short)."""
        self._restart(signal.SIGTERM, "kill", late_kill=self.rng.uniform(0.0, 1.0))

    def op_kill9_in_start(self) -> None:
        self._restart(signal.SIGKILL, "kill", early=True)

    def _kill_in_start(self) -> None:
        """Started and killed again before it is ready: the store opening (or moving back
        from memory), the first rounds, the backlog read."""
        self.agent.write_config()
        self.agent.start(wait=False)
        pause = self.rng.uniform(0.0, 2.0)
        time.sleep(pause)
        assert self.agent.process is not None
        self.agent.process.kill()
        code = self.agent.process.wait(30.0)
        self.agent.process = None
        self.note(f"agent killed {pause:.2f} s into its start (exit {code})")

    def _restart(
        self, signum: int, how: str, early: bool = False, late_kill: float | None = None
    ) -> None:
        before = self.scrape(f"before the {how}")
        unsaved = before is None or any(
            (metric(before, name) or 0.0) > 0
            for name in (
                "gpuwarden_state_store_queued_events",
                "gpuwarden_state_store_queued_values",
                "gpuwarden_state_store_write_failing",
            )
        )
        unsaved = unsaved or metric(before or "", "gpuwarden_state_store_durable") != 1.0
        # A clean stop spills what is unsaved (agent/runtime/spill.py): nothing is excused.
        unsaved = unsaved and not (signum == signal.SIGTERM and late_kill is None)
        # A kill -9: the spill kept while running holds all but what changed within its
        # delay (and the first moments of a start, before the store is open).
        unsaved = unsaved and (early or time.time() - self.changed_at < SPILL_BOUND)
        process = self.agent.process
        assert process is not None
        process.send_signal(signum)
        if late_kill is not None:
            try:
                process.wait(late_kill)
            except subprocess.TimeoutExpired:
                process.kill()
                self.note(f"killed {late_kill:.2f} s into the stop")
        try:
            code = process.wait(60.0)
        except Exception:
            self.fail(f"the agent did not end within 60 s of {signum!r}")
            process.kill()
            code = process.wait(10.0)
        if signum == signal.SIGTERM and late_kill is None and code != 0:
            self.fail(f"SIGTERM: exit code {code}")
        self.agent.process = None
        self.note(f"agent {how} (exit {code})")
        self._settle_nvml(how)
        time.sleep(self.rng.uniform(0.0, 1.0))
        if early:
            self._kill_in_start()
        try:
            self.start_agent()
        except (RuntimeError, TimeoutError) as exc:
            self.fail(f"the agent did not start again: {str(exc)[-2000:]}")
            raise
        self.note(f"agent started again (unsaved state before: {unsaved})")
        self.scrape(f"after the {how}", excused=unsaved)

    def op_hup_same(self) -> None:
        self.agent.write_config()
        self.agent.signal(signal.SIGHUP)
        self.note("SIGHUP, config unchanged")

    def op_hup_changed(self) -> None:
        self.gpu_interval = 0.7 if self.gpu_interval == 0.5 else 0.5
        self.agent.config_text = self.config()
        self.agent.write_config()
        self.agent.signal(signal.SIGHUP)
        self.note(f"SIGHUP, gpu interval {self.gpu_interval}")

        def applied() -> bool:
            status, text = http_get(self.agent.metrics_url, timeout=10.0)
            interval = metric(text, "gpuwarden_collector_interval_seconds", collector="gpu")
            return status == 200 and interval == self.gpu_interval

        try:
            wait_until(applied, 30.0, f"the gpu interval {self.gpu_interval} applied")
        except TimeoutError as exc:
            self.fail(str(exc))

    def op_hup_broken(self) -> None:
        good = self.gpu_interval
        self.agent.config_path.write_text(
            self.agent.config_path.read_text().replace(
                f"[collectors.gpu]\ninterval = {good}\n", "[collectors.gpu]\ninterval = -5\n"
            )
        )
        self.agent.signal(signal.SIGHUP)
        self.note("SIGHUP, broken config")

        def refused() -> bool:
            status, text = http_get(self.agent.metrics_url, timeout=10.0)
            return status == 200 and metric(text, "gpuwarden_config_last_reload_successful") == 0

        try:
            wait_until(refused, 30.0, "the broken config refused")
        except TimeoutError as exc:
            self.fail(str(exc))
        text = self.scrape("after a broken config")
        if text is not None:
            interval = metric(text, "gpuwarden_collector_interval_seconds", collector="gpu")
            if interval != good:
                self.fail(f"after a broken config the gpu interval is {interval}, not {good}")
        self.agent.write_config()  # the operator fixes the file; the next SIGHUP reads it

    def op_broker_stop(self) -> None:
        if not self.broker_up:
            return self.op_broker_start()
        self._broker_cont()
        self.broker.stop()
        self.broker_up = False
        self.note("broker stopped")
        return None

    def op_broker_start(self) -> None:
        if self.broker_up:
            return self.op_broker_stop()
        self.broker.start()
        self.broker_up = True
        self.note("broker started")
        return None

    def op_broker_hang(self) -> None:
        if not self.broker_up:
            return self.op_broker_start()
        if self.broker_hung:
            return self._broker_cont()
        assert self.broker.process is not None
        self.broker.process.send_signal(signal.SIGSTOP)
        self.broker_hung = True
        self.note("broker SIGSTOP")
        return None

    def _broker_cont(self) -> None:
        if self.broker_hung and self.broker.process is not None:
            self.broker.process.send_signal(signal.SIGCONT)
            self.note("broker SIGCONT")
        self.broker_hung = False

    def op_disk(self) -> None:
        if self.disk_full:
            self.disk.free()
            self.disk_full = False
            self.disk_full_until = time.time()
            self.note("disk freed")
        else:
            self.disk.fill()
            self.disk_full = True
            self.disk_full_since = time.time()
            self.note("disk full")

    def op_wait(self) -> None:
        pause = self.rng.uniform(0.05, 2.0)
        time.sleep(pause)
        self.note(f"waited {pause:.2f} s")

    OPS: tuple[tuple[str, float], ...] = (
        ("op_nvml_xid", 3.0),
        ("op_kmsg_xid", 3.0),
        ("op_twin_xid", 2.0),
        ("op_kill9", 2.0),
        ("op_term", 1.0),
        ("op_kill9_in_start", 1.0),
        ("op_term_then_kill", 1.0),
        ("op_hup_same", 0.5),
        ("op_hup_changed", 0.5),
        ("op_hup_broken", 0.5),
        ("op_broker_stop", 1.0),
        ("op_broker_hang", 1.0),
        ("op_disk", 1.5),
        ("op_wait", 2.0),
    )

    def step(self) -> None:
        names = [name for name, _ in self.OPS]
        weights = [weight for _, weight in self.OPS]
        name = self.rng.choices(names, weights)[0]
        self._count(name)
        if name != "op_wait":
            self.changed_at = time.time()
        operation: Callable[[], None] = getattr(self, name)
        operation()
        self.scrape(f"after {name}")

    # -- the end -----------------------------------------------------------------------------

    def heal(self) -> None:
        self._broker_cont()
        if not self.broker_up:
            self.broker.start()
            self.broker_up = True
        if self.disk_full:
            self.disk.free()
            self.disk_full = False
            self.disk_full_until = time.time()
        self.note("healed: broker up, disk free")
        if self.agent.process is None or self.agent.process.poll() is not None:
            self.fail("the agent is not running at the heal")
            self.start_agent()

    def drained(self) -> bool:
        status, text = http_get(self.agent.metrics_url, timeout=10.0)
        if status != 200:
            return False
        depth = metric(text, "gpuwarden_mqtt_outbox_entries", kind="event")
        return depth == 0 and all(self._delivered(x) for x in self.xids if x.required)

    def _delivered(self, xid: Xid) -> bool:
        return any(self._matches(e, xid, ("xid",)) for e in self.events())

    def check(self) -> None:
        try:
            wait_until(self.drained, 90.0, "the outbox drained and every Xid delivered")
        except TimeoutError as exc:
            self.note(str(exc))
        self.scrape("at the end")
        healthz = self.agent.metrics_url.replace("/metrics", "/healthz")
        try:  # all healed: nothing left for the node to complain of
            wait_until(lambda: http_get(healthz, 10.0)[0] == 200, 30.0, "/healthz 200")
        except TimeoutError:
            self.fail(f"/healthz after the heal: {http_get(healthz, 10.0)}")
        for xid in self.xids:
            if xid.required and not self._delivered(xid):
                self.fail(
                    f"{xid.via} Xid {xid.code} on GPU {xid.gpu} at {xid.at:.2f} never delivered"
                )
        self._check_ids(self.subscriber.on("/events"))
        self._check_twins(self.events())
        log = self.agent.log()
        if "Traceback" in log:
            at = log.index("Traceback")
            self.fail(f"a traceback in the agent's log:\n{log[max(0, at - 500) : at + 3000]}")

    def _check_ids(self, messages: list[Received]) -> None:
        payloads: dict[str, Any] = {}
        for message in messages:
            event = message.json()
            before = payloads.setdefault(str(event.get("id")), event)
            if before != event:
                self.fail(f"event id {event.get('id')} delivered as {before} and as {event}")

    def _check_twins(self, events: list[dict[str, Any]]) -> None:
        alerts: dict[tuple[str, int], dict[str, float]] = {}
        for event in events:
            if event.get("kind") != "xid":
                continue
            attributes = event.get("attributes") or {}
            key = (str(attributes.get("pci_bus_id")), int(attributes.get("xid", -1)))
            alerts.setdefault(key, {})[str(event["id"])] = float(event["time"])
        for key, ids in alerts.items():
            times = sorted(ids.values())
            for a, b in itertools.pairwise(times):
                if b - a < TWIN_WINDOW:
                    self.fail(f"two xid alerts for {key} {b - a:.2f} s apart: {ids}")

    def run(self, steps: int) -> list[str]:
        with self.running():
            self.scrape("at the start")
            for _ in range(steps):
                self.step()
            self.heal()
            self.check()
        self.stats["xids"] = len(self.xids)
        self.stats["xids required"] = sum(x.required for x in self.xids)
        return self.violations


def report(chaos: Chaos) -> str:
    return (
        f"seed {chaos.seed}: {len(chaos.violations)} violation(s)\n"
        + "\n".join(chaos.violations)
        + "\n-- schedule --\n"
        + "\n".join(chaos.trace)
        + f"\n-- stats -- {chaos.stats}\n-- agent log tail --\n{chaos.agent.log()[-4000:]}"
    )


def env_seeds(default: list[int]) -> list[int]:
    text = os.environ.get("GPUWARDEN_CHAOS_SEEDS", "")
    return [int(s) for s in text.split(",") if s.strip()] or default
