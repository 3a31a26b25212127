"""The contract between the runtime and a collector.

A collector is built once by its spec's factory from its settings and the runtime's services,
declares its metric families, and is asked to `collect` on its own interval. Every blocking
call (NVML, statvfs, /proc reads) goes through `ctx.call`, which runs it in the runtime's
bounded thread pool with a timeout and refuses to start it again while an earlier call with the
same key still hangs. The runtime, not the collector, reports collector health.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, ParamSpec, Protocol, TypeVar, runtime_checkable

from agent.contracts.errors import CallStillHung, CallTimedOut  # noqa: F401 (re-exported)
from agent.contracts.model import ActiveRepair, Collection, Event, MetricFamily, Sample
from agent.contracts.settings import setting

P = ParamSpec("P")
T = TypeVar("T")
C = TypeVar("C", bound="CollectorSettings")

JSONValue = Any
"""Anything `json.dumps` accepts."""


Call = tuple[str, Callable[..., T], tuple[Any, ...]]
"""One blocking call: its key, the function and its arguments."""


class BlockingCaller(Protocol):
    async def call(self, key: str, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run `fn(*args)` off the event loop with the collector's call timeout.

        `key` names the resource (`"statvfs:/mnt/data"`, `"nvml:gpu0"`): while a call with the
        same key hangs, `CallStillHung` is raised at once instead of starting another thread.
        """
        ...

    async def call_each(self, calls: Sequence[Call[T]]) -> list[T | Exception]:
        """Several calls side by side (one per GPU, each with its own key): every one is
        started before any is waited for. Each answer, or the exception its call ended with
        (`CallStillHung`, `CallTimedOut`, the function's own), in the order of `calls`."""
        ...


class KeyValueStore(Protocol):
    """Small durable values: last counter readings, log cursors, baselines.

    The store the runtime hands a collector (`CollectorDeps.state`) never raises on `put` or
    `delete`: a value the disk refuses is kept in memory, read back at once and written when
    the disk has room, after the events of the round that wrote it. A collector has nothing
    to handle; a value JSON cannot hold is a bug and raises TypeError at once."""

    def get(self, namespace: str, key: str) -> JSONValue | None: ...

    def put(self, namespace: str, key: str, value: JSONValue) -> None: ...

    def items(self, namespace: str) -> dict[str, JSONValue]: ...

    def delete(self, namespace: str, key: str) -> None: ...


class MemoryKeyValueStore:
    """A KeyValueStore in memory: the fallback when the state store is unusable, and for tests."""

    def __init__(self) -> None:
        self._data: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()

    def get(self, namespace: str, key: str) -> JSONValue | None:
        with self._lock:
            raw = self._data.get((namespace, key))
        return None if raw is None else json.loads(raw)

    def put(self, namespace: str, key: str, value: JSONValue) -> None:
        raw = json.dumps(value)
        with self._lock:
            self._data[(namespace, key)] = raw

    def items(self, namespace: str) -> dict[str, JSONValue]:
        with self._lock:
            return {k: json.loads(v) for (ns, k), v in self._data.items() if ns == namespace}

    def delete(self, namespace: str, key: str) -> None:
        with self._lock:
            self._data.pop((namespace, key), None)


@runtime_checkable
class SharedSeries(Protocol):
    """A shared service with series of its own (the Xid correlator's counters): what several
    collectors feed and none of them alone may export. The runtime renders them live with
    every snapshot, once, beside the collectors' (`SharedServices.series`): whichever of its
    collectors runs, fails a round or is replaced by a reload, the series is there once."""

    def shared_families(self) -> Sequence[MetricFamily]: ...

    def shared_samples(self) -> Sequence[Sample]:
        """Called on the event loop at each snapshot: from memory, never blocking long."""
        ...


class SharedServices:
    """Objects several components share, one per type: the NVML backend, the Xid correlator.

    `get(SomeType, factory)` returns the existing instance or builds it with `factory()`.
    """

    def __init__(self) -> None:
        self._objects: dict[type[Any], Any] = {}
        self._lock = threading.Lock()

    def get(self, kind: type[T], factory: Callable[[], T]) -> T:
        with self._lock:
            obj = self._objects.get(kind)
            if obj is None:
                obj = factory()
                self._objects[kind] = obj
            if not isinstance(obj, kind):
                raise TypeError(f"shared service for {kind.__name__} has type {type(obj)}")
            return obj

    def put(self, kind: type[T], obj: T) -> None:
        with self._lock:
            self._objects[kind] = obj

    def find(self, kind: type[T]) -> T | None:
        with self._lock:
            obj = self._objects.get(kind)
        return obj if isinstance(obj, kind) else None

    def series(self) -> list[SharedSeries]:
        """The shared services with series of their own (`SharedSeries`)."""
        with self._lock:
            return [obj for obj in self._objects.values() if isinstance(obj, SharedSeries)]


