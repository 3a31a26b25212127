"""Alert rules, scrape configuration and dashboard, checked with the real promtool."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from collectors._xid_catalog import catalog
from tests.support.rules import (
    DECLARING_MODULES,
    METRIC,
    ROOT,
    RULE_TESTS,
    RULES,
    SCRAPE_CONFIG,
    alert_blocks,
    dashboard_exprs,
    declared_metric_names,
    promtool,
)


class TestPromtool:
    """promtool accepts the rules, their unit tests pass, the scrape example is valid."""

    def test_check_rules(self) -> None:
        done = promtool("check", "rules", RULES)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "SUCCESS" in done.stdout

    def test_rule_unit_tests(self) -> None:
        done = promtool("test", "rules", RULE_TESTS)
        assert done.returncode == 0, done.stdout + done.stderr

    def test_scrape_config(self) -> None:
        done = promtool("check", "config", SCRAPE_CONFIG)
        assert done.returncode == 0, done.stdout + done.stderr

    def test_a_broken_rule_would_be_caught(self, tmp_path: Path) -> None:
        broken = tmp_path / "rules.yml"
        broken.write_text(
            RULES.read_text().replace("gpuwarden_health_ok == 0", "gpuwarden_health_ok == == 0")
        )
        assert promtool("check", "rules", broken).returncode != 0


class TestRuleShape:
    """Every rule: a `for:`, a severity, a summary and a description that says what to do."""

    def test_every_alert_is_complete(self) -> None:
        blocks = alert_blocks(RULES.read_text())
        assert len(blocks) >= 25
        for name, block in blocks.items():
            assert re.search(r"\n\s+for: \d+[smh]", block), name
            assert re.search(r"\n\s+severity: (critical|warning)\n", block), name
            assert "summary:" in block, name
            assert "description:" in block, name

    def test_every_alert_has_firing_and_quiet_cases(self) -> None:
        tests = RULE_TESTS.read_text()
        for name in alert_blocks(RULES.read_text()):
            firing = re.search(rf"alertname: {name}\n\s+exp_alerts:\n\s+- exp_labels", tests)
            quiet = re.search(rf"alertname: {name}\n\s+exp_alerts: \[\]", tests)
            assert firing, f"{name}: no test where it fires"
            assert quiet, f"{name}: no test where it must not fire"


class TestMetricNames:
    """The rules and the dashboard use only metric names the code declares."""

    def used(self) -> set[str]:
        names = set(METRIC.findall(RULES.read_text()))
        names.update(n for _, expr in dashboard_exprs() for n in METRIC.findall(expr))
        return names

    def test_names_are_declared(self) -> None:
        declared = declared_metric_names()
        missing = sorted(self.used() - declared)
        absent_modules = [m for m in DECLARING_MODULES if not (ROOT / m).exists()]
        if missing and absent_modules:
            pytest.skip(f"not on this branch yet: {absent_modules}; unchecked: {missing}")
        assert missing == []

    def test_watcher_names_are_declared_here(self) -> None:
        watcher = {n for n in self.used() if n.startswith("gpuwarden_watch_")}
        assert watcher
        assert watcher <= declared_metric_names()


class TestDashboard:
    """Every query of the Grafana dashboard is valid PromQL (promtool parses it as a rule)."""

    def test_every_expr_parses(self, tmp_path: Path) -> None:
        exprs = dashboard_exprs()
        assert len(exprs) >= 15
        lines = ["groups:", "  - name: dashboard", "    rules:"]
        for i, (_, expr) in enumerate(exprs):
            lines += [
                f"      - record: gpuwarden_dashboard:query_{i}",
                f"        expr: '{expr.replace(chr(39), chr(39) * 2)}'",
            ]
        path = tmp_path / "dashboard-rules.yml"
        path.write_text("\n".join(lines) + "\n")
        done = promtool("check", "rules", path)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"{len(exprs)} rules found" in done.stdout


class TestAlertRule:
    """The Prometheus alert for Xids that take the GPU or node out of service is the catalog's
    list, not a copy that drifts from it."""

    def test_critical_xid_rule_matches_the_catalog(self) -> None:
        text = RULES.read_text(encoding="utf-8")
        block = text.split("alert: GpuwardenCriticalXid", 1)[1].split("- alert:", 1)[0]
        lists = set(re.findall(r'xid=~"([0-9|]+)"', block))
        assert len(lists) == 1, lists
        in_rule = sorted(int(c) for c in lists.pop().split("|"))
        # Reset or reboot by NVIDIA's bucket; NVLink5 (144-150) too, since the counter cannot
        # tell a Fatal event from a Nonfatal one.
        wanted = {
            "reset_gpu",
            "reboot_node",
            "workflow_xid48",
            "workflow_nvlink",
            "workflow_nvlink5",
        }
        expected = sorted(c for c, i in catalog().xid.items() if i.bucket in wanted and i.in_use)
        assert in_rule == expected
