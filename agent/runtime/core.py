"""The runtime: schedules collectors, keeps the snapshot, stores and fans out events, knows health.

Each collector runs in its own task on its own interval. A collector that raises or hangs
changes its own status series and nothing else. The snapshot is replaced per collector after
each round; a scrape renders the last snapshot and never waits on hardware. Events are stored
(and queued in the outbox) before anyone is told. The state store is written from one thread
of its own, never on the event loop; a store that cannot write is store_guard.py's business.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import threading
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

import structlog

from agent.contracts.clock import Stamp
from agent.contracts.collector import (
    Collector,
    CollectorDeps,
    CollectorSettings,
    CollectorSpec,
    JSONValue,
    KeyValueStore,
    SharedServices,
    WakeableCollector,
)
from agent.contracts.config import Config
from agent.contracts.errors import GpuwardenError, StateStoreError
from agent.contracts.heartbeat import HeartbeatSettings
from agent.contracts.model import (
    ActiveRepair,
    Event,
    MetricFamily,
    MetricType,
    RepairAction,
    Sample,
    Severity,
)
from agent.contracts.pause import PauseHistory, PauseSettings, PauseState
from agent.contracts.sink import EventListener, Health, Sink, SinkLedger, SinkSpec
from agent.runtime import logs
from agent.runtime.blocking import PooledCaller
from agent.runtime.memory import TRIM_INTERVAL, HeapTrimmer
from agent.runtime.metrics import RuntimeMetrics
from agent.runtime.pause import PauseControl
from agent.runtime.repairs import RepairLedger
from agent.runtime.rounds import CollectorPool, Failure, RoundOutcome, collector_pool, run_round
from agent.runtime.spill import LiveSpill
from agent.runtime.state import IN_MEMORY_PROBLEMS, KvChanges, StateStore
from agent.runtime.store_guard import RETRY_EVERY, CollectorState, StoreGuard
from agent.runtime.systemd import Supervisor

log = structlog.get_logger(component="runtime")

P = ParamSpec("P")
T = TypeVar("T")

MIN_ROUND_GAP = 0.1
"""Seconds at least between the end of a round and a woken next round (WakeableCollector).
A busy log is read in batches: 200 noise lines a second cost the agent 1.5 % of a core with
0.1 s (10 rounds a second) and 4 % with 0.02 s (48), for a p99 from record to PUBACK of 0.12 s
against 0.01 s, both far inside the 1 s asked (bench/kernel_log_latency.py, docs/MEASUREMENTS.md)."""
STORE_IDLE_CHECK = 5.0
"""Seconds the store writer sleeps at most: a value held without a wake-up is written then."""
CLEAR_BOUND = 10.0
"""Seconds `clear_repairs` waits for the ledger to take its events in (a stalled disk)."""


async def _bounded(closing: Awaitable[None], seconds: float, kind: str, name: str) -> None:
    """Await a stop or close for at most `seconds`; a failure is logged, never raised."""
    try:
        await asyncio.wait_for(closing, seconds)
    except Exception as exc:
        log.warning(f"{kind} did not stop cleanly", name=name, error=repr(exc))


async def cancel_tasks(tasks: Sequence[asyncio.Task[None]]) -> None:
    """Cancel until done: on Python 3.11 `wait_for` can swallow a cancellation that races
    with its inner future finishing, and the task would run on."""
    pending = [task for task in tasks if not task.done()]
    while pending:
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=0.5)
        pending = [task for task in pending if not task.done()]
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            log.warning(
                "task ended with an error", task=task.get_name(), error=repr(task.exception())
            )


EVENT_RETENTION = 30 * 86400.0
"""Seconds of event history kept in the state store (diag bundles and `recent_events`)."""
BOOT_NAMESPACE, BOOT_KEY = "runtime", "events_boot_id"
"""Where the runtime keeps the boot its stored events are of (`stored_events`)."""


EVENT_COUNTS_NAMESPACE = "events_total"
"""Where `gpuwarden_events_total` is kept: one key per (source, kind, severity), JSON
`[source, kind, severity]`, whose value is `{"boot": id, "count": n}`."""

EventKey = tuple[str, str, str]


def _event_key(event: Event) -> EventKey:
    return (event.source, event.kind, event.severity.label)


def _stored_event_counts(
    store: StateStore, boot: str
) -> tuple[Counter[EventKey], Counter[EventKey]]:
    """The event counts the process's last lives stored on boot `boot` (none for an unknown
    boot: a count carried across a reboot would stand for nothing), twice."""
    counts: Counter[EventKey] = Counter()
    if not boot:
        return counts, Counter()
    try:
        stored = store.items(EVENT_COUNTS_NAMESPACE)
    except StateStoreError as exc:
        log.warning("event counts not read; counting from zero", error=str(exc))
        return counts, Counter()
    for key, value in stored.items():
        try:
            source, kind, severity = json.loads(key)
        except (ValueError, TypeError):
            continue
        if not isinstance(value, dict) or value.get("boot") != boot:
            continue
        count = value.get("count")
        if isinstance(count, int) and not isinstance(count, bool) and count > 0:
            counts[(str(source), str(kind), str(severity))] = count
    return counts, Counter(counts)


def _stored_boot(store: StateStore) -> str | None:
    try:
        value = store.get(BOOT_NAMESPACE, BOOT_KEY)
    except StateStoreError:
        return None
    return value if isinstance(value, str) else None


@dataclass
class CollectorStatus:
    name: str
    settings: CollectorSettings
    collector: Collector
    caller: PooledCaller
    executor: concurrent.futures.Executor
    samples: Sequence[Sample] = ()
    success: bool | None = None
    success_stamp: Stamp | None = None
    """The last round that succeeded: its wall-clock time and an age that does not step."""
    last_attempt: float | None = None
    duration: float = 0.0
    runs: int = 0
    rounds_done: int = 0
    failures: int = 0
    last_error: str = ""
    started_stamp: Stamp = field(default_factory=Stamp.now)
    task: asyncio.Task[None] | None = None
    paused: bool = False
    """Asked to let go of the GPUs (agent/runtime/pause.py) and not resumed since."""
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    """Set to run the next round now (the first after a pause)."""
    last_events: Sequence[Event] = ()
    """The events of the last round that succeeded."""
    last_round_began: float = float("-inf")
    """When (time.monotonic()) the last round that ended began: a round that began paused and
    ended after a resume is not the first round after it (agent/runtime/pause.py)."""
    first_round_events: Sequence[Event] | None = None
    """The events of this instance's first round, once it has ended (none if it failed): a
    resume during the reload that started this instance reads them, however late it looks."""
    round_watchers: list[Callable[[], None]] = field(default_factory=list)
    """Called after each round ends, in the loop, before the next begins (the resume's wait
    for the first round after the pause reads that round's events, not a later one's)."""
    stale_kept: bool = False
    """Stale when a reload restarted it: stale until a round succeeds, whatever its new
    interval and timeout allow."""

    def carry_over(self, previous: CollectorStatus, stale: bool) -> None:
        """Take over the record of the instance this one replaces (a reload restarted the
        collector): its counters, its last outcome and when it last succeeded are the
        collector's, not the instance's. A reload is no success: an instance that replaces
        one found `stale` stays stale until a round succeeds (neither cleared nor raised
        again by the reload), and one that replaces an instance whose rounds were failing
        (or had never succeeded) counts its staleness from where that one did. One that
        replaces a healthy instance counts from now, under its own interval."""
        self.samples = previous.samples  # the snapshot's, until this instance's first round
        self.runs, self.failures = previous.runs, previous.failures
        self.success, self.last_error = previous.success, previous.last_error
        self.success_stamp, self.last_attempt = previous.success_stamp, previous.last_attempt
        self.duration = previous.duration
        if previous.success is not True:
            self.started_stamp = previous.stale_since()
        self.stale_kept = stale

    def stale_since(self) -> Stamp:
        """Since when this collector has gone without a success (the staleness clock): its
        last success, or its start when that is later (or there was none)."""
        success = self.success_stamp
        if success is None or success.steady < self.started_stamp.steady:
            return self.started_stamp
        return success

    def stale_from(self) -> float:
        """The wall-clock time of `stale_since`."""
        return self.stale_since().wall

    @property
    def last_success(self) -> float | None:
        """Wall-clock time of the last round that succeeded (None: none yet)."""
        return None if self.success_stamp is None else self.success_stamp.wall

    @last_success.setter
    def last_success(self, wall: float | None) -> None:
        self.success_stamp = None if wall is None else Stamp.at(wall)

    @property
    def started(self) -> float:
        return self.started_stamp.wall

    def last_success_age(self, now: float | None = None) -> float | None:
        return None if self.success_stamp is None else self.success_stamp.age(now)

    def stale_for(self, now: float | None = None) -> float:
        """Seconds without a success (`stale_since`), on a clock that does not step: a step
        of the wall clock is no staleness, and hides none."""
        return self.stale_since().age(now)


@dataclass(frozen=True)
class StartFailure:
    """A configured collector whose settings could not be built into a collector."""

    settings: CollectorSettings
    error: str


@dataclass(frozen=True)
class ReloadReport:
    """What a reload did with each change of the file."""

    applied: tuple[str, ...] = ()
    pending_restart: tuple[str, ...] = ()
    """Changed keys the agent reads only at start: not applied, shown as a notice."""
    failed: tuple[str, ...] = ()
    """Collectors whose new settings could not be built (a previous instance runs on)."""
    unused: tuple[str, ...] = ()
    """Changed keys of sections the agent does not read ([watch] is `gpuwarden watch`'s)."""


@dataclass(frozen=True)
class StaleItem:
    kind: str  # collector | sink
    name: str
    seconds: float
    reason: str

    def problem(self) -> str:
        if self.kind == "collector":
            return f"collector {self.name} stale for {self.seconds:.0f} s ({self.reason})"
        return f"sink {self.name} has not delivered for {self.seconds:.0f} s ({self.reason})"


class Runtime:
    _announcing: Sequence[Event] = ()
    """The events the store writer is storing now, to be announced next."""
    _clock_steps_told = 0
    """How many of the store's clock steps have been told (an event each)."""
    _disk_task: asyncio.Task[None] | None = None
    """Moving a store that started in memory back to the disk (`_back_to_disk`)."""
    live_spill: LiveSpill | None = None
    """The spill kept up to date while the store is not durable (the program starts it:
    agent/runtime/spill.py); its trouble is a health problem."""

    def __init__(
        self,
        config: Config,
        store: StateStore,
        *,
        collectors: Mapping[str, CollectorSpec[Any]],
        sinks: Mapping[str, SinkSpec[Any]],
        boot_id: str = "",
    ) -> None:
        """`collectors` and `sinks`: every component that may run, by name (the program's
        registry; tests hand in their own). Which of them run is the configuration's say.

        `config` is what runs: its core settings and sections stay as started (a reload
        applies only collector settings and log_level), its collectors are the last configured
        ones. `configured` is the last file loaded; `collectors` what actually runs, and
        `start_failures` the configured collectors that could not be built. `boot_id`: this
        boot's (the program reads it); the repair ledger drops what a reboot performed."""
        self.config = config
        self.configured = config
        self.pools: dict[str, CollectorPool] = {}
        """Each collector's pool, kept across its restarts (see `reload`)."""
        self.start_failures: dict[str, StartFailure] = {}
        self.pending_restart: tuple[str, ...] = ()
        self.reload_error: str | None = None
        """Why the last reload was refused (the file could not be loaded); None after a good one."""
        self.last_reload_ok = True
        self._specs = dict(collectors)
        self._sink_specs = dict(sinks)
        # _events_boot: the boot the stored events were raised in (the last life's), or None.
        self.store, self.boot_id, self._events_boot = store, boot_id, _stored_boot(store)
        self.node_id = config.node_id
        self.shared = SharedServices()
        self.supervisor = Supervisor()
        self.started_stamp = Stamp.now()
        self.collectors: dict[str, CollectorStatus] = {}
        self.sinks: dict[str, Sink] = {}
        self.ledger: dict[str, SinkLedger] = {}
        # events_by_key: `gpuwarden_events_total`, the events announced by (source, kind,
        # severity) on this boot, with what the process's last lives stored (`_count_change`);
        # _events_counted: what it will be once every event queued for the store is announced.
        self.events_by_key, self._events_counted = _stored_event_counts(store, boot_id)
        self.recent_events: deque[Event] = deque(maxlen=200)
        self.outbox_enabled = False
        """Events are queued in the outbox too: a durable sink asked for it (enable_outbox)."""
        self.first_round = asyncio.Event()
        self.metrics = RuntimeMetrics(self)
        self._listeners: list[EventListener] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._pending_events: list[Event] = []
        self.guard = StoreGuard(store, config.state_dir)
        """What waits to be written, and the policy for a store that cannot write."""
        # Its changes are stored with the event that makes them (`_emit_now`), not after.
        self.repair_ledger = RepairLedger(self.guard, boot_id, persist_on_apply=False)
        """The repair actions required now (read before the loop runs; writes are held by the
        guard and stored by the store writer, never on the loop)."""
        pause_settings = config.sections.get("pause")
        self.pause = PauseControl(
            self.guard,
            pause_settings if isinstance(pause_settings, PauseSettings) else PauseSettings(),
            boot_id,
            collectors=lambda: self.collectors,
            emit=self.emit,
            flush=lambda: self.in_store_thread(self.guard.flush, self.outbox_enabled),
        )
        """Releasing the GPUs on request (`gpuwarden pause`); kept across a restart."""
        self.shared.put(PauseHistory, self.pause.history)  # findings judged by when logged
        self._store_thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="gpuwarden-state"
        )
        self._collector_states: dict[str, CollectorState] = {}
        self._unannounced: list[Event] = []
        """Events queued for the store and not yet announced (logged, told to listeners)."""
        self._store_wake = asyncio.Event()
        self._retry_at = 0.0
        self._writer_task: asyncio.Task[None] | None = None
        self._sink_tasks: dict[str, asyncio.Task[None]] = {}
        self._monitor_task: asyncio.Task[None] | None = None
        self.stale: dict[tuple[str, str], StaleItem] = {}
        """What the health monitor last found stale: (collector|sink, name) -> item."""
        for problem in store.problems:
            self._pending_events.append(
                Event(
                    source="state",
                    kind=problem.kind,
                    severity=Severity.CRITICAL,
                    repair_action=RepairAction.NONE,
                    message=problem.message,
                    action=problem.action,
                    subject=str(config.state_dir),
                )
            )

    # -- events -----------------------------------------------------------------------------

    def enable_outbox(self) -> None:
        self.outbox_enabled = True

    def beat(self, name: str) -> None:
        self.supervisor.beat(name)

    def subscribe(self, listener: EventListener) -> None:
        self._listeners.append(listener)

    def repairs(self) -> list[ActiveRepair]:
        return self.repair_ledger.active()

    async def clear_repairs(
        self, chosen: Sequence[ActiveRepair], by: str, reason: str
    ) -> list[ActiveRepair]:
        """A person says these requirements are met (a GPU replaced; a repair whose finding
        has no all-clear of its own): one `repair_cleared` event each, of the entry's source
        and subject, clearing its kind there, stored and sent like any other event. Returns
        what they cleared (every requirement of that kind on that subject) once the ledger
        has taken them in, so that an action (Slurm's resume) has seen them too."""
        findings: dict[tuple[str, str, str], list[ActiveRepair]] = {}
        for repair in chosen:  # one event per finding: it clears every action of it
            findings.setdefault((repair.source, repair.kind, repair.subject), []).append(repair)
        events = [
            Event(
                source=source,
                kind="repair_cleared",
                severity=Severity.INFO,
                repair_action=RepairAction.NONE,
                clears=(kind,),
                subject=subject,
                message=f"{', '.join(r.action.value for r in repairs)} for {subject} ({kind}) "
                f"cleared by {by}: {reason}",
                attributes={
                    "actions": ",".join(r.action.value for r in repairs),
                    "cleared_kind": kind,
                    "by": by,
                    "reason": reason,
                },
                aliases=tuple(sorted({a for r in repairs for a in r.aliases})),
            )
            for (source, kind, subject), repairs in findings.items()
        ]
        before = {r.key: r for r in self.held_repairs()}
        after = {r.key for r in self.repair_ledger.after([*self._pending_now(), *events])}
        for event in events:
            self.emit(event)
        gone = [repair for key, repair in before.items() if key not in after]
        # Until every one of them is announced (the ledger takes an event in then), the
        # events emitted before them with it: a raise still on its way would otherwise
        # land after this returns.
        await self._until_announced({event.id for event in events}, CLEAR_BOUND)
        return gone

    async def settle(self, bound: float = CLEAR_BOUND) -> bool:
        """Wait until every event emitted before this call (from a thread too) is stored and
        announced, in order: what `recent_events`, the ledger and the listeners then show is
        what was emitted. False if `bound` seconds passed first."""
        await asyncio.sleep(0)  # what threads handed to the loop before now joins the queue
        return await self._until_announced({e.id for e in self._pending_now()}, bound)

    async def _until_announced(self, ids: set[str], bound: float) -> bool:
        deadline = time.monotonic() + bound
        while any(e.id in ids for e in self._pending_now()):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    def _pending_now(self) -> list[Event]:
        return [*self._announcing, *self._unannounced]

    def held_repairs(self) -> list[ActiveRepair]:
        """The repairs held once the events emitted so far are taken in (the ledger takes an
        event in when it is announced, after it is stored): what a collector instance that
        starts now takes over from the one it replaces, whose last round may be on its way
        to the store."""
        return self.repair_ledger.after(self._pending_now())

    def stored_events(self, source: str, kinds: Sequence[str], since: float) -> list[Event]:
        """The stored events of `source` of `kinds` from `since` on (CollectorDeps): a read
        of the store in the caller's thread, for a collector's construction; empty when the
        store cannot be read (the collector then starts without its last life's events), and
        when they are of another boot, or of one not known (a store of before the boot was
        kept): what a reboot ended is not taken over."""
        if self.boot_id and self._events_boot != self.boot_id:
            return []
        try:
            return self.store.events_since(source, kinds, since)
        except StateStoreError as exc:
            log.warning("cannot read stored events", source=source, error=str(exc))
            return []

    def pause_state(self) -> PauseState | None:
        return self.pause.state

    def emit(self, event: Event) -> None:
        """Record an event. Thread-safe: background threads may call it."""
        loop = self._loop
        if loop is not None and threading.get_ident() != self._loop_thread:
            loop.call_soon_threadsafe(self._emit_now, event)
        elif loop is None:
            self._pending_events.append(event)
        else:
            self._emit_now(event)

    def emit_with(
        self, events: Sequence[Event], values: Mapping[tuple[str, str], JSONValue]
    ) -> None:
        """Emit `events` and key-value changes stored in the transaction of the last of them
        (after them; none: stored at the writer's next pass). Thread-safe
        (`CollectorDeps.emit_with`)."""
        changes: KvChanges = {
            key: None if value is None else json.dumps(value) for key, value in values.items()
        }
        loop = self._loop
        if loop is not None and threading.get_ident() != self._loop_thread:
            loop.call_soon_threadsafe(self._emit_now_all, list(events), changes)
        elif loop is None:
            self._pending_events.extend(events)
            self.guard.hold(changes)
        else:
            self._emit_now_all(events, changes)

    def _emit_now(self, event: Event) -> None:
        """On the loop: queue the event; the store writer stores it, with whatever else waits,
        before any listener or log line hears of it."""
        self._emit_now_all([event], {})

    def _emit_now_all(self, events: Sequence[Event], values: KvChanges) -> None:
        """`_emit_now` for each of `events`, then `values` (a round's state), at once."""
        queued: list[tuple[Event, KvChanges | None]] = []
        for emitted in events:
            event = emitted if emitted.node else dataclasses.replace(emitted, node=self.node_id)
            # What it does to the repair ledger goes into the store in the event's
            # transaction: a kill after that commit must not leave the event stored and the
            # requirement lost.
            # And its count (gpuwarden_events_total), so that no kill separates the two.
            changes = self.repair_ledger.changes(event)
            changes.update(self._count_change(event))
            queued.append((event, changes))
        self.guard.queue_round(queued, values)
        self._unannounced.extend(event for event, _ in queued)
        self._store_wake.set()

    def _count_change(self, event: Event) -> KvChanges:
        """The stored count of the event's (source, kind, severity) once it is counted: a
        key of its own, written in the event's transaction. Never derived from the stored
        events: pruning the history must not lower it (a lower value reads as a reset to
        Prometheus, and increase() as a rise). Of this boot only; nothing for an unknown one.
        An event the store's queue drops keeps its count (store_guard.py)."""
        key = _event_key(event)
        self._events_counted[key] += 1
        if not self.boot_id:
            return {}
        value = {"boot": self.boot_id, "count": self._events_counted[key]}
        return {(EVENT_COUNTS_NAMESPACE, json.dumps(list(key))): json.dumps(value)}

    def flush_events(self) -> None:
        """Store what waits and announce it, now and in the caller's thread: for start and
        stop, when no store writer runs. While it runs, it does this off the loop (`settle`
        waits for it): a flush here would announce what waits before the batch the writer
        has in hand, out of order, so it is refused."""
        if self._writer_task is not None and not self._writer_task.done():
            raise RuntimeError("flush_events while the store writer runs: await settle()")
        for _ in range(3):  # an announcement may raise a store event, stored by the next pass
            announce, self._unannounced = self._unannounced, []
            if self.guard.pending:
                self._flushed(self.guard.flush(self.outbox_enabled))
            self._announce_all(announce)
            if not self._unannounced:
                break

    @property
    def state(self) -> KeyValueStore:
        """The key-value store for code outside a collection round (a sink's birth number):
        a write never raises, and is stored by the store writer."""
        return self.guard

    async def in_store_thread(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run a state-store call in the runtime's one store thread: SQLite (a checkpoint, a
        bound check over 100k entries, a disk that stalls) never holds up the event loop,
        and the store's users take turns in order."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._store_thread, functools.partial(fn, *args, **kwargs)
        )

    async def _store_writer(self) -> None:
        """Store what waits (events, state values) in the store thread, then announce the
        events. While writes fail: announce at once, try again every RETRY_EVERY seconds."""
        while True:
            await self._store_wait()
            self._store_wake.clear()
            announce, self._unannounced = self._unannounced, []
            self._announcing = announce
            try:
                if self.guard.pending and time.monotonic() >= self._retry_at:
                    ok = await self.in_store_thread(self.guard.flush, self.outbox_enabled)
                    self._flushed(ok)
            except asyncio.CancelledError:
                self._unannounced[:0] = announce  # stop() stores and announces them
                raise
            except Exception:  # a bug must not end the writes for good: retried as a refusal
                log.exception("the state writer failed; retrying")
                self._flushed(False)
            finally:
                self._announcing = ()
            self._announce_all(announce)

    async def _store_wait(self) -> None:
        if self._unannounced:
            return
        timeout = STORE_IDLE_CHECK
        if self.guard.pending:
            timeout = max(0.0, self._retry_at - time.monotonic())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._store_wake.wait(), timeout)

    def _flushed(self, ok: bool) -> None:
        if not ok:
            self._retry_at = time.monotonic() + RETRY_EVERY

    def _announce_all(self, events: Sequence[Event]) -> None:
        for event in events:
            self._announce(event)
        self._check_store()

    def _check_store(self) -> None:
        """The store's own events: writes failing, working again, events dropped."""
        for event in self.guard.transitions():
            self._emit_now(event)

    def _announce(self, event: Event) -> None:
        self.events_by_key[_event_key(event)] += 1
        self.recent_events.append(event)
        logger = log.bind(source=event.source)
        level = (
            "info"
            if event.severity is Severity.INFO
            else ("warning" if event.severity is Severity.WARNING else "error")
        )
        getattr(logger, level)(
            event.message,
            kind=event.kind,
            severity=event.severity.label,
            subject=event.subject,
            action=event.action,
            repair_action=event.repair_action.value,
            event_id=event.id,
        )
        # Before the listeners: an action (Slurm's resume) reads the set this event changed.
        self.repair_ledger.apply(event)
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:  # a broken listener must not lose the event for the others
                log.exception("event listener failed", listener=repr(listener))

    # -- collectors -------------------------------------------------------------------------

    def _deps(self, name: str) -> CollectorDeps:
        # One per collector name, kept across reloads: a value it holds is not lost with
        # the collector object.
        state = self._collector_states.setdefault(name, CollectorState(self.guard))
        return CollectorDeps(
            node_id=self.node_id,
            state_dir=self.config.state_dir,
            state=state,
            shared=self.shared,
            emit=self.emit,
            held=self.held_repairs,
            stored_events=self.stored_events,
            emit_with_values=self.emit_with,
        )

    def _build(self, name: str, settings: CollectorSettings) -> Collector | None:
        """A new collector, or None when its factory fails (recorded in start_failures,
        logged, an event). Nothing else is touched: a running instance runs on."""
        try:
            return self._specs[name].make(settings, self._deps(name))
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            self.start_failures[name] = StartFailure(settings, error)
            runs_on = name in self.collectors
            log.exception(
                "collector could not be started", collector=name, previous_settings_run=runs_on
            )
            self.emit(
                Event(
                    source="runtime",
                    kind="collector_start_failed",
                    severity=Severity.WARNING if runs_on else Severity.CRITICAL,
                    repair_action=RepairAction.NONE,
                    subject=name,
                    message=f"collector {name} could not be started: {error}"
                    + ("; it runs on with its previous settings" if runs_on else ""),
                    action=f"fix [collectors.{name}] or its cause, then reload (SIGHUP)",
                    attributes={"error": error, "previous_settings_run": runs_on},
                )
            )
            return None

    def _pool(self, name: str, settings: CollectorSettings) -> CollectorPool:
        """The collector's pool: the one it had, with the calls still hung in it, so that a
        restarted collector neither starts a second thread for such a call nor reports its
        stall again; or a new one."""
        pool = self.pools.get(name)
        if pool is None:
            pool = self.pools[name] = collector_pool(name, settings.timeout, self.emit)
        pool.caller.timeout = settings.timeout
        return pool

    def _install(
        self,
        name: str,
        settings: CollectorSettings,
        collector: Collector,
        previous: CollectorStatus | None = None,
    ) -> CollectorStatus:
        """Make `collector` the running instance of `name`; `previous`, the instance it
        replaces, hands over its record (`CollectorStatus.carry_over`)."""
        caller, executor = self._pool(name, settings)
        status = CollectorStatus(name, settings, collector, caller, executor)
        if previous is not None:
            status.carry_over(previous, ("collector", name) in self.stale)
        elif name in self._stopped_counts:  # disabled by a reload, enabled by another
            status.runs, status.failures = self._stopped_counts.pop(name)
        self.collectors[name] = status
        self.start_failures.pop(name, None)
        self.supervisor.register(
            f"collector:{name}", max(settings.interval, settings.timeout) * 3 + 5
        )
        return status

    def _launch(self, status: CollectorStatus) -> None:
        status.task = asyncio.create_task(self._collector_loop(status), name=status.name)

    async def _retire(self, name: str) -> CollectorStatus:
        """Stop a collector's rounds and close it; returns its status. It stays in
        `collectors` meanwhile (a scrape or a heartbeat during a reload sees its last
        series): the caller removes it or installs the instance that replaces it. Its pool
        stays (see `_pool`)."""
        status = self.collectors[name]
        self.supervisor.unregister(f"collector:{name}")
        if status.task is not None:
            await cancel_tasks([status.task])
        await _bounded(status.collector.close(), 2.0, "collector", name)
        return status

    def _release_pool(self, name: str) -> None:
        """After a collector stopped for good. A pool with a call still outstanding stays:
        enabling the collector again must know that call, and the exit must count it."""
        pool = self.pools.get(name)
        if pool is not None and pool.caller.outstanding == 0:
            del self.pools[name]
            pool.shutdown()

    async def _collector_loop(self, status: CollectorStatus) -> None:
        loop = asyncio.get_running_loop()
        interval = status.settings.interval
        next_at = loop.time()
        logger = log.bind(collector=status.name)
        round_number = 0
        await self.pause.enter(status)  # built while paused: it lets go before its first round
        while True:
            began = time.monotonic()
            await self._run_round(status, round_number, logger)
            round_number += 1
            status.last_round_began = began
            status.rounds_done += 1
            if status.first_round_events is None:
                status.first_round_events = status.last_events if status.success else ()
            for watch in list(status.round_watchers):
                watch()
            self.supervisor.beat(f"collector:{status.name}")
            if round_number == 1:
                self._maybe_first_round_done()
            next_at += interval
            now = loop.time()
            if next_at < now:  # a slow round: skip the missed slots, don't burst to catch up
                next_at = now + interval - ((now - next_at) % interval)
            # Woken early, the round runs now and the interval counts from it.
            next_at = min(next_at, await self._between_rounds(status, next_at))

    async def _between_rounds(self, status: CollectorStatus, next_at: float) -> float:
        """Wait for the next round: until `next_at` (loop time), until a wakeable collector
        says it has work, or until the runtime wakes it (`status.wake`: after a pause).
        Returns the loop time the next round may start."""
        loop = asyncio.get_running_loop()
        collector = status.collector
        if not isinstance(collector, WakeableCollector):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(status.wake.wait(), max(0.0, next_at - loop.time()))
            if status.wake.is_set():
                status.wake.clear()
                return loop.time()
            return next_at
        # A floor between woken rounds: a log written without pause is read in batches,
        # not one round per line.
        await asyncio.sleep(MIN_ROUND_GAP)
        remaining = next_at - loop.time()
        if remaining > 0:
            try:
                # Bounded here too: a wake that overstays its timeout must not stop the rounds.
                await asyncio.wait_for(collector.wake(remaining), remaining + 1.0)
            except TimeoutError:
                log.warning("collector's wake overstayed its timeout", collector=collector.name)
            except Exception as exc:  # a broken wake costs the early rounds, not the rounds
                log.warning("collector's wake failed", collector=collector.name, error=repr(exc))
                await asyncio.sleep(max(0.0, next_at - loop.time()))
        return loop.time()

    async def _run_round(
        self, status: CollectorStatus, round_number: int, logger: structlog.stdlib.BoundLogger
    ) -> None:
        """One round through the shared round policy (agent/runtime/rounds.py); what it gave
        goes into the collector's status and the snapshot."""
        now = time.time()
        status.last_attempt = now  # before the round: a scrape during a long round sees it
        status.runs += 1
        state = self._collector_states[status.name]
        mark = state.mark()
        try:
            outcome = await run_round(
                status.collector, status.caller, status.settings, round_number, now=now
            )
        except asyncio.CancelledError:
            # Cut short by a reload or a stop: its events are gone, and so must its writes
            # be (a counter's new last value without its increase event would lose the
            # increase for the next instance and for the next start).
            state.undo(mark)
            raise
        status.duration = outcome.seconds
        if outcome.ok:
            status.samples = outcome.samples
            status.success = True
            status.last_success = time.time()
            status.last_error = ""
            status.stale_kept = False
            status.last_events = outcome.events
            # The round's events and then its state values, queued at once: never stored
            # before them, and in the transaction of the last of them.
            self._emit_now_all(outcome.events, self._collector_states[status.name].take())
        else:
            if outcome.error != status.last_error:  # a failure that repeats is logged once
                _log_failure(logger, outcome)
            # Its counters stay at their last values (a count of what happened is no less true
            # for a failed round, and a counter that vanishes for a scrape reads as new ten
            # minutes later to the rules' `unless X offset 10m`: a page for nothing); its
            # gauges go (a reading nobody took). gpuwarden_collector_success says why.
            status.samples = tuple(s for s in status.samples if s.family.type is MetricType.COUNTER)
            status.success = False
            status.failures += 1
            status.last_error = outcome.error
        # The round's state values after its events: never stored before them.
        state.release()

    @functools.cached_property
    def _stopped_counts(self) -> dict[str, tuple[int, int]]:
        """(runs, failures) of each collector a reload stopped, by name: enabled again, it
        counts on from them (a counter of the process never goes down; `_install`)."""
        return {}

    @functools.cached_property
    def heap(self) -> HeapTrimmer:
        """Gives freed heap back to the kernel after the first round and every TRIM_INTERVAL
        (agent/runtime/memory.py)."""
        return HeapTrimmer()

    def _maybe_first_round_done(self) -> None:
        """Every running collector has done a round (none running: done)."""
        if all(s.rounds_done > 0 for s in self.collectors.values()):
            self.first_round.set()

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        # Sinks are made first: one may turn the outbox on (MQTT), and every event from here
        # on, the store's startup problems included, must reach it.
        for name, spec in self._sink_specs.items():
            sink_settings = self.config.sections[name]
            if spec.enabled(sink_settings):
                self.sinks[name] = spec.factory(sink_settings, self)
                self.ledger[name] = SinkLedger()
        for event in self._pending_events:
            self._emit_now(event)
        self._pending_events.clear()
        if self.boot_id:  # the events stored from here on are this boot's
            self.guard.put(BOOT_NAMESPACE, BOOT_KEY, self.boot_id)
        self.flush_events()  # startup problems are stored before start() returns
        for name, settings in self.config.collectors.items():
            collector = self._build(name, settings) if settings.enabled else None
            if collector is not None:
                self._install(name, settings, collector)
        for sink in self.sinks.values():
            await sink.start()
        if not self.collectors:
            self.first_round.set()
        for status in self.collectors.values():
            self._launch(status)
        for name, sink in self.sinks.items():
            self.supervisor.register(f"sink:{name}", None)
            task = asyncio.create_task(sink.run(), name=f"sink:{name}")
            task.add_done_callback(functools.partial(self._sink_ended, name))
            self._sink_tasks[name] = task
        self._monitor_task = asyncio.create_task(self._health_monitor(), name="health-monitor")
        self._writer_task = asyncio.create_task(self._store_writer(), name="state-writer")
        if not self.store.durable and self.store.state_dir is not None:
            self._disk_task = asyncio.create_task(self._back_to_disk(), name="state-disk")
        self.pause.arm()  # a pause kept from the last run ends at its own deadline

    def _sink_ended(self, name: str, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("sink stopped with an error", sink=name, error=repr(exc))
            self.record_failure(name, f"sink task ended: {exc!r}")

    async def stop(self) -> None:
        await self.pause.stop()
        monitor = [t for t in (self._monitor_task, self._disk_task) if t is not None]
        await cancel_tasks(
            [s.task for s in self.collectors.values() if s.task is not None] + monitor
        )
        # Sinks say goodbye (MQTT offline) and collectors close side by side, each bounded,
        # so the whole stop stays inside systemd's and the contract's 5 seconds.
        await asyncio.gather(
            *(_bounded(sink.stop(), 2.0, "sink", sink.name) for sink in self.sinks.values())
        )
        await cancel_tasks(list(self._sink_tasks.values()))
        await asyncio.gather(
            *(
                _bounded(status.collector.close(), 1.5, "collector", name)
                for name, status in self.collectors.items()
            )
        )
        for state in self._collector_states.values():
            state.release()
        if self._writer_task is not None:
            await cancel_tasks([self._writer_task])
        self.flush_events()
        self._store_thread.shutdown(wait=False)
        for pool in self.pools.values():
            pool.shutdown()

    def hung_calls(self) -> int:
        """Blocking calls still running past their timeout, in every collector's pool (a
        collector disabled by a reload included: its thread is still stuck)."""
        return sum(len(pool.caller.hung) for pool in self.pools.values())

    def calls_outstanding(self) -> int:
        """Threads running a call nobody awaits any more (hung, or abandoned by a cancelled
        round): the process must not wait for them at exit."""
        return sum(pool.caller.outstanding for pool in self.pools.values())

    async def reload(self, config: Config) -> ReloadReport:
        """Apply a new configuration: collector settings, [pause] and log_level at once.

        What the agent reads only at start (node_id, state_dir, the sinks' sections,
        [heartbeat]) is not applied: half of it would be (a heartbeat announcing an interval
        its producer does not keep). It is reported, and kept as a notice until the restart;
        a file changed back takes the notice away.

        Every collector to start or restart is built before any collector stops. One whose
        build fails is reported and keeps its old instance (with nothing old, it is a health
        problem); the others apply. A collector restarted keeps its thread pool and caller,
        and so the calls still hung in it. What runs is compared with the new file, not the
        last file, so reverting a failed change is an ordinary reload."""
        pending, unused = self._restart_changes(config)
        applied: list[str] = []
        if config.core.log_level != self.config.core.log_level:
            logs.set_level(config.core.log_level)
            applied.append(f"log_level {config.core.log_level}")
        sections = dict(self.config.sections)
        pause = config.sections.get("pause")
        if isinstance(pause, PauseSettings) and pause != self.pause.settings:
            # Read at each request (a pause in force keeps the deadline it was given).
            applied.extend(
                f"[pause] {key} {getattr(pause, key):g}"
                for key in _changed_fields(self.pause.settings, pause)
            )
            self.pause.settings = sections["pause"] = pause
        to_stop, to_build = self._plan(config.collectors)
        built: dict[str, tuple[CollectorSettings, Collector]] = {}
        failed: list[str] = []
        for name, settings in to_build:
            collector = self._build(name, settings)
            if collector is None:
                failed.append(f"collector {name}: {self.start_failures[name].error}")
            else:
                built[name] = (settings, collector)
        # Every build is done: only now does anything stop.
        waiting = dict(built)
        try:
            for name in to_stop:
                stopped = await self._retire(name)
                self._stopped_counts[name] = (stopped.runs, stopped.failures)
                del self.collectors[name]
                self._release_pool(name)
                applied.append(f"collector {name} stopped")
            # A collector stopped before its first round ended is not waited for (READY=1).
            self._maybe_first_round_done()
            for name, (settings, collector) in built.items():
                previous = await self._retire(name) if name in self.collectors else None
                restarted = previous is not None
                self._launch(self._install(name, settings, collector, previous))
                del waiting[name]
                applied.append(f"collector {name} {'restarted' if restarted else 'started'}")
        finally:
            # Cut short (a stop during the reload): what was built and never ran is closed,
            # since no one else knows it; what runs is the stop's to close.
            await asyncio.gather(
                *(_bounded(c.close(), 2.0, "collector", name) for name, (_, c) in waiting.items())
            )
        core = dataclasses.replace(self.config.core, log_level=config.core.log_level)
        self.config = dataclasses.replace(config, core=core, sections=sections)
        self.configured = config
        self.pending_restart = pending
        self.reload_error = None
        self.last_reload_ok = not failed
        return ReloadReport(tuple(applied), pending, tuple(failed), unused)

    def reload_refused(self, reason: str) -> None:
        """The new file could not be loaded: the running configuration stays (a notice)."""
        self.reload_error = reason
        self.last_reload_ok = False

    def _plan(
        self, configured: Mapping[str, CollectorSettings]
    ) -> tuple[list[str], list[tuple[str, CollectorSettings]]]:
        """Collectors to stop, and collectors to build, against what runs now."""
        to_stop = [name for name in self.collectors if name not in configured]
        to_build: list[tuple[str, CollectorSettings]] = []
        for name, settings in configured.items():
            running = self.collectors.get(name)
            if not settings.enabled:
                self.start_failures.pop(name, None)
                if running is not None:
                    to_stop.append(name)
            elif running is not None and running.settings == settings:
                self.start_failures.pop(name, None)  # what runs is what is configured
            else:
                to_build.append((name, settings))
        return to_stop, to_build

    def _restart_changes(self, new: Config) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Keys of `new` that differ from what runs: (read only at start, not read at all)."""
        pending = [
            key
            for key in (
                "node_id",
                "state_dir",
                "runtime_dir",
                "state_open_timeout",
                "state_retry_interval",
            )
            if getattr(new.core, key) != getattr(self.config.core, key)
        ]
        read = {*self._sink_specs, "heartbeat"}
        unused: list[str] = []
        for name in sorted(new.sections.keys() | self.config.sections.keys()):
            if name == "pause":  # applied by the reload itself
                continue
            keys = _changed_fields(self.config.sections.get(name), new.sections.get(name))
            (pending if name in read else unused).extend(f"[{name}] {key}" for key in keys)
        return tuple(pending), tuple(unused)

    # -- ledger and health ------------------------------------------------------------------

    @property
    def started(self) -> float:
        """Wall-clock time the runtime was made."""
        return self.started_stamp.wall

    def record_delivery(self, sink: str, when: float | None = None) -> None:
        entry = self.ledger.setdefault(sink, SinkLedger())
        entry.last_delivery = time.time() if when is None else when
        entry.up = True
        self.supervisor.beat(f"sink:{sink}")

    def record_failure(self, sink: str, reason: str) -> None:
        entry = self.ledger.setdefault(sink, SinkLedger())
        entry.failures += 1
        entry.last_failure = reason
        entry.up = False

    def stale_items(self, now: float | None = None) -> list[StaleItem]:
        """Collectors with no success and sinks with no confirmed delivery for
        `stale_after_intervals` of their intervals; `now` is a wall-clock time (None: now),
        and the ages are measured on a clock that does not step (agent/contracts/clock.py)."""
        rounds = self.heartbeat_settings.stale_after_intervals
        items: list[StaleItem] = []
        for status in self.collectors.values():
            limit = status.settings.interval * rounds + status.settings.timeout
            age = status.stale_for(now)
            if status.stale_kept or age > limit:
                items.append(
                    StaleItem(
                        "collector", status.name, age, status.last_error or "no successful round"
                    )
                )
        for name, sink in self.sinks.items():
            if sink.expected_interval is None:
                continue
            entry = self.ledger.get(name, SinkLedger())
            age = (entry.delivery or self.started_stamp).age(now)
            if age > sink.expected_interval * rounds:
                items.append(
                    StaleItem("sink", name, age, entry.last_failure or "no confirmed delivery")
                )
        return items

    def health(self, now: float | None = None) -> Health:
        problems = [item.problem() for item in self.stale_items(now)]
        for sink in self.sinks.values():
            problems.extend(sink.problems())
        problems.extend(self.guard.problems())
        if self.live_spill is not None:
            problems.extend(self.live_spill.problems())
        kinds = {p.kind for p in self.store.problems}
        if "state_store_hung" in kinds:
            problems.append(
                f"state store is in memory (state dir {self.config.state_dir} hangs: check "
                "its mount)"
            )
        elif "state_store_unwritable" in kinds:
            problems.append("state store is in memory (state dir unusable)")
        problems.extend(self._start_problems())
        for source in self.problem_sources:
            problems.extend(source())
        return Health(not problems, tuple(problems), self._notices())

    def _start_problems(self) -> list[str]:
        """Configured collectors that do not run at all: their build failed."""
        return [
            f"collector {name} failed to start: {failure.error}"
            for name, failure in sorted(self.start_failures.items())
            if name not in self.collectors
        ]

    def _notices(self) -> tuple[str, ...]:
        """Where the running agent differs from its file (see Health for why not problems)."""
        notices: list[str] = []
        if self.pending_restart:
            notices.append(
                "configuration change pending restart: " + ", ".join(self.pending_restart)
            )
        if self.reload_error is not None:
            notices.append(
                "last configuration reload refused, the previous configuration runs: "
                + self.reload_error
            )
        notices.extend(
            f"collector {name}: its new settings could not be started ({failure.error}); "
            "it runs on with the previous ones"
            for name, failure in sorted(self.start_failures.items())
            if name in self.collectors
        )
        paused = self.pause.state
        if paused is not None:  # an operator's doing: shown (STATUS=, /healthz), not a page
            until = time.strftime("%H:%M:%S UTC", time.gmtime(paused.until))
            notices.append(
                f"GPU monitoring paused until {until}"
                + (f" ({paused.reason})" if paused.reason else "")
                + ": gpuwarden resume ends it"
            )
        return tuple(notices)

    async def _health_monitor(self) -> None:
        """Turn stale collectors and sinks, and a store that stopped or resumed writing (a
        sink's write may tell first), into events, once per transition each way; keep the
        event history to its retention and the WAL small."""
        pruned_at = 0.0
        trimmed_at: float | None = None
        while True:
            interval = self.heartbeat_settings.interval
            await asyncio.sleep(min(max(interval / 2, 0.2), 5.0))
            self.check_stale()
            self._check_store()
            self._tell_clock_steps()
            if self.first_round.is_set() and (
                trimmed_at is None or time.monotonic() - trimmed_at >= TRIM_INTERVAL
            ):
                trimmed_at = time.monotonic()
                self.heap.trim()  # agent/runtime/memory.py: about a millisecond
            if time.monotonic() - pruned_at >= 3600:
                pruned_at = time.monotonic()
                await self.in_store_thread(self.prune_history)
                await self.in_store_thread(self.store.checkpoint)

    async def _back_to_disk(self) -> None:
        """A store that started in memory (its state dir unusable or hung at start): every
        state_retry_interval seconds, open its database on the disk again (at most
        state_open_timeout seconds, and never while the last attempt is still stuck there),
        and once that works move what memory holds into it (in the store thread, in turn
        with the writes) and say so: `state_store_durable`."""
        core = self.config.core
        while not self.store.durable:
            await asyncio.sleep(core.state_retry_interval)
            attempt = self.store.disk_attempt(core.state_open_timeout)
            if attempt is None:
                log.info("the last attempt to open the state store is still stuck; waiting")
                continue
            try:
                disk = await asyncio.wait_for(
                    asyncio.shield(asyncio.wrap_future(attempt.future)), core.state_open_timeout
                )
            except TimeoutError:
                attempt.abandon()
                self.store.note_hung(core.state_open_timeout)
                log.warning("the state dir still hangs", state_dir=str(self.config.state_dir))
                continue
            except asyncio.CancelledError:  # a stop: what it opens later is closed
                attempt.abandon()
                raise
            except Exception as exc:  # whatever it is, memory goes on
                log.info("the state dir is still unusable", error=str(exc))
                continue
            try:
                moved = await self._move_to_disk(disk)
            except StateStoreError as exc:
                log.warning("the state store stays in memory", error=str(exc))
                self._move_failed(exc)
                continue
            self._move_failing = False
            self.emit(
                Event(
                    source="state",
                    kind="state_store_durable",
                    severity=Severity.INFO,
                    repair_action=RepairAction.NONE,  # the agent's own health, not a repair
                    subject=str(self.config.state_dir),
                    message=f"the state store is on the disk again ({self.store.path}): what "
                    "memory held since the start (outbox, events, counters, cursors) is moved "
                    "there and survives a restart",
                    clears=(*sorted(IN_MEMORY_PROBLEMS), "state_store_move_failed"),
                    attributes=moved,
                )
            )

    problem_sources: tuple[Callable[[], Sequence[str]], ...] = ()
    """Health problems of parts of the program outside the runtime (the control socket),
    asked at each health(); the program replaces the tuple to add one."""

    _move_failing = False
    """The last move of the store onto the disk failed (said once, until one works)."""

    async def _move_to_disk(self, disk: StateStore) -> dict[str, int]:
        """The move from memory onto the disk (`StateStore.moving_into`), one step at a time
        in the store thread: the writes queued behind a step run before the next one, so no
        event waits for the whole outbox to move (bench/state_adopt.py)."""
        move = self.store.moving_into(disk)
        try:
            while not await self.in_store_thread(move.step):
                pass
            return await self.in_store_thread(move.finish)
        except asyncio.CancelledError:  # a stop: the move is undone, in turn with the writes
            with contextlib.suppress(RuntimeError):  # the store thread is shut down already
                self._store_thread.submit(move.abandon)
            raise

    def _move_failed(self, exc: StateStoreError) -> None:
        """A move onto the disk failed part-way (the disk full again): undone, memory holds
        everything, the next retry tries again. One event until a move works."""
        self.store.note_move_failed(str(exc))
        if self._move_failing:
            return
        self._move_failing = True
        self.emit(
            Event(
                source="state",
                kind="state_store_move_failed",
                severity=Severity.WARNING,
                repair_action=RepairAction.NONE,
                subject=str(self.config.state_dir),
                message=f"moving the state store from memory onto the disk failed ({exc}); "
                "what the disk got of it is undone (at once, or by the next open where the "
                "disk has no room even for that), memory still holds everything (outbox, "
                "events, counters, cursors), and the move is tried again every "
                f"{self.config.core.state_retry_interval:g} s",
                action=f"free space in {self.config.state_dir} (the move needs room for the "
                "whole outbox and history held in memory)",
            )
        )

    def _tell_clock_steps(self) -> None:
        """One event per step of the wall clock the store moved its stamps by: a fact about
        the host (a clock far off at boot, set by hand) that explains odd times around it."""
        steps = self.store.clock_steps[self._clock_steps_told :]
        self._clock_steps_told += len(steps)
        for delta in steps:
            self.emit(
                Event(
                    source="runtime",
                    kind="clock_stepped",
                    severity=Severity.INFO,
                    repair_action=RepairAction.NONE,
                    subject="wall_clock",
                    message=f"the wall clock stepped {'forward' if delta > 0 else 'back'} by "
                    f"{abs(delta):.0f} s; the times of what waited in the outbox and in the "
                    "history moved with it, and ages are measured on a clock that does not step",
                    action="if this was not NTP correcting a clock that was off at boot, check "
                    "the host's time source (chronyc tracking, timedatectl)",
                    attributes={"seconds": round(delta, 3)},
                )
            )

    def prune_history(self, now: float | None = None) -> int:
        """Delete events older than EVENT_RETENTION from the history (not from the outbox,
        whose own bounds apply). Returns how many went."""
        cutoff = (time.time() if now is None else now) - EVENT_RETENTION
        try:
            return self.store.prune_events(cutoff)
        except StateStoreError as exc:
            log.warning("event history not pruned", error=str(exc))
            return 0

    def check_stale(self, now: float | None = None) -> None:
        current = {(item.kind, item.name): item for item in self.stale_items(now)}
        for key, item in current.items():
            if key not in self.stale:
                self.emit(
                    Event(
                        source="runtime",
                        kind=f"{item.kind}_stale",
                        severity=Severity.WARNING,
                        repair_action=RepairAction.NONE,
                        subject=item.name,
                        message=item.problem(),
                        action=(
                            f"read the agent's log for collector {item.name}"
                            if item.kind == "collector"
                            else f"check the {item.name} sink's delivery path"
                        ),
                        attributes={"seconds": round(item.seconds, 1), "reason": item.reason},
                    )
                )
        for key, item in self.stale.items():
            if key not in current:
                # The all-clear of what no one will look at again says so: a collector
                # that a reload stopped is not delivering again.
                gone = item.kind == "collector" and item.name not in self.collectors
                self.emit(
                    Event(
                        source="runtime",
                        kind=f"{item.kind}_recovered",
                        severity=Severity.INFO,
                        repair_action=RepairAction.NONE,
                        subject=item.name,
                        message=f"collector {item.name} no longer runs (stopped by a reload)"
                        if gone
                        else f"{item.kind} {item.name} is delivering again",
                        attributes={"stopped": True} if gone else {},
                    )
                )
        self.stale = current

    @property
    def heartbeat_settings(self) -> HeartbeatSettings:
        return self.config.section("heartbeat", HeartbeatSettings)

    # -- snapshot ---------------------------------------------------------------------------

    def families(self) -> list[MetricFamily]:
        out = list(self.metrics.families())
        for status in self.collectors.values():
            out.extend(status.collector.families())
        for sink in self.sinks.values():
            out.extend(sink.families())
        for source in self.metrics.sources:
            out.extend(source.families())
        for shared in self.shared.series():
            out.extend(shared.shared_families())
        return out

    def samples(self) -> list[Sample]:
        """The last snapshot of every collector, the sinks' and the runtime's own series, and
        those of the shared services (`SharedSeries`: the Xid counters), read now."""
        out = list(self.metrics.samples())
        for status in self.collectors.values():
            out.extend(status.samples)
        for sink in self.sinks.values():
            out.extend(sink.samples())
        for source in self.metrics.sources:
            out.extend(source.samples())
        for shared in self.shared.series():
            out.extend(shared.shared_samples())
        return out


def _changed_fields(old: object, new: object) -> list[str]:
    """Names of the fields that differ between two settings objects of one section."""
    if old == new:
        return []
    if dataclasses.is_dataclass(old) and type(old) is type(new):
        return [
            f.name for f in dataclasses.fields(old) if getattr(old, f.name) != getattr(new, f.name)
        ]
    return ["(the whole section)"]


def _log_failure(logger: structlog.stdlib.BoundLogger, outcome: RoundOutcome) -> None:
    """One line for a failure the collector expected and explained (a GpuwardenError, with
    its action when it knows one) or an access the system refused; the traceback only for
    anything else, which is a bug to report."""
    exc = outcome.exception
    if outcome.failure is Failure.RAISED and isinstance(exc, GpuwardenError | PermissionError):
        action = exc.action if isinstance(exc, GpuwardenError) else ""
        if isinstance(exc, PermissionError):
            action = (
                f"give the agent's user access to {exc.filename or 'it'} (the packaged "
                "service runs with what it needs), or disable the collector"
            )
        logger.warning("collector round failed", error=str(exc), action=action or None)
        return
    if outcome.failure is Failure.RAISED:
        logger.exception("collector failed", exc_info=exc)
    logger.warning("collector round failed", error=outcome.error)
