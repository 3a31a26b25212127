"""The contract between the runtime and a sink (an exporter: Prometheus, MQTT).

A sink knows its protocol and nothing of GPUs. It sees the runtime only as a `SinkContext`:
it reads the snapshot, is told of new events through the outbox (durable) or `subscribe`,
records each confirmed delivery in the ledger, and runs as one supervised task.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, ParamSpec, Protocol, TypeVar

from agent.contracts.clock import Stamp
from agent.contracts.collector import CollectorSettings, KeyValueStore
from agent.contracts.heartbeat import HeartbeatSettings
from agent.contracts.model import ActiveRepair, Event, MetricFamily, Sample
from agent.contracts.pause import PauseState

S = TypeVar("S")
P = ParamSpec("P")
T = TypeVar("T")

EventListener = Callable[[Event], None]


@dataclass(frozen=True)
class Health:
    """The node's health: `problems` make it unhealthy, `notices` do not.

    A problem means collection or delivery is failing: /healthz answers 503, `gpuwarden_health_ok`
    is 0, the heartbeat's `health` lists it and the watcher raises `node_unhealthy`.

    A notice says that the running agent differs from its configuration file: a change that
    waits for a restart, a reload that was refused, new collector settings that could not be
    built while the collector runs on with its previous ones. Each follows an operator's own
    edit and is logged at that SIGHUP; collection and delivery are as healthy as before, and a
    node must not be paged for an edit. So a notice is shown (the /healthz body, STATUS=, the
    heartbeat's `notices`, a metric each) but /healthz stays 200, until file and agent agree
    again. A configured collector that does not run at all (its build failed and there was no
    previous instance) is a problem, not a notice: its data is missing.
    """

    ok: bool
    problems: tuple[str, ...]
    notices: tuple[str, ...] = ()

    def summary(self) -> str:
        text = "ok" if self.ok else "degraded: " + "; ".join(self.problems)
        if self.notices:
            text += " (notice: " + "; ".join(self.notices) + ")"
        return text


@dataclass
class SinkLedger:
    """Per sink: when it last confirmed a delivery, and how often it failed."""

    delivery: Stamp | None = None
    """The last confirmed delivery: its wall-clock time and an age that does not step."""
    failures: int = 0
    last_failure: str = ""
    up: bool = False

    @property
    def last_delivery(self) -> float | None:
        """Wall-clock time of the last confirmed delivery (None: none yet)."""
        return None if self.delivery is None else self.delivery.wall

    @last_delivery.setter
    def last_delivery(self, wall: float | None) -> None:
        self.delivery = None if wall is None else Stamp.at(wall)

    def delivery_age(self, now: float | None = None) -> float | None:
        """Seconds since the last confirmed delivery, on a clock that does not step."""
        return None if self.delivery is None else self.delivery.age(now)


@dataclass(frozen=True, slots=True)
class OutboxEntry:
    seq: int
    kind: str
    key: str
    created: float
    payload: bytes


class CollectorView(Protocol):
    """What a sink may read of one collector's state (the heartbeat reports it)."""

    @property
    def settings(self) -> CollectorSettings: ...

    @property
    def success(self) -> bool | None: ...

    @property
    def last_success(self) -> float | None: ...

    def last_success_age(self, now: float | None = None) -> float | None:
        """Seconds since the last success, on a clock that does not step (None: none)."""
        ...

    @property
    def paused(self) -> bool:
        """Let go of the GPUs on request (agent/contracts/pause.py)."""
        ...


class OutboxStore(KeyValueStore, Protocol):
    """The durable outbox: entries written before delivery, deleted after confirmation."""

    def outbox_put(
        self, kind: str, key: str, payload: bytes, created: float | None = None
    ) -> int: ...

    def outbox_peek(self, limit: int = 100, after_seq: int = 0) -> list[OutboxEntry]: ...

    def outbox_replace(
        self, kind: str, key: str, payload: bytes, created: float | None = None
    ) -> int:
        """Queue `payload` in place of every undelivered entry of its kind."""
        ...

    def outbox_ack(self, seqs: Sequence[int]) -> dict[str, int]:
        """Delete entries by seq; how many of each kind were still there."""
        ...

    def outbox_depth(self) -> dict[str, int]:
        """Entries by kind: kept in memory, no query (a scrape or heartbeat may ask)."""
        ...

    def outbox_usage(self) -> tuple[int, int]:
        """(entries, payload bytes): kept in memory, no query."""
        ...

    def outbox_oldest(
        self, kind: str, limit: int, skip_newest: int = 0
    ) -> list[tuple[int, int]]: ...

    def outbox_expire(self, created_before: float) -> dict[str, int]: ...


class SinkContext(Protocol):
    """All a sink may see of the runtime. The runtime implements it; tests may fake it."""

    @property
    def node_id(self) -> str: ...

    @property
    def heartbeat_settings(self) -> HeartbeatSettings: ...

    @property
    def store(self) -> OutboxStore:
        """The outbox. Its calls (but depth and usage) are SQLite: make them through
        `in_store_thread`, never on the event loop."""
        ...

    @property
    def state(self) -> KeyValueStore:
        """Small durable values (the MQTT birth number). A write never raises: what the disk
        refuses is kept in memory and written later. A read may touch SQLite."""
        ...

    async def in_store_thread(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run `fn` (a store call) in the runtime's store thread: off the event loop, in turn
        with the runtime's own writes."""
        ...

    @property
    def first_round(self) -> asyncio.Event:
        """Set once every collector finished its first round."""
        ...

    @property
    def collectors(self) -> Mapping[str, CollectorView]: ...

    @property
    def ledger(self) -> Mapping[str, SinkLedger]: ...

    def health(self, now: float | None = None) -> Health: ...

    def families(self) -> list[MetricFamily]: ...

    def samples(self) -> list[Sample]: ...

    def enable_outbox(self) -> None:
        """From now on every event is also queued in the outbox (a durable sink drains it)."""
        ...

    def subscribe(self, listener: EventListener) -> None:
        """`listener(event)` for each new event, on the loop, after the event is stored and
        the repair ledger has taken it in (so `repairs()` already reflects it)."""
        ...

    def repairs(self) -> Sequence[ActiveRepair]:
        """The repair actions required now and not cleared (agent/runtime/repairs.py)."""
        ...

    def pause_state(self) -> PauseState | None:
        """The pause in force (`gpuwarden pause`: the GPUs are let go of), or None."""
        ...

    def emit(self, event: Event) -> None: ...

    def record_delivery(self, sink: str, when: float | None = None) -> None: ...

    def record_failure(self, sink: str, reason: str) -> None: ...

    def beat(self, name: str) -> None:
        """Tell the watchdog's supervisor that the task `name` made progress."""
        ...


class Sink(Protocol):
    name: str

    expected_interval: float | None
    """Seconds within which this sink should confirm a delivery; None: no expectation (a
    Prometheus endpoint nobody scrapes is not, by itself, a failure)."""

    def families(self) -> Sequence[MetricFamily]:
        """The sink's own metric families (beyond the runtime's ledger series)."""
        ...

    def samples(self) -> Sequence[Sample]: ...

    def problems(self) -> Sequence[str]:
        """The sink's own health problems beyond staleness (an outbox that drops), for
        /healthz, STATUS= and the heartbeat. Empty when all is well."""
        ...

    async def start(self) -> None:
        """Bind sockets, validate files. Raise to refuse to start (a port taken, a bad cert)."""
        ...

    async def run(self) -> None:
        """The sink's long-running work, until cancelled. Call `context.beat`."""
        ...

    async def stop(self) -> None:
        """A clean stop: say goodbye (MQTT offline), close sockets. Bounded in time."""
        ...


@dataclass(frozen=True)
class SinkSpec(Generic[S]):
    name: str
    description: str
    settings_type: type[S]
    factory: Callable[[S, SinkContext], Sink]
    enabled: Callable[[S], bool] = lambda settings: bool(getattr(settings, "enabled", True))
