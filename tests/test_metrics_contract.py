"""Every metric family of every registered component: valid names, promtool clean, in docs/metrics.md."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from agent.contracts.collector import CollectorDeps, MemoryKeyValueStore, SharedServices
from agent.contracts.model import METRIC_PREFIX, MetricFamily, Sample
from agent.program import config_file as config
from agent.program import registry
from agent.runtime.core import Runtime
from agent.runtime.state import StateStore
from exporters.exposition import render

METRICS_DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


def all_families(tmp_path: Path) -> list[MetricFamily]:
    deps = CollectorDeps(
        node_id="n",
        state_dir=tmp_path,
        state=MemoryKeyValueStore(),
        shared=SharedServices(),
        emit=lambda event: None,
    )
    families: list[MetricFamily] = []
    for spec in registry.COLLECTORS.values():
        families += spec.make(spec.defaults(), deps).families()
    runtime = Runtime(
        config.parse({}),
        StateStore.in_memory(),
        collectors=registry.COLLECTORS,
        sinks=registry.SINKS,
    )
    families += runtime.metrics.families()
    for sink_spec in registry.SINKS.values():
        families += sink_spec.factory(sink_spec.settings_type(), runtime).families()
    return families


class TestMetricContract:
    """Names follow the contract and the exposition passes promtool."""

    def test_names_unique_and_prefixed(self, tmp_path: Path) -> None:
        families = all_families(tmp_path)
        by_name: dict[str, MetricFamily] = {}
        for family in families:
            assert family.name.startswith(METRIC_PREFIX)
            other = by_name.setdefault(family.name, family)
            assert other == family, f"{family.name} declared twice with different shapes"

    @pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
    def test_promtool_check_metrics(self, tmp_path: Path) -> None:
        families = all_families(tmp_path)
        samples = [f.sample(1, *(f"v{i}" for i in range(len(f.labels)))) for f in families]
        text = render(families, samples)
        result = subprocess.run(
            ["promtool", "check", "metrics"],
            input=text,
            capture_output=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()

    def test_metrics_doc_lists_every_metric(self, tmp_path: Path) -> None:
        text = METRICS_DOC.read_text()
        missing = sorted(
            {
                f.name
                for f in all_families(tmp_path)
                if not re.search(rf"`{re.escape(f.name)}(`|\{{)", text)
            }
        )
        assert not missing, f"docs/metrics.md has no row for: {missing}"

    def test_sample_rejects_nan_and_wrong_labels(self) -> None:
        family = MetricFamily(
            "gpuwarden_x_celsius",
            __import__("agent.contracts.model").contracts.model.MetricType.GAUGE,
            "x",
            ("gpu",),
        )
        with pytest.raises(ValueError, match="NaN"):
            family.sample(float("nan"), "0")
        with pytest.raises(ValueError, match="labels"):
            Sample(family, (), 1.0)
