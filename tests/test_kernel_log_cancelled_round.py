"""A kernel-log round that a reload cuts short after its read: every record counts once, every
Xid is one event (one id, one outbox entry), whatever await point the cancel lands on.

The round reads a batch (its records taken from /dev/kmsg into memory), then hands it on with
its cursor, its counters and its events together. A reload that restarts or disables the
collector cancels the round's task; the cancel lands at an await. `CancelAt` drives the round's
`collect` and parks it at its k-th await, once what it awaited there has finished (a call's
thread has run: the read has read), which is where asyncio throws a cancel that came in just
then; the reload then cancels it there. k runs over every await of the round, until the round
has fewer. Checked after the next instance has read on:

- `gpuwarden_kernel_log_records_total` is the number of records written, the malformed ones
  counted once, none counted as replay-skipped (nothing predates this process's reads);
- the finding counters (`gpuwarden_kernel_log_findings_total`, the Xid counters, what the
  store holds for the next start) count each line once;
- each Xid line is one stored event with one id, queued once in the outbox (MQTT's), and
  `gpuwarden_events_total` counts it once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections import Counter
from collections.abc import Callable, Coroutine, Generator
from pathlib import Path
from typing import Any

import pytest

from agent.contracts.collector import CollectContext, CollectorDeps, CollectorSpec
from agent.contracts.model import Collection, Event, Sample
from agent.program import config_file as config
from agent.program import registry
from agent.runtime.core import Runtime
from agent.runtime.state import StateStore
from collectors._repair import XidRecurrence
from collectors.kernel_log.collector import COUNTS_KEY, KernelLogCollector, KernelLogSettings
from collectors.kernel_log.kmsg import KMSG_CURSOR_KEY, STATE_NAMESPACE
from tests.support.kmsg import FakeKmsg, record_seq, write_boot_id
from tests.support.waiting import until

GPUS = ("0000:3b:00.0", "0000:86:00.0")
CODES = {"a": (79, 31, 48), "b": (13, 94, 119)}
"""Each batch's own: a GPU and code seen again within the correlator's holdoff is counted and
raises no event, and every Xid line here must raise one."""


class CancelAt:
    """Drives one `collect` coroutine. At its `point`-th await (from 0), once the awaited
    future is done, it parks on a future of its own: the task's cancel lands there and is
    thrown into the coroutine at that await, its result dropped, as asyncio does with a
    cancel that arrives between a future's completion and the task's next step."""

    def __init__(self, point: int) -> None:
        self.point = point
        self.inner: Coroutine[Any, Any, Collection] | None = None
        """The round's `collect`, given when the round starts."""
        self.parked = asyncio.Event()
        self.finished = False
        """The round ended without reaching `point`."""
        self.awaits = 0

    def __await__(self) -> Generator[Any, Any, Collection]:
        inner = self.inner
        assert inner is not None
        value: Any = None
        thrown: BaseException | None = None
        while True:
            try:
                yielded = inner.throw(thrown) if thrown else inner.send(value)
            except StopIteration as stop:
                self.finished = True
                result: Collection = stop.value
                return result
            value, thrown = None, None
            try:
                value = yield yielded
            except BaseException as exc:  # the cancel (or any error) thrown at this await
                thrown = exc
                continue
            if self.awaits == self.point:
                self.parked.set()
                gate = asyncio.get_running_loop().create_future()
                try:
                    yield from gate.__await__()
                except BaseException as exc:
                    value, thrown = None, exc
            self.awaits += 1


class Armed(KernelLogCollector):
    """The kernel_log collector; its next round after `arm` is driven by a `CancelAt`."""

    def __init__(self, settings: KernelLogSettings, deps: CollectorDeps, rig: Rig) -> None:
        super().__init__(settings, deps, io=rig.kmsg)
        self.rig = rig

    def collect(self, ctx: CollectContext) -> Coroutine[Any, Any, Collection]:
        inner = super().collect(ctx)
        driver, self.rig.driver = self.rig.driver, None
        if driver is None:
            return inner
        driver.inner = inner
        self.rig.driven = driver

        async def driven() -> Collection:
            return await driver

        return driven()


