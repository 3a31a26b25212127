"""A round that fails keeps the collector's counters on /metrics, at their last values, and
drops its gauges.

A counter is a count of what happened: a failed round makes it no less true. A counter series
that vanishes for a scrape is marked stale by Prometheus, and the rules that page on a counter
seen for the first time (`X unless X offset 10m`, which the kernel-log findings, SXid and Xid
alerts use, configs/prometheus/gpuwarden-rules.yml) then fire ten minutes after the gap, with
the old count, although nothing new happened. A gauge from a failed round would be a reading
nobody took: it goes (gpuwarden_collector_success says why).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

from agent.contracts.collector import (
    CollectContext,
    CollectorSettings,
    CollectorSpec,
)
from agent.contracts.model import Collection, MetricFamily, MetricType
from agent.program import config_file
from agent.runtime.core import Runtime
from agent.runtime.state import StateStore
from tests.support.waiting import until

FOUND = MetricFamily(
    "gpuwarden_test_found_total", MetricType.COUNTER, "Things a test collector found", ("kind",)
)
LEVEL = MetricFamily("gpuwarden_test_level", MetricType.GAUGE, "A test collector's reading")


class FailsWhenTold:
    """Counts its good rounds; fails while `failing` is set."""

    def __init__(self) -> None:
        self.name = "flaky"
        self.failing = False
        self.good = 0

    def families(self) -> Sequence[MetricFamily]:
        return (FOUND, LEVEL)

    async def collect(self, ctx: CollectContext) -> Collection:
        if self.failing:
            raise OSError("the source went away")
        self.good += 1
        return Collection(samples=[FOUND.sample(float(self.good), "io_error"), LEVEL.sample(42.0)])

    async def close(self) -> None:
        return None


def exported(runtime: Runtime) -> dict[str, float]:
    return {
        s.family.name: s.value
        for s in runtime.samples()
        if s.family.name.startswith("gpuwarden_test")
    }


async def test_a_failed_round_keeps_the_counters_and_drops_the_gauges() -> None:
    collector = FailsWhenTold()
    spec = CollectorSpec("flaky", "test", CollectorSettings, lambda s, d: collector)
    cfg = config_file.parse({"prometheus": {"enabled": False}})
    cfg = dataclasses.replace(cfg, collectors={"flaky": CollectorSettings(interval=0.05)})
    runtime = Runtime(cfg, StateStore.in_memory(), collectors={"flaky": spec}, sinks={})
    await runtime.start()
    try:
        await until(lambda: collector.good >= 2, 10.0, "two good rounds")
        collector.failing = True
        status = runtime.collectors["flaky"]
        failures = status.failures
        await until(lambda: status.failures >= failures + 2, 10.0, "two failed rounds")
        counted = collector.good
        seen = exported(runtime)
        assert seen == {"gpuwarden_test_found_total": float(counted)}, seen
        assert not status.success
        collector.failing = False
        await until(lambda: collector.good > counted, 10.0, "a good round again")
        await asyncio.sleep(0)
        assert exported(runtime)["gpuwarden_test_level"] == 42.0
    finally:
        await runtime.stop()
