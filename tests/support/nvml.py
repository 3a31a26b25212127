"""Test helpers for the gpu collector: a collector over FakeNvml, rounds through PooledCaller."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from agent.contracts.collector import (
    CollectContext,
    CollectorDeps,
    KeyValueStore,
    MemoryKeyValueStore,
    SharedServices,
)
from agent.contracts.model import Collection, Event, Sample
from agent.runtime.blocking import PooledCaller
from agent.runtime.rounds import WAIT_IN_PLACE
from collectors._nvml import NvmlBackend, NvmlUnavailable
from collectors._xid import XidCorrelator
from collectors.gpu.collector import GpuCollector, GpuSettings
from tests.support.nvml_fake import FakeGpu, FakeNvml


@dataclass
class GpuRig:
    """A gpu collector over a FakeNvml, with the runtime's PooledCaller and a clock."""

    fake: FakeNvml
    settings: GpuSettings = field(default_factory=lambda: GpuSettings(event_thread=False))
    state: KeyValueStore = field(default_factory=MemoryKeyValueStore)
    timeout: float = 2.0
    now: float = 1_000_000.0
    emitted: list[Event] = field(default_factory=list)
    shared: SharedServices = field(default_factory=SharedServices)
    round: int = 0

    def __post_init__(self) -> None:
        self.executor = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="test-call")
        # As the agent's GPU collector calls: waiting in place for each answer first.
        self.caller = PooledCaller(self.executor, self.timeout, wait_in_place=WAIT_IN_PLACE["gpu"])
        self.backend = NvmlBackend(self.fake)
        self.shared.put(NvmlBackend, self.backend)
        self.collector = self.new_collector()

    @property
    def correlator(self) -> XidCorrelator:
        return self.shared.get(XidCorrelator, XidCorrelator)

    def new_collector(self) -> GpuCollector:
        if self.settings.sysfs_root == GpuSettings().sysfs_root:
            # The fake's GPUs are not the host's: on a GPU host (the lent H200) the real PCI bus
            # would disagree with the fake's count and fail tests of other things. A test of the
            # PCI comparison names its fixture tree.
            self.settings = dataclasses.replace(self.settings, sysfs_root="/nonexistent-sysfs")
        deps = CollectorDeps(
            "test-node", Path("/nonexistent"), self.state, self.shared, self.emitted.append
        )
        return GpuCollector(self.settings, deps)

    async def restart(self) -> None:
        """A new agent process: new collector and backend, the same state store."""
        await self.collector.close()
        self.backend.stop()
        self.backend = NvmlBackend(self.fake)
        self.shared = SharedServices()
        self.shared.put(NvmlBackend, self.backend)
        self.collector = self.new_collector()
        self.round = 0

    async def collect(self, advance: float = 10.0) -> Collection:
        ctx = CollectContext(caller=self.caller, now=self.now, round=self.round)
        result = await self.collector.collect(ctx)
        self.round += 1
        self.now += advance
        return result

    async def close(self) -> None:
        await self.collector.close()
        self.executor.shutdown(wait=False, cancel_futures=True)


def fake_gpus(count: int) -> list[FakeGpu]:
    return [FakeGpu.h200(i) for i in range(count)]


def find(
    samples: list[Sample] | tuple[Sample, ...] | Collection, name: str, **labels: str
) -> list[Sample]:
    """Samples of metric `name` whose labels include `labels`."""
    items = samples.samples if isinstance(samples, Collection) else samples
    return [
        s
        for s in items
        if s.family.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]


def value(
    samples: list[Sample] | tuple[Sample, ...] | Collection, name: str, **labels: str
) -> float | None:
    """The single matching sample's value, None when absent; fails on several."""
    found = find(samples, name, **labels)
    assert len(found) <= 1, f"{name} {labels}: {len(found)} samples"
    return found[0].value if found else None


def kinds(events: list[Event] | tuple[Event, ...] | Collection) -> list[str]:
    items = events.events if isinstance(events, Collection) else events
    return [e.kind for e in items]


def series_names(collection: Collection) -> Iterator[str]:
    return (s.family.name for s in collection.samples)


def real_gpu_count() -> int:
    """How many GPUs the real NVML of this host lists; skips the test where there is none."""
    import pytest

    backend = NvmlBackend()
    try:
        backend.start()
    except NvmlUnavailable as exc:
        pytest.skip(f"no NVML here: {exc}")
    try:
        return backend.device_count()
    finally:
        backend.stop()
