"""The runtime's own series: build info, collector health, events, state store, sink ledger."""

from __future__ import annotations

import platform
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

from agent import __version__
from agent.contracts.model import MetricFamily, MetricType, Sample, Severity
from agent.runtime.store_guard import QUEUE_FULL

if TYPE_CHECKING:
    from agent.runtime.core import Runtime

G, C = MetricType.GAUGE, MetricType.COUNTER

BUILD_INFO = MetricFamily(
    "gpuwarden_build_info", G, "gpuwarden version and Python, always 1", ("version", "python")
)
NODE_INFO = MetricFamily(
    "gpuwarden_node_info", G, "The node id this agent reports as, always 1", ("node",)
)
START_TIME = MetricFamily(
    "gpuwarden_start_time_seconds",
    G,
    "When the agent started, seconds since the epoch",
    unit="seconds",
)
COLLECTOR_SUCCESS = MetricFamily(
    "gpuwarden_collector_success",
    G,
    "1 if the collector's last round succeeded, else 0",
    ("collector",),
)
COLLECTOR_DURATION = MetricFamily(
    "gpuwarden_collector_duration_seconds",
    G,
    "Wall time of the collector's last round",
    ("collector",),
    "seconds",
)
COLLECTOR_LAST_SUCCESS = MetricFamily(
    "gpuwarden_collector_last_success_timestamp_seconds",
    G,
    "When the collector last succeeded, seconds since the epoch",
    ("collector",),
    "seconds",
)
COLLECTOR_INTERVAL = MetricFamily(
    "gpuwarden_collector_interval_seconds",
    G,
    "The collector's configured interval",
    ("collector",),
    "seconds",
)
COLLECTOR_RUNS = MetricFamily(
    "gpuwarden_collector_runs_total", C, "Collection rounds started", ("collector",)
)
COLLECTOR_FAILURES = MetricFamily(
    "gpuwarden_collector_failures_total", C, "Collection rounds that failed", ("collector",)
)
COLLECTOR_HUNG = MetricFamily(
    "gpuwarden_collector_hung_calls",
    G,
    "Blocking calls of the collector still running past their timeout",
    ("collector",),
)
EVENTS = MetricFamily(
    "gpuwarden_events_total",
    C,
    "Events raised since the agent started",
    ("source", "kind", "severity"),
)
COLLECTOR_START_FAILED = MetricFamily(
    "gpuwarden_collector_start_failed",
    G,
    "1 while the collector's configured settings could not be built (it runs on with its "
    "previous ones, or not at all)",
    ("collector",),
)
CONFIG_RESTART_PENDING = MetricFamily(
    "gpuwarden_config_restart_pending",
    G,
    "1 while the configuration file has changes that apply only after a restart",
)
CONFIG_RELOAD_OK = MetricFamily(
    "gpuwarden_config_last_reload_successful",
    G,
    "1 if the last reload (SIGHUP) applied the whole file, 0 if it was refused or a collector "
    "could not be built",
)
HEALTH = MetricFamily(
    "gpuwarden_health_ok", G, "1 while collection and delivery are fresh (see /healthz), else 0"
)
STATE_DURABLE = MetricFamily(
    "gpuwarden_state_store_durable",
    G,
    "1 if the state store is on disk, 0 if it fell back to memory",
)
STATE_WRITE_FAILURES = MetricFamily(
    "gpuwarden_state_store_write_failures_total", C, "Failed writes to the state store"
)
STATE_WRITE_FAILING = MetricFamily(
    "gpuwarden_state_store_write_failing",
    G,
    "1 while the state store cannot write (a full disk); 0 from the first write that works",
)
STATE_QUEUED_EVENTS = MetricFamily(
    "gpuwarden_state_store_queued_events",
    G,
    "Events waiting in memory for the state store (written once it can)",
)
STATE_QUEUED_VALUES = MetricFamily(
    "gpuwarden_state_store_queued_values",
    G,
    "Key-value state (counters, cursors) waiting in memory for the state store",
)
EVENTS_DROPPED = MetricFamily(
    "gpuwarden_events_dropped_total",
    C,
    "Events dropped unstored: the state store could not write and the memory queue was full",
    ("reason",),
)
SINK_UP = MetricFamily(
    "gpuwarden_sink_up", G, "1 if the sink's last delivery attempt succeeded", ("sink",)
)
SINK_LAST_DELIVERY = MetricFamily(
    "gpuwarden_sink_last_delivery_timestamp_seconds",
    G,
    "When the sink last confirmed a delivery (MQTT PUBACK, a scrape served)",
    ("sink",),
    "seconds",
)
SINK_FAILURES = MetricFamily(
    "gpuwarden_sink_failures_total", C, "Delivery failures of the sink", ("sink",)
)
STALE = MetricFamily(
    "gpuwarden_stale",
    G,
    "1 while a collector has not succeeded, or a sink not delivered, for the stale limit",
    ("kind", "name"),
)

REPAIR_REQUIRED = MetricFamily(
    "gpuwarden_repair_required",
    G,
    "1 per repair action required on a subject (GPU UUID, mount point, host) and not yet "
    "cleared, with the worst severity of the findings that require it; the series goes away "
    "when it is cleared",
    ("action", "subject", "severity"),
)
REPAIR_SINCE = MetricFamily(
    "gpuwarden_repair_required_since_timestamp_seconds",
    G,
    "When the repair action was first required on the subject, seconds since the epoch",
    ("action", "subject"),
    "seconds",
)