@dataclass(frozen=True)
class CollectorDeps:
    """What the runtime hands a collector factory."""

    node_id: str
    state_dir: Path
    state: KeyValueStore
    shared: SharedServices
    emit: Callable[[Event], None]
    """Emit an event outside a collection round (from a background thread too: thread-safe)."""
    held: Callable[[], Sequence[ActiveRepair]] = lambda: ()
    """The repair requirements held now: the runtime's ledger, which outlives a collector
    instance (a reload) and the process (it is in the state store). A new instance starts
    from it, so that the fault an earlier instance reported gets its all-clear, under the
    subject it was raised under, when it ends before this instance saw it."""

    stored_events: Callable[[str, Sequence[str], float], Sequence[Event]] = (
        lambda source, kinds, since: ()
    )
    """(source, kinds, since) -> the events of `source` of `kinds` the state store holds from
    `since` on (their own time), oldest first: what the process's last life raised, for a
    collector that must not raise it again (the Xid correlator's seed, collectors/_xid.py).
    A synchronous read of the store: call it once, at construction; empty when the store
    cannot be read."""

    emit_with_values: (
        Callable[[Sequence[Event], Mapping[tuple[str, str], JSONValue]], None] | None
    ) = None
    """`emit_with` as the runtime does it (None: a caller that built these by hand)."""

    def emit_with(
        self, events: Sequence[Event], values: Mapping[tuple[str, str], JSONValue]
    ) -> None:
        """Emit `events` (none: the values alone) and key-value changes that belong to them
        ((namespace, key) -> value; None deletes), stored in the transaction of the last of
        them, never before and never apart: for a background thread's count that must not be
        stored without its event, nor its event without the count (the NVML thread's Xid
        counts). Thread-safe; stored as soon as the store writer takes them."""
        if self.emit_with_values is not None:
            self.emit_with_values(events, values)
            return
        for event in events:
            self.emit(event)
        for (namespace, key), value in values.items():
            if value is None:
                self.state.delete(namespace, key)
            else:
                self.state.put(namespace, key, value)

    def held_by(self, source: str, kinds: Sequence[str]) -> dict[str, dict[str, ActiveRepair]]:
        """subject -> kind -> the requirement held, for the events of `source` of `kinds`."""
        out: dict[str, dict[str, ActiveRepair]] = {}
        for repair in self.held():
            if repair.source == source and repair.kind in kinds:
                out.setdefault(repair.subject, {})[repair.kind] = repair
        return out


@dataclass(frozen=True)
class CollectContext:
    """What the runtime hands one collection round."""

    caller: BlockingCaller
    now: float
    """Wall-clock time of the round's start, seconds since the epoch (UTC)."""
    round: int
    """0 for the first round after start: one-time reads (static facts) key off it."""

    async def call(self, key: str, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        return await self.caller.call(key, fn, *args, **kwargs)

    async def call_each(self, calls: Sequence[Call[T]]) -> list[T | Exception]:
        return await self.caller.call_each(calls)


class Collector(Protocol):
    name: str

    def families(self) -> Sequence[MetricFamily]:
        """Every metric family this collector may produce, declared before the first round."""
        ...

    async def collect(self, ctx: CollectContext) -> Collection:
        """One round. Raise only for a failure of the whole collector; per-subject errors
        (one GPU, one mount) are series and events of their own."""
        ...

    async def close(self) -> None:
        """Stop background threads, release handles. Called once, at shutdown or reload."""
        ...


@runtime_checkable
class WakeableCollector(Collector, Protocol):
    """A collector that can tell when a round has work (new kernel-log records): the runtime
    waits on `wake` between rounds instead of sleeping, and runs the next round as soon as
    it returns. Rounds still come at least every interval; woken rounds at most every
    `agent.runtime.core.MIN_ROUND_GAP` seconds."""

    async def wake(self, timeout: float) -> None:
        """Return when there is something new for a round, or after `timeout` seconds at
        the latest. Cancellable; must not block the event loop."""
        ...


@dataclass(frozen=True)
class CollectorSettings:
    """Keys every `[collectors.<name>]` table has. Subclass to add a collector's own."""

    enabled: bool = setting(True, help="run this collector")
    interval: float = setting(
        10.0, minimum=0.05, maximum=86400.0, help="seconds between collection rounds"
    )
    timeout: float = setting(
        5.0, exclusive_minimum=0.0, maximum=3600.0, help="seconds one blocking call may take"
    )

    def replace(self: C, **changes: Any) -> C:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class CollectorSpec(Generic[C]):
    """What a collector module exports as `SPEC`: one registry line finds it."""

    name: str
    description: str
    settings_type: type[C]
    factory: Callable[[C, CollectorDeps], Collector]
    default_settings: C | None = None
    """Defaults that differ from the settings type's own (e.g. enabled=False, interval=...)."""

    def defaults(self) -> C:
        return self.default_settings or self.settings_type()

    def make(self, settings: CollectorSettings, deps: CollectorDeps) -> Collector:
        if not isinstance(settings, self.settings_type):
            raise TypeError(f"{self.name}: settings of type {type(settings).__name__}")
        return self.factory(settings, deps)
