"""Alert rules, scrape configuration and dashboard, checked with the real promtool."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import pytest

from agent.contracts.model import GPU_LABELS, MetricFamily, RepairAction, Severity
from agent.runtime.repairs import NOT_HELD
from collectors._xid_catalog import catalog
from collectors.gpu.collector import GpuSettings
from collectors.kernel_log.matchers import KINDS
from exporters.actions.settings import DRAIN_ACTIONS, SlurmSettings
from tests.support.nvml import GpuRig
from tests.support.nvml_fake import FakeGpu, FakeNvml
from tests.support.rules import (
    DECLARING_MODULES,
    METRIC,
    ROOT,
    RULE_TEST_FILES,
    RULES,
    RUNBOOK,
    RUNBOOK_PLACEHOLDER,
    SCRAPE_CONFIG,
    SEVERITIES,
    alert_blocks,
    alert_rules,
    dashboard,
    dashboard_exprs,
    dashboard_targets,
    declared_metric_names,
    input_series,
    promtool,
    rule_tests,
    runbook_anchors,
    runbook_sections,
)
from tests.test_gpu_promtool import everything_gpu
from tests.test_metrics_contract import all_families


class TestPromtool:
    """promtool accepts the rules, their unit tests pass, the scrape example is valid."""

    def test_check_rules(self) -> None:
        done = promtool("check", "rules", RULES)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "SUCCESS" in done.stdout

    @pytest.mark.parametrize("path", RULE_TEST_FILES, ids=lambda p: p.name)
    def test_rule_unit_tests(self, path: Path) -> None:
        done = promtool("test", "rules", path)
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
    """Every rule: a `for:`, labels severity and kind, annotations summary, description and
    runbook_url; a promtool case where it fires and one where it must not."""

    def test_every_alert_is_complete(self) -> None:
        rules = alert_rules()
        assert len(rules) >= 50
        assert set(rules) == set(alert_blocks(RULES.read_text()))
        for name, rule in rules.items():
            assert re.fullmatch(r"\d+[smh]", str(rule.get("for", ""))), name
            assert rule["labels"]["severity"] in SEVERITIES, name
            assert kind_of(rule), f"{name}: no kind label, neither its own nor its series'"
            for key in ("summary", "description", "runbook_url"):
                assert rule["annotations"].get(key), f"{name}: no {key}"

    def test_every_alert_has_firing_and_quiet_cases(self) -> None:
        firing: set[str] = set()
        quiet: set[str] = set()
        for case in rule_tests():
            for check in case.get("alert_rule_test", []):
                (firing if check["exp_alerts"] else quiet).add(check["alertname"])
        names = set(alert_rules())
        assert sorted(names - firing) == [], "no test where it fires"
        assert sorted(names - quiet) == [], "no test where it must not fire"
        assert firing | quiet <= names, "a test of an alert that does not exist"

    def test_a_static_kind_never_hides_the_kind_of_a_series(self) -> None:
        """A rule's labels replace its series' labels: two series that differ only in their own
        `kind` (outbox entries: events, metrics) would become one alert, an evaluation error."""
        with_kind = {f.name for f in all_families(Path("/nonexistent")) if "kind" in f.labels}
        for name, rule in alert_rules().items():
            static = rule["labels"].get("kind")
            expr = rule["expr"]
            for metric in set(METRIC.findall(expr)) & with_kind:
                if static is None:
                    continue
                pinned = re.search(rf'{metric}\{{[^}}]*kind="{static}"', expr)
                moved = re.search(r'"kind", "\(\.\*\)"\)', expr)
                assert pinned or moved, f"{name}: kind {static!r} would replace {metric}'s kind"


def kind_of(rule: dict[str, object]) -> str:
    """The rule's kind label, or where its series carry one (a kernel-log finding, a watcher
    alert): `from <metric>`."""
    labels = rule["labels"]
    assert isinstance(labels, dict)
    if labels.get("kind"):
        return str(labels["kind"])
    families = {f.name: f for f in all_families(Path("/nonexistent"))}
    expr = str(rule["expr"])
    carriers = [
        m
        for m in METRIC.findall(expr)
        if (m in families and "kind" in families[m].labels) or m == "gpuwarden_watch_alert_active"
    ]
    return f"from {carriers[0]}" if carriers else ""


class TestRunbook:
    """Every runbook_url is the placeholder base plus the anchor of a heading of
    docs/runbook.md; every section there belongs to an alert and agrees with its rule."""

    def test_every_runbook_url_is_a_heading(self) -> None:
        assert runbook_problems(RULES.read_text(), RUNBOOK.read_text()) == []

    def test_a_missing_section_or_a_wrong_fact_is_caught(self) -> None:
        text = RUNBOOK.read_text()
        without = text.replace("### GpuwardenGpuLost\n", "### Gpuwarden GPU lost\n")
        assert any("GpuwardenGpuLost" in p for p in runbook_problems(RULES.read_text(), without))
        wrong = text.replace(
            "`critical` · kind `gpu_lost` · repair action `reboot_node`",
            "`warning` · kind `gpu_lost` · repair action `reboot`",
        )
        problems = runbook_problems(RULES.read_text(), wrong)
        assert any("severity" in p for p in problems), problems
        assert any("'reboot'" in p for p in problems), problems


def runbook_problems(rules_text: str, runbook_text: str) -> list[str]:
    problems: list[str] = []
    rules = alert_rules(rules_text)
    anchors = runbook_anchors(runbook_text)
    sections = runbook_sections(runbook_text)
    actions = {a.value for a in RepairAction}
    for name, rule in rules.items():
        url = rule["annotations"]["runbook_url"]
        base, _, anchor = url.partition("#")
        if base != RUNBOOK_PLACEHOLDER or anchor != name.lower():
            problems.append(
                f"{name}: runbook_url {url!r} is not {RUNBOOK_PLACEHOLDER}#{name.lower()}"
            )
        if anchor not in anchors:
            problems.append(f"{name}: no heading of docs/runbook.md has the anchor #{anchor}")
        section = sections.get(name)
        if section is None:
            continue
        facts = section.strip().splitlines()[0]
        severity = re.match(r"`(\w+)`", facts)
        if severity is None or severity[1] != rule["labels"]["severity"]:
            problems.append(f"{name}: the section's severity is not {rule['labels']['severity']}")
        kind = rule["labels"].get("kind")
        if kind is not None and f"kind `{kind}`" not in facts:
            problems.append(f"{name}: the section does not give kind `{kind}`")
        if kind is None and "kind from" not in facts:
            problems.append(f"{name}: the section does not say where its kind comes from")
        named = re.findall(r"`([a-z_]+)`", facts.partition("repair action")[2])
        if not named:
            problems.append(f"{name}: the section names no repair action")
        problems += [f"{name}: {a!r} is not a repair action" for a in named if a not in actions]
    problems += [f"{s}: a section of no alert" for s in sections.keys() - rules.keys()]
    return problems


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


class TestDashboardGpu:
    """A `gpu` variable from a per-GPU series, used by every per-GPU query, and the panels the
    GPU-depth work is for (memory, processes, activity, PCIe, GPU count) with thresholds."""

    def families(self) -> dict[str, MetricFamily]:
        return {f.name: f for f in all_families(Path("/nonexistent"))}

    def test_the_gpu_variable_is_used_by_every_per_gpu_query(self) -> None:
        families = self.families()
        variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
        query = variables["gpu"]["query"]["query"]
        source = re.fullmatch(r"label_values\((gpuwarden_\w+)\{[^}]*\}, gpu\)", query)
        assert source is not None, query
        assert "gpu" in families[source[1]].labels
        unfiltered = [
            f"{title}: {name}{selector}"
            for _, title, expr in dashboard_targets()
            for name, selector in re.findall(r"(gpuwarden_[a-z0-9_]+)(\{[^}]*\})?", expr)
            if name in families and "gpu" in families[name].labels and 'gpu=~"$gpu"' not in selector
        ]
        assert unfiltered == []

    def test_gpu_health_panels_and_thresholds(self) -> None:
        # family -> whether its panel must draw thresholds (a limit an operator acts on)
        wanted = {
            "gpuwarden_gpu_memory_used_bytes": True,
            "gpuwarden_gpu_process_memory_used_bytes": False,
            "gpuwarden_gpu_activity_ratio": False,
            "gpuwarden_gpu_pcie_link_width_lanes": True,
            "gpuwarden_gpu_pcie_link_generation": True,
            "gpuwarden_gpu_pcie_replays_total": False,
            "gpuwarden_gpus_visible": True,
            "gpuwarden_gpus_expected": False,
            "gpuwarden_gpus_pci": False,
            "gpuwarden_gpu_temperature_threshold_celsius": True,
        }
        panels = dashboard()["panels"]
        for name, thresholds in wanted.items():
            using = [p for p in panels if any(name in t["expr"] for t in p.get("targets", []))]
            assert using, f"no panel shows {name}"
            if thresholds:
                steps = [
                    p["fieldConfig"]["defaults"].get("thresholds", {}).get("steps", [])
                    for p in using
                ]
                assert any(len(s) >= 2 for s in steps), f"no threshold on a panel of {name}"


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


class TestRuleTestSeries:
    """The rule tests feed series the agent really exports: each a family of the metrics
    contract with exactly its labels (and job, instance), and enumerated label values the code
    produces, so a rule cannot pass its test on a name or a value the agent never writes."""

    def test_names_and_label_names_are_the_contract(self) -> None:
        families = {f.name: f for f in all_families(Path("/nonexistent"))}
        declared = declared_metric_names()
        wrong = []
        for series in input_series():
            if series.name == "up" or series.name.startswith("gpuwarden_watch_"):
                # Prometheus' own, and the watcher's (its families are not the agent's: names only).
                assert series.name == "up" or series.name in declared, series
                continue
            family = families.get(series.name)
            expected = None if family is None else {*family.labels, "job", "instance"}
            if expected != set(series.labels):
                wrong.append(f"{series.case}: {series.name} {sorted(series.labels)}")
        assert wrong == []

    async def test_label_values_are_the_ones_the_agent_writes(self) -> None:
        produced = await values_of_a_full_round()
        produced[("gpuwarden_repair_required", "action")] = {a.value for a in RepairAction}
        produced[("gpuwarden_repair_required", "severity")] = {s.label for s in Severity}
        produced[("gpuwarden_events_total", "severity")] = {s.label for s in Severity}
        produced[("gpuwarden_kernel_log_findings_total", "kind")] = set(KINDS)
        checked = 0
        for series in input_series():
            for label, value in series.labels.items():
                known = produced.get((series.name, label))
                if known is None or label in GPU_LABELS:
                    continue
                checked += 1
                assert value in known, f"{series.case}: {series.name}{{{label}={value!r}}}"
        assert checked > 100


async def values_of_a_full_round() -> dict[tuple[str, str], set[str]]:
    """(family, label) -> the values a full fake GPU round writes, for the labels that name one
    of a fixed set (a threshold, a recovery action, a link's `which`): not free text."""
    fake = FakeNvml([everything_gpu(0), FakeGpu.h200(1)])
    rig = GpuRig(fake, settings=GpuSettings(event_thread=False))
    try:
        await rig.collect(advance=rig.settings.gpm_interval)
        collection = await rig.collect()
    finally:
        await rig.close()
    free_text = {"link", "pid", "process", "user", "unit", "container_id", "pod_uid", "driver"}
    values: dict[tuple[str, str], set[str]] = defaultdict(set)
    for sample in collection.samples:
        for label, value in sample.labels.items():
            if label not in free_text:
                values[(sample.family.name, label)].add(value)
    return values


class TestRepairRules:
    """The repair alerts split gpuwarden_repair_required as the Slurm drain does by default."""

    def test_required_is_what_slurm_drains_on(self) -> None:
        rule = alert_rules()["GpuwardenRepairRequired"]
        selector = re.search(r"gpuwarden_repair_required\{([^}]*)\}", rule["expr"])
        assert selector is not None
        actions = re.search(r'action=~"([a-z_|]+)"', selector[1])
        severities = re.search(r'severity=~"([a-z_|]+)"', selector[1])
        assert actions is not None and severities is not None
        assert sorted(actions[1].split("|")) == sorted(DRAIN_ACTIONS)
        least = SlurmSettings().severity
        assert set(severities[1].split("|")) == {s.label for s in Severity if s >= least}

    def test_every_held_action_alerts_but_investigate(self) -> None:
        advised = alert_rules()["GpuwardenRepairAdvised"]["expr"]
        left_out = set(re.findall(r'action!="([a-z_]+)"', advised))
        assert left_out == {RepairAction.INVESTIGATE.value}
        named = set(re.findall(r"\b[a-z]+(?:_[a-z]+)+\b", " ".join(DRAIN_ACTIONS)))
        assert named <= {a.value for a in RepairAction}
        assert {RepairAction.NONE, RepairAction.RESTART_APPLICATION} == NOT_HELD

    def test_investigate_pages_at_critical_only(self) -> None:
        """A held `investigate` has no remedy to queue, but at critical (a PCIe port that
        contained an error, a hard lockup) it must not pass unseen; below that it stays quiet."""
        rule = alert_rules()["GpuwardenCriticalToInvestigate"]
        selector = re.search(r"gpuwarden_repair_required\{([^}]*)\}", rule["expr"])
        assert selector is not None
        assert 'action="investigate"' in selector[1]
        severities = re.search(r'severity=~"([a-z_|]+)"', selector[1])
        assert severities is not None
        assert set(severities[1].split("|")) == {
            s.label for s in Severity if s >= Severity.CRITICAL
        }
