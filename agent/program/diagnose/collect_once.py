"""Run a collector's own code for exactly one round, outside the daemon.

`check` and `diag` never re-implement what a collector reads: they build the collector from its
registered SPEC with in-memory state (nothing in the real state store is touched, so the
daemon's counters and cursors stay as they are) and a throw-away state dir, and run its round
through the daemon's own round policy (agent/runtime/rounds.py): the same per-collector pool of
blocking-call threads, the same round bound (four times the longer of interval and call
timeout), the same error text for a call that timed out, a call still hung, an overrun or an
exception. A collector therefore reads the same under `check` as in the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from agent.contracts.collector import (
    Collector,
    CollectorDeps,
    CollectorSettings,
    CollectorSpec,
    MemoryKeyValueStore,
    SharedServices,
)
from agent.contracts.model import Event, Sample
from agent.program import registry
from agent.runtime.blocking import PooledCaller
from agent.runtime.rounds import CollectorPool, collector_pool, run_round

T = TypeVar("T")


@dataclass(frozen=True)
class CollectorResult:
    name: str
    samples: Sequence[Sample] = ()
    events: Sequence[Event] = ()
    error: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.error

    def values(self, metric: str) -> list[Sample]:
        return [s for s in self.samples if s.family.name == metric]

    def to_dict(self) -> dict[str, Any]:
        return {
            "collector": self.name,
            "error": self.error,
            "seconds": round(self.seconds, 4),
            "samples": [
                {"name": s.family.name, "labels": s.labels, "value": s.value} for s in self.samples
            ],
            "events": [e.to_dict() for e in self.events],
        }


@dataclass
class OneShotCollectors:
    """Builds and runs collectors once each; results are cached by name. Use as a context
    manager (async) so the thread pool and the scratch state dir go away afterwards."""

    node_id: str
    collector_settings: dict[str, CollectorSettings]
    shared: SharedServices = field(default_factory=SharedServices)
    results: dict[str, CollectorResult] = field(default_factory=dict)
    extra_emitted: list[Event] = field(default_factory=list)
    specs: Mapping[str, CollectorSpec[Any]] = field(default_factory=dict)
    """Overrides the registry's collectors (tests run their own)."""

    def __post_init__(self) -> None:
        self._scratch = tempfile.TemporaryDirectory(prefix="gpuwarden-check-")
        self._lock = threading.Lock()
        self._pools: dict[tuple[str, float], CollectorPool] = {}

    async def __aenter__(self) -> OneShotCollectors:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # A hung call keeps its thread; do not wait for it (the process is about to exit).
        for pool in self._pools.values():
            pool.shutdown()
        self._scratch.cleanup()

    def _pool(self, name: str, timeout: float) -> CollectorPool:
        """One pool per collector (and call timeout), kept for the runner's life: a call that
        hangs in one run is not started again by the next, as in the daemon."""
        pool = self._pools.get((name, timeout))
        if pool is None:
            pool = self._pools[(name, timeout)] = collector_pool(name, timeout, self._emit)
        return pool

    async def call(self, key: str, fn: Callable[..., T], *args: Any, timeout: float = 5.0) -> T:
        """A blocking call of check's own, on a pool of its own."""
        return await self.caller("check", timeout).call(key, fn, *args)

    def caller(self, name: str, timeout: float) -> PooledCaller:
        """Collector `name`'s caller, for code that drives a collector itself."""
        return self._pool(name, timeout).caller

    @property
    def scratch_dir(self) -> Path:
        return Path(self._scratch.name)

    def hung_calls(self) -> list[str]:
        return sorted(key for pool in self._pools.values() for key in pool.caller.hung)

    def _emit(self, event: Event) -> None:
        with self._lock:
            self.extra_emitted.append(event)

    def build(
        self, name: str, settings: CollectorSettings | None = None
    ) -> tuple[Collector, CollectorSettings]:
        spec = self.specs.get(name) or registry.collector_spec(name)
        chosen = settings or self.collector_settings.get(name) or spec.defaults()
        deps = CollectorDeps(
            node_id=self.node_id,
            state_dir=Path(self._scratch.name),
            state=MemoryKeyValueStore(),
            shared=self.shared,
            emit=self._emit,
        )
        return spec.make(chosen, deps), chosen

    async def run(
        self,
        name: str,
        settings: CollectorSettings | None = None,
        *,
        rounds: int = 1,
        gap: float = 0.0,
    ) -> CollectorResult:
        """One round (or `rounds`, `gap` seconds apart: the samples of the last, the events
        of all). Cached by name when the configured settings are used."""
        if name in self.results and settings is None:
            return self.results[name]
        started = time.monotonic()
        try:
            collector, chosen = self.build(name, settings)
        except Exception as exc:  # a collector that cannot even be built is a finding
            return self._keep(name, CollectorResult(name, error=f"{type(exc).__name__}: {exc}"))
        caller = self.caller(name, chosen.timeout)
        samples: tuple[Sample, ...] = ()
        events: list[Event] = []
        error = ""
        try:
            for number in range(rounds):
                if number:
                    await asyncio.sleep(gap)
                outcome = await run_round(collector, caller, chosen, number)
                samples, error = outcome.samples, outcome.error
                events.extend(outcome.events)
                if error:
                    break
        finally:
            # Closing is best effort in a one-shot run: the process exits next.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(collector.close(), 2.0)
        result = CollectorResult(
            name, () if error else samples, tuple(events), error, time.monotonic() - started
        )
        return self._keep(name, result) if settings is None else result

    def _keep(self, name: str, result: CollectorResult) -> CollectorResult:
        self.results[name] = result
        return result
