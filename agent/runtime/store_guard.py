"""The one policy for a state store that cannot write (a full disk, a file system gone read-only).

Nothing the agent means to keep is lost while the store refuses writes, and nothing that uses
the store handles the refusal itself:

- A collector's `deps.state` is a `CollectorState`: a write never raises. The value is held in
  memory (the latest per key), read back at once, and handed to the guard with the round's
  events, after them and at once (`queue_round`), so that it is stored in the transaction of
  the round's last event (a long backlog's: after it), never before (a kernel-log cursor is
  never saved past findings that are not) and never after a kill could come between.
- An event's own changes (what it did to the repair ledger) are queued with it and written in
  its transaction.
- Events wait in a bounded queue (`MAX_QUEUED_EVENTS`) until the store takes them, in order;
  they reach the outbox, and so MQTT, then. Only past the bound is anything dropped: the oldest,
  counted by reason.
- `flush` writes what waits, and is called from the runtime's store thread, never on the event
  loop. While writes fail the runtime calls it again every `RETRY_EVERY` seconds.
- The failure is one health problem and one event (`state_store_write_failing`) for as long as
  it lasts, cleared by the first write that works (`state_store_write_recovered`); events
  dropped meanwhile are one more event (`events_dropped`) once the store takes it.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from agent.contracts.collector import JSONValue
from agent.contracts.errors import StateStoreError
from agent.contracts.model import Event, RepairAction, Severity
from agent.runtime.state import KvChanges, StateStore

log = structlog.get_logger(component="state")

MAX_QUEUED_EVENTS = 10_000
"""Events waiting in memory for the store at most (while it cannot take them they pile up
here); past this the oldest are dropped."""
EVENTS_PER_TRANSACTION = 500
"""A long backlog is written in transactions of this many events: one transaction of all of
them could need more room in the WAL than a nearly full disk has."""
RETRY_EVERY = 1.0
"""Seconds between attempts while writes fail."""
QUEUE_FULL = "store_queue_full"
"""The reason label of events dropped because the store could not take them in time."""
SPILLED_NAMESPACE = "spill_adopted"
"""The key-value namespace of the spills whose content the store holds (agent/runtime/
spill.py: adopted, or written while the store could not take it and stored since)."""

Changed = Callable[[bool], None]
"""Told of each change that waits (True: an event; False: values only, or a write refused)."""


@dataclass(frozen=True)
class Queued:
    """What waits, as it was at one moment (`StoreGuard.snapshot`): for a spill written while
    the store cannot take it. Writing it (`into`) takes nothing off the queue."""

    events: tuple[Event, ...]
    values: dict[tuple[str, str], str | None]
    bound: dict[str, KvChanges]
    deletes: frozenset[tuple[str, str]]

    def into(self, target: StateStore, outbox: bool) -> None:
        """Into `target` (a spill's own store) as a flush would write it. Raises
        StateStoreError."""
        for chunk, changes in _batches(self.events, self.values, self.bound, {}):
            target.write_batch(chunk, changes, outbox=outbox)


class StoreGuard:
    """What waits to be written, the state of the store's writes, and what they cost.

    Thread-safe. As a KeyValueStore (get, put, items, delete) it is the tolerant store for
    code outside a collection round (the MQTT birth number).
    """

    def __init__(
        self, store: StateStore, state_dir: Path, max_events: int = MAX_QUEUED_EVENTS
    ) -> None:
        self.store = store
        self.state_dir = state_dir
        self.max_events = max_events
        self.dropped: Counter[str] = Counter()
        """Events dropped since start, by reason."""
        self._lock = threading.Lock()  # the queues; never held across SQL
        self._flushing = threading.Lock()  # one flush at a time
        self._events: deque[Event] = deque()
        self._in_flight = 0
        """Leftmost events of the queue being written now: never the ones dropped."""
        self._values: dict[tuple[str, str], str | None] = {}
        self._bound: dict[str, KvChanges] = {}
        """Event id -> the changes written in the same transaction as that event (what it
        did to the repair ledger)."""
        self._error: str | None = None
        self._failing_since: float | None = None
        self._dropped_reported = 0
        self.changed: Changed | None = None
        """Told of each change queued here (the spill written while the store cannot take
        it: agent/runtime/spill.py `LiveSpill`); called with the queue's lock held: cheap."""
        self._spills: list[str] = []
        """Ids of the spills that hold a snapshot of this queue (`snapshot`): the flush that
        writes all of it marks them in its last transaction, so that a spill left behind by a
        kill -9 after that is skipped at the next start, not adopted over newer values."""

    # -- key-value ------------------------------------------------------------------------

    def get(self, namespace: str, key: str) -> JSONValue | None:
        with self._lock:
            if (namespace, key) in self._values:
                return _decode(self._values[(namespace, key)])
        # Not held: its latest write, if any, is in the store (a held value leaves the queue
        # only after its transaction committed).
        return self.store.get(namespace, key)

    def items(self, namespace: str) -> dict[str, JSONValue]:
        with self._lock:
            held = {k: text for (ns, k), text in self._values.items() if ns == namespace}
        return _overlay(self.store.items(namespace), held)

    def put(self, namespace: str, key: str, value: JSONValue) -> None:
        self.hold({(namespace, key): json.dumps(value)})

    def delete(self, namespace: str, key: str) -> None:
        self.hold({(namespace, key): None})

    def hold(self, values: KvChanges) -> None:
        """Key-value changes to write with the next flush (JSON text; None deletes)."""
        with self._lock:
            self._values.update(values)
            self._tell(False)

    def _tell(self, event: bool) -> None:
        if self.changed is not None:
            self.changed(event)

    # -- events ---------------------------------------------------------------------------

    def queue(self, event: Event, values: KvChanges | None = None) -> None:
        """`values`: key-value changes that belong to the event, written in the same
        transaction as it (never before, never after)."""
        self.queue_round([(event, values)], {})

    def queue_round(
        self, events: Sequence[tuple[Event, KvChanges | None]], values: KvChanges
    ) -> None:
        """A round's events (each with its own changes, as `queue`) and then the round's
        values, at once: a flush takes all of them or none, so that the round's values are
        written in the transaction of its last event (a long backlog's: after it)."""
        with self._lock:
            for event, changes in events:
                self._events.append(event)
                if changes:
                    self._bound[event.id] = changes
                self._drop_past_bound()
            self._values.update(values)
            if events or values:
                self._tell(bool(events))

    def _drop_past_bound(self) -> None:
        while len(self._events) > max(self.max_events, self._in_flight + 1):
            dropped = self._events[self._in_flight]
            del self._events[self._in_flight]
            # The event is lost; what it changed still holds (the ledger in memory has it).
            self._values.update(self._bound.pop(dropped.id, {}))
            self.dropped[QUEUE_FULL] += 1

    @property
    def queued_events(self) -> int:
        return len(self._events)

    @property
    def queued_values(self) -> int:
        return len(self._values)

    @property
    def pending(self) -> bool:
        return bool(self._events or self._values)

    def pending_deletes(self) -> set[tuple[str, str]]:
        """The keys a write that waits deletes (a value held as None, an event's change)."""
        with self._lock:
            held = {key for key, text in self._values.items() if text is None}
            for changes in self._bound.values():
                held.update(key for key, text in changes.items() if text is None)
        return held

    def snapshot(self, spill_id: str) -> Queued:
        """What waits now, for the spill `spill_id` (written while the store cannot take it):
        the flush that writes all of this marks the spill as held by the store."""
        with self._lock:
            events = tuple(self._events)
            bound = {e.id: self._bound[e.id] for e in events if e.id in self._bound}
            deletes = {key for key, text in self._values.items() if text is None}
            for changes in bound.values():
                deletes.update(key for key, text in changes.items() if text is None)
            self._spills.append(spill_id)
            return Queued(events, dict(self._values), bound, frozenset(deletes))

    def forget_spill(self, spill_id: str) -> None:
        """The spill is gone (replaced by a newer one): no flush needs to mark it."""
        with self._lock:
            if spill_id in self._spills:
                self._spills.remove(spill_id)

    @property
    def writing(self) -> threading.Lock:
        """Held by each flush: a spill of a store in memory holds it while it copies the
        store and this queue, so that nothing moves from one to the other meanwhile."""
        return self._flushing

    # -- writing (blocking: the runtime's store thread) -------------------------------------

    def flush(self, outbox: bool) -> bool:
        """Write what waits: events oldest first, `EVENTS_PER_TRANSACTION` at a time, the
        key-value changes with the last of them. True when everything was written."""
        return self._flush(self.store, outbox)

    def flush_into(self, store: StateStore, outbox: bool) -> bool:
        """`flush`, into another store: a spill at a clean stop (agent/runtime/spill.py)."""
        return self._flush(store, outbox)

    def _flush(self, target: StateStore, outbox: bool) -> bool:
        with self._flushing:
            with self._lock:
                events = list(self._events)
                values = dict(self._values)
                bound = {e.id: self._bound[e.id] for e in events if e.id in self._bound}
                spills = list(self._spills)
            marks = {(SPILLED_NAMESPACE, s): json.dumps(time.time()) for s in spills}
            superseded = {key for changes in bound.values() for key in changes}
            try:
                for chunk, changes in _batches(events, values, bound, marks):
                    self._write(target, chunk, changes, outbox)
                with self._lock:
                    for key in superseded & values.keys():
                        if key in self._values and self._values[key] is values[key]:
                            del self._values[key]
                    self._spills = [s for s in self._spills if s not in spills]
            except StateStoreError as exc:
                if self._error is None:
                    log.error(
                        "state store cannot write; keeping events and state in memory",
                        error=str(exc),
                        queued_events=self.queued_events,
                    )
                self._error = str(exc)
                with self._lock:
                    self._tell(False)
                return False
            self._error = None
            return True

    def _write(
        self, store: StateStore, events: Sequence[Event], values: KvChanges, outbox: bool
    ) -> None:
        with self._lock:
            self._in_flight = len(events)
        try:
            store.write_batch(events, values, outbox=outbox)
        except BaseException:
            with self._lock:
                self._in_flight = 0
            raise
        with self._lock:
            self._in_flight = 0
            for _ in events:
                self._bound.pop(self._events.popleft().id, None)
            for key, text in values.items():
                # A newer change to the same key came meanwhile: it is still to be written.
                if key in self._values and self._values[key] is text:
                    del self._values[key]

    # -- state of the writes ----------------------------------------------------------------

    @property
    def failing(self) -> str | None:
        """Why writes fail now (the last attempt here, or the latest write anyone made, was
        refused); None once writes work."""
        return self._error or self.store.write_error

    def transitions(self, now: float | None = None) -> list[Event]:
        """The events that the state of the writes calls for since the last call: one when
        writes start failing, one when they work again, one for events dropped meanwhile."""
        now = time.time() if now is None else now
        failing = self.failing
        out: list[Event] = []
        if failing is not None and self._failing_since is None:
            self._failing_since = now
            out.append(self._failing_event(failing))
        elif failing is None and self._failing_since is not None:
            out.append(self._recovered_event(now - self._failing_since))
            self._failing_since = None
        dropped = sum(self.dropped.values())
        if failing is None and dropped > self._dropped_reported:
            out.append(self._dropped_event(dropped - self._dropped_reported))
            self._dropped_reported = dropped
        return out

    def problems(self) -> list[str]:
        problems: list[str] = []
        failing = self.failing
        if failing is not None:
            problems.append(
                f"state store cannot write ({failing}): is the disk of {self.state_dir} full? "
                f"{self.queued_events} events and {self.queued_values} state values wait in "
                "memory"
            )
        unreported = sum(self.dropped.values()) - self._dropped_reported
        if unreported > 0:
            problems.append(
                f"{unreported} events dropped: the state store could not write and the memory "
                f"queue ({self.max_events}) was full"
            )
        return problems

    def _failing_event(self, error: str) -> Event:
        return Event(
            source="state",
            kind="state_store_write_failing",
            severity=Severity.CRITICAL,
            repair_action=RepairAction.NONE,  # the agent's own health, not a repair
            subject=str(self.state_dir),
            message=f"the state store cannot write ({error}); events and state are kept in "
            f"memory (up to {self.max_events} events) and written once it can",
            action=f"free space on the file system of {self.state_dir}, or make it writable",
            attributes={"error": error},
        )

    def _recovered_event(self, seconds: float) -> Event:
        return Event(
            source="state",
            kind="state_store_write_recovered",
            severity=Severity.INFO,
            repair_action=RepairAction.NONE,  # the agent's own health, not a repair
            subject=str(self.state_dir),
            message=f"the state store writes again after {seconds:.0f} s; what waited in "
            "memory is stored",
            attributes={"seconds": round(seconds, 1)},
        )

    def _dropped_event(self, count: int) -> Event:
        return Event(
            source="state",
            kind="events_dropped",
            severity=Severity.CRITICAL,
            repair_action=RepairAction.NONE,  # the agent's own health, not a repair
            subject=str(self.state_dir),
            message=f"{count} events were dropped undelivered: the state store could not "
            f"write and more than {self.max_events} waited in memory (they are in the "
            "agent's log)",
            action=f"keep free space on the file system of {self.state_dir}",
            attributes={"dropped": count, "reason": QUEUE_FULL},
        )


class CollectorState:
    """One collector's `deps.state`: reads see its writes at once; `release` hands them to the
    guard. The runtime releases after it has queued the round's events, so a value written
    in a round is stored with or after the round's events."""

    def __init__(self, guard: StoreGuard) -> None:
        self._guard = guard
        self._lock = threading.Lock()
        self._held: dict[tuple[str, str], str | None] = {}

    # Reads ask the guard (perhaps the database) without this lock held: release() runs on
    # the event loop and must not wait behind a read. A value released meanwhile is in the
    # guard until it is stored, so it is found either way.

    def get(self, namespace: str, key: str) -> JSONValue | None:
        with self._lock:
            if (namespace, key) in self._held:
                return _decode(self._held[(namespace, key)])
        return self._guard.get(namespace, key)

    def items(self, namespace: str) -> dict[str, JSONValue]:
        with self._lock:
            held = {k: text for (ns, k), text in self._held.items() if ns == namespace}
        return _overlay(self._guard.items(namespace), held)

    def put(self, namespace: str, key: str, value: JSONValue) -> None:
        text = json.dumps(value)  # a value JSON cannot hold fails here, in the collector
        with self._lock:
            self._held[(namespace, key)] = text

    def delete(self, namespace: str, key: str) -> None:
        with self._lock:
            self._held[(namespace, key)] = None

    def release(self) -> None:
        held = self.take()
        if held:
            self._guard.hold(held)

    def take(self) -> dict[tuple[str, str], str | None]:
        """What was written since the last release or take, handed over (to be queued with
        the round's events: `StoreGuard.queue_round`)."""
        with self._lock:
            held, self._held = self._held, {}
        return held

    def mark(self) -> dict[tuple[str, str], str | None]:
        """What is held now (a round's start), for `undo`."""
        with self._lock:
            return dict(self._held)

    def undo(self, mark: Mapping[tuple[str, str], str | None]) -> None:
        """Forget what was written since `mark`: a round cut short (a reload, a stop)
        returns no events, so none of its writes may be stored or read either."""
        with self._lock:
            self._held = dict(mark)


def _batches(
    events: Sequence[Event],
    values: Mapping[tuple[str, str], str | None],
    bound: Mapping[str, KvChanges],
    marks: KvChanges,
) -> Iterator[tuple[Sequence[Event], dict[tuple[str, str], str | None]]]:
    """The transactions a flush writes: events oldest first, `EVENTS_PER_TRANSACTION` at a
    time, each with its own changes; the values held on their own (and `marks`) with the
    last. A value held on its own for a key that an event here changes is older than that
    event (only the ledger writes those keys so, at start): the event's change wins."""
    superseded = {key for changes in bound.values() for key in changes}
    general = {key: text for key, text in values.items() if key not in superseded}
    for start in range(0, max(len(events), 1), EVENTS_PER_TRANSACTION):
        chunk = events[start : start + EVENTS_PER_TRANSACTION]
        last = start + EVENTS_PER_TRANSACTION >= len(events)
        changes: dict[tuple[str, str], str | None] = {**general, **marks} if last else {}
        for e in chunk:  # in order: the later event's change wins
            changes.update(bound.get(e.id, {}))
        yield chunk, changes


def _decode(text: str | None) -> JSONValue | None:
    return None if text is None else json.loads(text)


def _overlay(stored: dict[str, JSONValue], held: Mapping[str, str | None]) -> dict[str, JSONValue]:
    for key, text in held.items():
        if text is None:
            stored.pop(key, None)
        else:
            stored[key] = json.loads(text)
    return stored
