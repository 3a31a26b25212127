"""The contract between the runtime and a sink (an exporter: Prometheus, MQTT).

A sink knows its protocol and nothing of GPUs. It reads the runtime's snapshot, is told of new
events through the outbox (durable) or `subscribe`, records each confirmed delivery in the
ledger, and runs as one supervised task.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from agent.contracts.model import Event, MetricFamily, Sample

if TYPE_CHECKING:
    from agent.runtime.core import Runtime

S = TypeVar("S")


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
        """The sink's long-running work, until cancelled. Call `runtime.supervisor.beat`."""
        ...

    async def stop(self) -> None:
        """A clean stop: say goodbye (MQTT offline), close sockets. Bounded in time."""
        ...


@dataclass(frozen=True)
class SinkSpec(Generic[S]):
    name: str
    description: str
    settings_type: type[S]
    factory: Callable[[S, Runtime], Sink]
    enabled: Callable[[S], bool] = lambda settings: bool(getattr(settings, "enabled", True))


EventListener = Callable[[Event], None]
