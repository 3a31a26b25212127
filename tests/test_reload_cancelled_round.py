"""A round that a reload or a stop cancels leaves nothing of itself in the collector's state.

The runtime stores a round's key-value writes with (never before) its events. A round cancelled
part way (a reload that restarts or disables its collector, a stop) returns no events, but what
it had written stayed held in the collector's state: the next instance read it, and the stop
stored it. A collector that had moved a counter's last value and then awaited a call (the GPU
collector reads the owners of new GPU processes after it has taken in every GPU's counters)
lost that increase for good: the new instance, and the agent after a restart, saw no change.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pynvml
import pytest

from agent.contracts.collector import (
    CollectContext,
    CollectorDeps,
    CollectorSettings,
    CollectorSpec,
)
from agent.contracts.model import Collection, Event, MetricFamily, Severity
from agent.program import config_file as config
from agent.program import registry
from agent.runtime.core import Runtime
from agent.runtime.state import StateStore
from collectors._nvml import NvmlBackend
from collectors.gpu import collector as gpu_collector
from collectors.gpu.collector import GpuSettings
from tests.support.nvml import fake_gpus
from tests.support.nvml_fake import FakeNvml, FakeProcess
from tests.support.waiting import announced, until
from tests.test_reload_hangs import runtime_for

FAST = CollectorSettings(interval=0.05, timeout=30.0)


class Counting:
    """Each round takes in a counter that went up by one: stores its new last value, then
    awaits a call (which blocks while `gate` is shut), then reports the increase."""

    name = "counting"

    def __init__(self, deps: CollectorDeps, gate: threading.Event, waiting: threading.Event):
        self.deps, self.gate, self.waiting = deps, gate, waiting

    def families(self) -> Sequence[MetricFamily]:
        return ()

    def _owners(self) -> None:
        self.waiting.set()
        self.gate.wait(30)

    async def collect(self, ctx: CollectContext) -> Collection:
        last = self.deps.state.get("test", "last")
        value = (last if isinstance(last, int) else 0) + 1
        self.deps.state.put("test", "last", value)
        await ctx.call("test:owners", self._owners)
        return Collection(
            events=[
                Event(
                    source=self.name,
                    kind="counter_increase",
                    severity=Severity.WARNING,
                    message=f"counter went from {value - 1} to {value}",
                    attributes={"value": value},
                )
            ]
        )

    async def close(self) -> None:
        return None


class Harness:
    def __init__(self, store: StateStore) -> None:
        self.gate = threading.Event()
        self.waiting = threading.Event()
        spec = CollectorSpec("counting", "test", CollectorSettings, self._make)
        cfg = config.parse({"prometheus": {"enabled": False}})
        self.config = dataclasses.replace(cfg, collectors={"counting": FAST})
        self.runtime = Runtime(
            self.config, store, collectors={"counting": spec}, sinks=registry.SINKS
        )

    def _make(self, settings: CollectorSettings, deps: CollectorDeps) -> Counting:
        return Counting(deps, self.gate, self.waiting)

    def values(self) -> list[Any]:
        return [
            e.attributes["value"]
            for e in self.runtime.recent_events
            if e.kind == "counter_increase"
        ]

    async def rounds(self, count: int) -> None:
        """Let `count` more increases through, then shut the gate: the next round waits."""
        goal = len(self.values()) + count
        self.gate.set()
        await until(lambda: len(self.values()) >= goal, what=f"{goal} increases")
        self.waiting.clear()
        self.gate.clear()
        await until(self.waiting.is_set, what="a round waiting in its call")

    def with_settings(self, settings: CollectorSettings) -> config.Config:
        return dataclasses.replace(self.config, collectors={"counting": settings})


def contiguous(values: list[Any]) -> None:
    assert values == list(range(1, len(values) + 1)), values


class TestACancelledRoundLeavesNothing:
    @pytest.mark.parametrize(
        "reload",
        [
            pytest.param([FAST.replace(interval=0.06)], id="restarted"),
            pytest.param([FAST.replace(enabled=False), FAST], id="disabled-then-enabled"),
            pytest.param([FAST.replace(timeout=20.0)] * 3, id="three-reloads"),
        ],
    )
    async def test_across_a_reload(self, reload: list[CollectorSettings]) -> None:
        harness = Harness(StateStore.in_memory())
        runtime = harness.runtime
        await runtime.start()
        try:
            await harness.rounds(2)
            for settings in reload:
                # The round waiting in its call has stored last = 3: it is cancelled.
                await runtime.reload(harness.with_settings(settings))
                if settings.enabled:
                    await until(harness.waiting.is_set, what="the new instance's round")
            await harness.rounds(2)
            await runtime.settle()
            contiguous(harness.values())
        finally:
            harness.gate.set()
            await runtime.stop()

    async def test_across_a_stop_and_a_start(self, tmp_path: Path) -> None:
        first = Harness(StateStore.open(tmp_path))
        await first.runtime.start()
        try:
            await first.rounds(2)
        finally:
            await first.runtime.stop()  # cancels the round waiting in its call
            first.gate.set()
            first.runtime.store.close()
        seen = first.values()
        second = Harness(StateStore.open(tmp_path))
        await second.runtime.start()
        try:
            await second.rounds(1)
            await second.runtime.settle()
            contiguous(seen + second.values())
        finally:
            second.gate.set()
            await second.runtime.stop()
            second.runtime.store.close()


class TestTheGpuCollector:
    async def test_an_ecc_increase_taken_in_before_a_reload(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The GPU round takes in every GPU's counters, then reads the owners of new GPU
        processes from /proc: a job that starts with the errors, and a /proc slow to answer,
        leave the round waiting there when the reload comes."""
        gate, waiting = threading.Event(), threading.Event()
        read_owners = gpu_collector._read_owners

        def slow_owners(proc_root: str, pids: list[int]) -> Any:
            waiting.set()
            gate.wait(30)
            return read_owners(proc_root, pids)

        monkeypatch.setattr(gpu_collector, "_read_owners", slow_owners)
        fake = FakeNvml(fake_gpus(1))
        settings = GpuSettings(interval=0.05, timeout=30.0, event_thread=False)
        runtime = runtime_for({"gpu": settings})
        runtime.shared.put(NvmlBackend, NvmlBackend(fake))
        await runtime.start()
        try:
            await until(lambda: runtime.collectors["gpu"].rounds_done >= 2, what="GPU rounds")
            uncorrected = (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
            fake.gpus[0].ecc[uncorrected] = 3
            fake.gpus[0].processes = [FakeProcess(4242, 2**20)]
            await until(waiting.is_set, what="the round reading the owners")
            restarted = GpuSettings(interval=0.06, timeout=30.0, event_thread=False)
            await runtime.reload(dataclasses.replace(runtime.config, collectors={"gpu": restarted}))
            gate.set()
            (event,) = await announced(runtime, "ecc_uncorrected_volatile_increase", timeout=15)
            assert event.attributes["delta"] == 3
        finally:
            gate.set()
            await runtime.stop()
