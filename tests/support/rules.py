"""Helpers for the alert-rule and dashboard tests: promtool, and the metric names in play."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
RULES = ROOT / "configs/prometheus/gpuwarden-rules.yml"
RULE_TESTS = ROOT / "configs/prometheus/tests/gpuwarden-rules.test.yml"
# The tests of gpuwarden-rules.yml; dcgm-compat-rules.test.yml holds its inputs to what the
# agent renders itself (tests/test_dcgm_compat.py), with a target label of its own (`cluster`).
RULE_TEST_FILES = tuple(
    sorted((ROOT / "configs/prometheus/tests").glob("gpuwarden-rules*.test.yml"))
)
RUNBOOK = ROOT / "docs/runbook.md"
RUNBOOK_PLACEHOLDER = "https://gpuwarden.invalid/docs/runbook.md"
"""The base of every runbook_url in the repository's rules; scripts/install.sh replaces it."""
SEVERITIES = ("critical", "warning")
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


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def dashboard_targets() -> list[tuple[str, str, str]]:
    """(row title, panel title, expr as written) for every query of the Grafana dashboard, in
    the order of its panels (a panel belongs to the row above it)."""
    row = ""
    out = []
    for panel in dashboard()["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
        for target in panel.get("targets", []):
            out.append((row, panel["title"], target["expr"]))
    return out


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, expr) for every query of the Grafana dashboard, variables substituted."""
    return [
        (title, expr.replace("$instance", ".*").replace("$gpu", ".*"))
        for _, title, expr in dashboard_targets()
    ]


def declared_metric_names() -> set[str]:
    """Every `"gpuwarden_..."` string literal in the project's Python sources."""
    names: set[str] = set()
    for folder in ("agent", "collectors", "exporters"):
        for path in (ROOT / folder).rglob("*.py"):
            names.update(re.findall(r'"(gpuwarden_[a-z0-9_]+)"', path.read_text()))
    # Every family is a MetricFamily now, the watcher's too: a counter's name is written with
    # its _total (prometheus_client's CounterMetricFamily added it, so the literal lacked it).
    return names


def alert_rules(text: str | None = None) -> dict[str, dict[str, Any]]:
    """alert name -> its rule (expr, for, labels, annotations), parsed from the rules file."""
    data = yaml.safe_load(RULES.read_text() if text is None else text)
    return {
        rule["alert"]: rule
        for group in data["groups"]
        for rule in group["rules"]
        if "alert" in rule
    }


def rule_tests() -> list[dict[str, Any]]:
    """Every `promtool test rules` case of every test file."""
    cases: list[dict[str, Any]] = []
    for path in RULE_TEST_FILES:
        cases += yaml.safe_load(path.read_text())["tests"]
    return cases


@dataclass(frozen=True)
class InputSeries:
    case: str
    name: str
    labels: dict[str, str]


_SERIES = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)\{(?P<body>.*)\}$")
_PAIR = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*(?:,|$)')


def input_series() -> list[InputSeries]:
    """Every input series of the rule tests, split into name and labels."""
    out: list[InputSeries] = []
    for case in rule_tests():
        for entry in case["input_series"]:
            match = _SERIES.match(entry["series"])
            assert match is not None, f"{case['name']}: cannot read {entry['series']!r}"
            body = match["body"]
            labels = dict(_PAIR.findall(body))
            assert _PAIR.sub("", body) == "", f"{case['name']}: cannot read {body!r}"
            out.append(InputSeries(case["name"], match["name"], labels))
    return out


def heading_anchor(heading: str) -> str:
    """The anchor GitHub and GitLab give a Markdown heading: lower case, punctuation dropped,
    spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def runbook_sections(text: str) -> dict[str, str]:
    """`### <alert>` heading -> the section's text up to the next heading."""
    parts = re.split(r"^(#{1,6} .*)$", text, flags=re.M)
    sections: dict[str, str] = {}
    for heading, body in zip(parts[1::2], parts[2::2], strict=True):
        if heading.startswith("### "):
            sections[heading[4:].strip()] = body
    return sections


def runbook_anchors(text: str) -> set[str]:
    return {heading_anchor(h) for h in re.findall(r"^#{1,6} (.*)$", text, flags=re.M)}
