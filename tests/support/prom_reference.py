"""The reference for exporters/exposition.py: the same snapshot rendered by prometheus_client
(a test dependency only), the way exporters/prometheus.py and the watcher rendered it before
they wrote the text format themselves."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector

from agent.contracts.model import MetricFamily, MetricType, Sample
from exporters.exposition import Block


def _metric(family: MetricFamily) -> GaugeMetricFamily | CounterMetricFamily:
    if family.type is MetricType.COUNTER:
        return CounterMetricFamily(family.name, family.help, labels=family.labels)
    return GaugeMetricFamily(family.name, family.help, labels=family.labels)


class _Fixed:
    def __init__(self, metrics: Sequence[Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterable[Metric]:
        return self.metrics

    def describe(self) -> Sequence[Metric]:
        return ()


def _generate(metrics: Sequence[Metric]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(metrics))
    return generate_latest(registry)


def metrics(families: Iterable[MetricFamily], samples: Iterable[Sample]) -> list[Metric]:
    """exporters/prometheus.py's `render` as it was: the snapshot as prometheus_client families."""
    declared: dict[str, MetricFamily] = {}
    for family in families:
        declared.setdefault(family.name, family)
    grouped: dict[str, list[Sample]] = {}
    for sample in samples:
        declared.setdefault(sample.family.name, sample.family)
        grouped.setdefault(sample.family.name, []).append(sample)
    out: list[Metric] = []
    for name in sorted(grouped):
        metric = _metric(declared[name])
        seen: set[tuple[str, ...]] = set()
        for sample in grouped[name]:
            if sample.label_values in seen:
                continue
            seen.add(sample.label_values)
            metric.add_metric(list(sample.label_values), sample.value)
        out.append(metric)
    return out


def snapshot(families: Iterable[MetricFamily], samples: Iterable[Sample]) -> bytes:
    """The body the agent served for a snapshot, less the process_* series."""
    return _generate(metrics(families, samples))


class _Snapshot:
    def __init__(self, families: Sequence[MetricFamily], samples: Sequence[Sample]) -> None:
        self.families, self.samples = families, samples

    def collect(self) -> Iterable[Metric]:
        return metrics(self.families, self.samples)

    def describe(self) -> Sequence[Metric]:
        return ()


def agent_registry(
    families: Sequence[MetricFamily], samples: Sequence[Sample]
) -> CollectorRegistry:
    """The registry the agent's sink held: the snapshot, then ProcessCollector (for
    `generate_latest`, as a scrape called it)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(families, samples))
    registry.register(ProcessCollector(registry=None))
    return registry


def blocks(groups: Iterable[Block]) -> bytes:
    """What the watcher's families gave, in their order (every sample added, as it did)."""
    out: list[Metric] = []
    for family, samples in groups:
        metric = _metric(family)
        for sample in samples:
            metric.add_metric(list(sample.label_values), sample.value)
        out.append(metric)
    return _generate(out)


def process(pid: int | str = "self") -> bytes:
    """ProcessCollector's series of one process."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ProcessCollector(pid=lambda: pid, registry=None))
    return generate_latest(registry)
