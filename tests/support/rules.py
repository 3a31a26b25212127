"""Helpers for the alert-rule and dashboard tests: promtool, and the metric names in play."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
RULES = ROOT / "configs/prometheus/gpuwarden-rules.yml"
RULE_TESTS = ROOT / "configs/prometheus/tests/gpuwarden-rules.test.yml"
SCRAPE_CONFIG = ROOT / "configs/prometheus/prometheus.yml"
DASHBOARD = ROOT / "configs/grafana/gpuwarden.json"

METRIC = re.compile(r"\bgpuwarden_[a-z0-9_]+\b")
# Modules that declare the families the rules and the dashboard use. Until every one of them
# is on the branch, a name they would declare cannot be checked.
DECLARING_MODULES = (
    "collectors/gpu/collector.py",
    "collectors/kernel_log/collector.py",
    "collectors/disk/collector.py",
    "collectors/processes.py",
    "collectors/benchmark/collector.py",
    "collectors/checkpoints/collector.py",
    "exporters/mqtt.py",
)


def promtool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PROMTOOL, *map(str, args)], capture_output=True, text=True, timeout=120, check=False
    )


def alert_blocks(text: str) -> dict[str, str]:
    """alert name -> the text of its rule (the rules file is plain, one rule per `- alert:`)."""
    parts = re.split(r"\n(?=\s+- alert: )", text)
    out: dict[str, str] = {}
    for part in parts[1:]:
        name = re.search(r"- alert: (\w+)", part)
        assert name is not None
        out[name.group(1)] = part
    return out


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, expr) for every query of the Grafana dashboard, variables substituted."""
    data = json.loads(DASHBOARD.read_text())
    exprs = []
    for panel in data["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$instance", ".*")
            exprs.append((panel["title"], expr))
    return exprs


def declared_metric_names() -> set[str]:
    """Every `"gpuwarden_..."` string literal in the project's Python sources."""
    names: set[str] = set()
    for folder in ("agent", "collectors", "exporters"):
        for path in (ROOT / folder).rglob("*.py"):
            names.update(re.findall(r'"(gpuwarden_[a-z0-9_]+)"', path.read_text()))
    # prometheus_client's CounterMetricFamily adds _total to the name it is given.
    return names | {f"{name}_total" for name in names if not name.endswith("_total")}