GPU_PAUSED = MetricFamily(
    "gpuwarden_gpu_paused",
    G,
    "1 while the GPUs are let go of on request (gpuwarden pause): no GPU series, no GPU alert",
)
GPU_PAUSE_END = MetricFamily(
    "gpuwarden_gpu_pause_end_timestamp_seconds",
    G,
    "When the pause in force ends by itself, seconds since the epoch",
    unit="seconds",
)


class MetricSource(Protocol):
    """Series of a part of the program outside the runtime (the control socket)."""

    def families(self) -> Sequence[MetricFamily]: ...

    def samples(self) -> Sequence[Sample]: ...


class RuntimeMetrics:
    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime
        self.sources: list[MetricSource] = []
        """Series the program hands in (the control socket's), each with its families."""

    def families(self) -> tuple[MetricFamily, ...]:
        return (
            BUILD_INFO,
            NODE_INFO,
            START_TIME,
            COLLECTOR_SUCCESS,
            COLLECTOR_DURATION,
            COLLECTOR_LAST_SUCCESS,
            COLLECTOR_INTERVAL,
            COLLECTOR_RUNS,
            COLLECTOR_FAILURES,
            COLLECTOR_HUNG,
            COLLECTOR_START_FAILED,
            CONFIG_RESTART_PENDING,
            CONFIG_RELOAD_OK,
            EVENTS,
            HEALTH,
            STATE_DURABLE,
            STATE_WRITE_FAILURES,
            STATE_WRITE_FAILING,
            STATE_QUEUED_EVENTS,
            STATE_QUEUED_VALUES,
            EVENTS_DROPPED,
            SINK_UP,
            SINK_LAST_DELIVERY,
            SINK_FAILURES,
            STALE,
            REPAIR_REQUIRED,
            REPAIR_SINCE,
            GPU_PAUSED,
            GPU_PAUSE_END,
        )

    def samples(self) -> Iterator[Sample]:
        rt = self._runtime
        yield BUILD_INFO.sample(1, __version__, platform.python_version())
        yield NODE_INFO.sample(1, rt.node_id)
        yield START_TIME.sample(rt.started)
        for name, status in rt.collectors.items():
            yield COLLECTOR_INTERVAL.sample(status.settings.interval, name)
            yield COLLECTOR_RUNS.sample(status.runs, name)
            yield COLLECTOR_FAILURES.sample(status.failures, name)
            if status.success is not None:
                yield COLLECTOR_SUCCESS.sample(1 if status.success else 0, name)
                yield COLLECTOR_DURATION.sample(status.duration, name)
            if status.last_success is not None:
                yield COLLECTOR_LAST_SUCCESS.sample(status.last_success, name)
        # Per pool, not per running collector: a collector disabled by a reload may still
        # have a thread stuck in a driver.
        for name, pool in rt.pools.items():
            yield COLLECTOR_HUNG.sample(len(pool.caller.hung), name)
        for name in sorted(rt.collectors.keys() | rt.start_failures.keys()):
            yield COLLECTOR_START_FAILED.sample(1 if name in rt.start_failures else 0, name)
        yield CONFIG_RESTART_PENDING.sample(1 if rt.pending_restart else 0)
        yield CONFIG_RELOAD_OK.sample(1 if rt.last_reload_ok else 0)
        for (source, kind, severity), count in sorted(rt.events_by_key.items()):
            yield EVENTS.sample(count, source, kind, severity)
        yield HEALTH.sample(1 if rt.health(time.time()).ok else 0)
        yield STATE_DURABLE.sample(1 if rt.store.durable else 0)
        yield STATE_WRITE_FAILURES.sample(rt.store.write_failures)
        guard = rt.guard
        yield STATE_WRITE_FAILING.sample(0 if guard.failing is None else 1)
        yield STATE_QUEUED_EVENTS.sample(guard.queued_events)
        yield STATE_QUEUED_VALUES.sample(guard.queued_values)
        for reason in sorted({QUEUE_FULL, *guard.dropped}):
            yield EVENTS_DROPPED.sample(guard.dropped[reason], reason)
        for sink, entry in rt.ledger.items():
            yield SINK_UP.sample(1 if entry.up else 0, sink)
            yield SINK_FAILURES.sample(entry.failures, sink)
            if entry.last_delivery is not None:
                yield SINK_LAST_DELIVERY.sample(entry.last_delivery, sink)
        stale = rt.stale
        for name in rt.collectors:
            yield STALE.sample(1 if ("collector", name) in stale else 0, "collector", name)
        for name, sink_obj in rt.sinks.items():
            if sink_obj.expected_interval is not None:
                yield STALE.sample(1 if ("sink", name) in stale else 0, "sink", name)
        yield from self._repairs()
        yield from self._pause()

    def _pause(self) -> Iterator[Sample]:
        paused = self._runtime.pause_state()
        yield GPU_PAUSED.sample(0 if paused is None else 1)
        if paused is not None:
            yield GPU_PAUSE_END.sample(paused.until)

    def _repairs(self) -> Iterator[Sample]:
        since: dict[tuple[str, str], float] = {}
        worst: dict[tuple[str, str], Severity] = {}
        for repair in self._runtime.repairs():  # several kinds may need one action of one subject
            key = (repair.action.value, repair.subject)
            since[key] = min(since.get(key, repair.since), repair.since)
            worst[key] = max(worst.get(key, repair.severity), repair.severity)
        for (action, subject), first in sorted(since.items()):
            # The severity tells a page (a lost GPU needs a reboot) from a ticket (a degraded
            # PCIe link needs an inspection): the alert rules split on it.
            yield REPAIR_REQUIRED.sample(1, action, subject, worst[(action, subject)].label)
            yield REPAIR_SINCE.sample(first, action, subject)