class Rig:
    def __init__(self, tmp_path: Path, ring: FakeKmsg | None = None, timeout: float = 5.0) -> None:
        tmp_path.mkdir()
        self.kmsg = FakeKmsg() if ring is None else ring
        self.boot_id = write_boot_id(tmp_path / "boot_id", "boot-a")
        self.settings = KernelLogSettings(
            interval=0.05, timeout=timeout, path=Path("/dev/kmsg"), boot_id_path=self.boot_id
        )
        self.driver: CancelAt | None = None
        self.driven: CancelAt | None = None
        self.built: list[Armed] = []
        spec = CollectorSpec("kernel_log", "test", KernelLogSettings, self._make)
        cfg = config.parse({"prometheus": {"enabled": False}})
        self.config = dataclasses.replace(cfg, collectors={"kernel_log": self.settings})
        self.store = StateStore.open(tmp_path / "state")
        self.runtime = Runtime(
            self.config,
            self.store,
            collectors={"kernel_log": spec},
            sinks=registry.SINKS,
            boot_id="boot-a",
        )
        self.runtime.enable_outbox()  # what the MQTT sink sends: an entry per event
        self.lines: list[str] = []
        self.malformed = 0

    def _make(self, settings: KernelLogSettings, deps: CollectorDeps) -> Armed:
        self.built.append(Armed(settings, deps, self))
        return self.built[-1]

    def write_batch(self, tag: str) -> None:
        """Xids on two GPUs, an I/O error, a plain line and a record that does not parse."""
        for n, (gpu, code) in enumerate((g, c) for g in GPUS for c in CODES[tag]):
            domain, bus, device = gpu.split(".", maxsplit=1)[0].split(":")
            line = f"NVRM: Xid (PCI:{domain}:{bus}:{device}): {code}, pid={n}, name=job-{tag}"
            self.kmsg.write(line, level=3)
            self.lines.append(line)
        self.kmsg.write(f"I/O error, dev sd{tag}, sector 2048 op 0x1:(WRITE) flags 0x800", level=3)
        # A priority the kernel never writes: a record that does not parse (malformed).
        self.kmsg.records.append(f"9999,{self.kmsg.next_seq},0,-;garbage {tag}\n".encode())
        self.malformed += 1
        self.kmsg.write(f"a plain line {tag}")

    def with_settings(self, settings: KernelLogSettings) -> config.Config:
        return dataclasses.replace(self.config, collectors={"kernel_log": settings})

    def cursor_at_end(self) -> bool:
        cursor = self.runtime.state.get(STATE_NAMESPACE, KMSG_CURSOR_KEY)
        return isinstance(cursor, dict) and cursor.get("seq") == self.kmsg.next_seq - 1

    def samples(self, family: str) -> list[Sample]:
        return [s for s in self.runtime.samples() if s.family.name == family]

    def value(self, family: str, *labels: str) -> float:
        return sum(s.value for s in self.samples(family) if s.label_values[: len(labels)] == labels)


Reload = Callable[[Rig], Coroutine[Any, Any, None]]


async def restart(rig: Rig) -> None:
    await rig.runtime.reload(rig.with_settings(rig.settings.replace(interval=0.06)))


async def disable_then_enable(rig: Rig) -> None:
    await rig.runtime.reload(rig.with_settings(rig.settings.replace(enabled=False)))
    await rig.runtime.reload(rig.with_settings(rig.settings))


async def cut_short(rig: Rig, point: int, first: bool, reload: Reload) -> bool:
    """One run: the round that reads the batch parked at its `point`-th await and cut short
    there by `reload`; then the next instance reads on. False: the round has no such await."""
    runtime = rig.runtime
    rig.write_batch("a")  # in the ring before the start: the first round's backlog
    if first:  # the process's first round: it opens, loads, reads and loads the Xid boots
        rig.driver = CancelAt(point)
    await runtime.start()
    try:
        if not first:
            await until(rig.cursor_at_end, what="the first rounds")
            await runtime.settle()
            rig.driver = CancelAt(point)
            rig.write_batch("b")
        await until(lambda: rig.driven is not None, what="the armed round")
        driven = rig.driven
        assert driven is not None
        await until(lambda: driven.parked.is_set() or driven.finished, what="the round to park")
        if not driven.parked.is_set():
            return False
        await reload(rig)
        await until(rig.cursor_at_end, what="the next instance's read")
        await until(lambda: runtime.collectors["kernel_log"].rounds_done >= 1, what="a round")
        assert await runtime.settle()
        check(rig)
        return True
    finally:
        await runtime.stop()
        rig.store.close()


def check(rig: Rig) -> None:
    written = len(rig.kmsg.records) - rig.malformed
    assert rig.value("gpuwarden_kernel_log_records_total") == written
    assert rig.value("gpuwarden_kernel_log_malformed_records_total") == rig.malformed
    assert rig.value("gpuwarden_kernel_log_replay_skipped_records_total") == 0
    assert rig.value("gpuwarden_kernel_log_lost_records_total") == 0  # none was overwritten
    xids = len(rig.lines)
    assert rig.value("gpuwarden_kernel_log_findings_total", "xid") == xids
    assert rig.value("gpuwarden_kernel_log_findings_total", "io_error") == xids // 6
    assert rig.value("gpuwarden_xid_errors_total") == xids
    for gpu in GPUS:
        per_gpu = [s for s in rig.samples("gpuwarden_xid_errors_total") if gpu in s.label_values]
        assert sum(s.value for s in per_gpu) == xids // len(GPUS), per_gpu
    stored = rig.runtime.state.get(STATE_NAMESPACE, COUNTS_KEY)
    assert isinstance(stored, dict)
    assert stored["findings"] == {"io_error": xids // 6, "xid": xids}, stored
    assert sum(n for _, _, n in stored["xids"]) == xids, stored
    events = [e for e in rig.store.recent_events(limit=1000) if e.kind == "xid"]
    by_line: Counter[str] = Counter(str(e.attributes["text"]) for e in events)
    assert sorted(by_line) == sorted(rig.lines), by_line
    assert set(by_line.values()) == {1}, [line for line, n in by_line.items() if n > 1]
    ids = {e.id for e in events}
    assert len(ids) == xids
    # Batch a was in the ring before the start, batch b came after: read again, each is read
    # as it was the first time.
    predates = {str(e.attributes["text"]): e.attributes["predates_agent"] for e in events}
    assert predates == {line: "job-a" in line for line in rig.lines}, predates
    queued = Counter(entry.key for entry in rig.store.outbox_peek(limit=10_000))
    assert {i: queued[i] for i in ids} == dict.fromkeys(ids, 1), queued
    assert rig.value("gpuwarden_events_total", "gpu", "xid") == xids
    assert _announced(rig.runtime.recent_events, ids) == dict.fromkeys(ids, 1)


def _announced(events: Any, ids: set[str]) -> dict[str, int]:
    told: Counter[str] = Counter(e.id for e in events if isinstance(e, Event) and e.id in ids)
    return dict(told)


@pytest.mark.parametrize("reload", [restart, disable_then_enable], ids=["restart", "disable"])
@pytest.mark.parametrize("first", [True, False], ids=["first-round", "later-round"])
async def test_a_round_cut_short_at_any_await_counts_its_batch_once(
    tmp_path: Path, reload: Reload, first: bool
) -> None:
    points = 0
    while await cut_short(Rig(tmp_path / f"run{points}"), points, first, reload):
        points += 1
    # The first round awaits its open, its counts, its read and the Xid boots; a later one
    # at least its read.
    assert points >= (4 if first else 1), points


class SlowRing(FakeKmsg):
    """The ring; while `slow` is set, a read of the record numbered `slow_at` waits for
    `gate` (the read call times out meanwhile, and its thread finishes later)."""

    slow_at = -1

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.waiting = threading.Event()

    def read(self, fd: int, size: int) -> bytes:
        record = super().read(fd, size)
        if record_seq(record) == self.slow_at:
            self.waiting.set()
            self.gate.wait(30)
        return record


def read_timed_out(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """The read call times out after it read half the batch; its thread ends later."""
    ring = rig.kmsg
    assert isinstance(ring, SlowRing)
    ring.slow_at = ring.next_seq - 3
    return ring.gate.set


def xid_boots_timed_out(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """The first round's load of the Xid boots (after the read) outlasts its call timeout: a
    state store slow to answer."""
    load = XidRecurrence.load
    gate = threading.Event()
    calls: list[bool] = []

    def slow(self: XidRecurrence) -> None:
        if not calls:
            calls.append(True)
            gate.wait(30)
        load(self)

    monkeypatch.setattr(XidRecurrence, "load", slow)
    return gate.set


@pytest.mark.parametrize("fail", [read_timed_out, xid_boots_timed_out])
async def test_a_round_that_fails_after_its_read_reads_the_batch_again(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fail: Callable[[Rig, pytest.MonkeyPatch], Callable[[], None]],
) -> None:
    """A failed round hands nothing on: neither its cursor nor its findings. The records it
    read must come back at the next read, or they are lost: no event, no count."""
    rig = Rig(tmp_path / "run", ring=SlowRing(), timeout=0.3)
    rig.write_batch("a")
    heal = fail(rig, monkeypatch)
    runtime = rig.runtime
    await runtime.start()
    try:
        status = runtime.collectors["kernel_log"]
        await until(lambda: status.failures >= 1, what="the round that fails")
        heal()
        await until(rig.cursor_at_end, what="the batch read again")
        assert await runtime.settle()
        check(rig)
        # Read again as it was read first: the records in the ring before the start.
        events = [e for e in rig.store.recent_events(limit=1000) if e.kind == "xid"]
        assert all(e.attributes["predates_agent"] is True for e in events), events
    finally:
        await runtime.stop()
        rig.store.close()
