"""No GPU alert while a node's GPUs are paused (`gpuwarden pause`), for every rule on GPU series.

The class: a rule reads a GPU series (a family of the gpu or benchmark collector, or any family
labelled `gpu`) -> it is silenced by `gpuwarden_gpu_paused == 1` of its own node. Checked two
ways: each such rule carries the guard, and every case of the rules' unit tests in which such
an alert fires is run again by promtool with the node paused, and must be silent.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml

from tests.support.rules import METRIC, RULE_TEST_FILES, RULE_TESTS, RULES, promtool
from tests.test_metrics_contract import all_families

GUARD = "unless on (job, instance) gpuwarden_gpu_paused == 1"
PAUSE_TESTS = RULE_TESTS.parent / "gpuwarden-pause.test.yml"
GPU_COLLECTORS = ("gpuwarden_gpu", "gpuwarden_nvml", "gpuwarden_benchmark")


def gpu_series(tmp_path: Path) -> set[str]:
    """Every GPU series name the agent exports (counters with their _total)."""
    names: set[str] = set()
    for family in all_families(tmp_path):
        if family.name == "gpuwarden_gpu_paused" or family.name.startswith("gpuwarden_gpu_pause_"):
            continue  # the guard itself
        if "gpu" in family.labels or family.name.startswith(GPU_COLLECTORS):
            names |= {family.name, f"{family.name}_total"}
    return names


def gpu_alerts(tmp_path: Path) -> dict[str, str]:
    """alert -> its expr, for the alerts that read a GPU series."""
    series = gpu_series(tmp_path)
    out = {}
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            expr = str(rule["expr"])
            if "alert" in rule and set(METRIC.findall(expr)) & series:
                out[rule["alert"]] = expr
    return out


def test_every_gpu_alert_is_silenced_while_paused(tmp_path: Path) -> None:
    alerts = gpu_alerts(tmp_path)
    assert {"GpuwardenGpuLost", "GpuwardenNvmlDown", "GpuwardenCriticalXid"} <= set(alerts)
    unguarded = sorted(n for n, expr in alerts.items() if not expr.strip().endswith(GUARD))
    assert not unguarded, f"GPU alerts that would fire during a pause: {unguarded}"


def _instances(case: dict[str, Any]) -> set[tuple[str, str]]:
    out = set()
    for item in case.get("input_series", []):
        job = re.search(r'job="([^"]*)"', item["series"])
        instance = re.search(r'instance="([^"]*)"', item["series"])
        if job and instance:
            out.add((job.group(1), instance.group(1)))
    return out


_UNIT = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def _seconds(duration: str) -> float:
    """A Prometheus duration (`1d2h`, `90s`) in seconds."""
    parts = re.findall(r"(\d+)(ms|[smhdwy])", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(int(n) * _UNIT[u] for n, u in parts)


def paused_variants(alerts: set[str]) -> list[dict[str, Any]]:
    """Each unit-test case where a GPU alert fires, with its nodes paused throughout and only
    the GPU alerts' checks, expecting none."""
    cases = [c for f in RULE_TEST_FILES for c in yaml.safe_load(f.read_text())["tests"]]
    variants = []
    for case in cases:
        checks = [
            {**check, "exp_alerts": []}
            for check in case.get("alert_rule_test", [])
            if check["alertname"] in alerts and check.get("exp_alerts")
        ]
        if not checks:
            continue
        paused = copy.deepcopy(case)
        # Paused at every evaluation the case makes, whatever its interval.
        last = max(_seconds(str(c["eval_time"])) for c in checks)
        steps = int(last / _seconds(str(case.get("interval", "1m")))) + 2
        paused["name"] = f"{case['name']} (paused)"
        paused["input_series"] += [
            {
                "series": f'gpuwarden_gpu_paused{{job="{job}",instance="{instance}"}}',
                "values": f"1x{steps}",
            }
            for job, instance in sorted(_instances(case))
        ]
        paused["alert_rule_test"] = checks
        paused.pop("promql_expr_test", None)
        variants.append(paused)
    return variants


def test_every_firing_case_is_silent_while_paused(tmp_path: Path) -> None:
    alerts = set(gpu_alerts(tmp_path))
    variants = paused_variants(alerts)
    fired = {c["alertname"] for v in variants for c in v["alert_rule_test"]}
    assert fired == alerts, sorted(alerts - fired)  # a firing case for each GPU alert
    suite = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": variants,
    }
    path = tmp_path / "paused.test.yml"
    path.write_text(yaml.safe_dump(suite, sort_keys=False))
    done = promtool("test", "rules", path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_the_pause_rule_tests(tmp_path: Path) -> None:
    done = promtool("test", "rules", PAUSE_TESTS)
    assert done.returncode == 0, done.stdout + done.stderr


def test_without_the_guard_the_paused_cases_would_fire(tmp_path: Path) -> None:
    """The variants can fail: the same cases against the rules without their guard."""
    bare = tmp_path / "rules.yml"
    bare.write_text(RULES.read_text().replace(GUARD, ""))
    variants = paused_variants(set(gpu_alerts(tmp_path)))[:3]  # a few are proof enough
    suite = {"rule_files": [str(bare)], "evaluation_interval": "1m", "tests": variants}
    path = tmp_path / "paused.test.yml"
    path.write_text(yaml.safe_dump(suite, sort_keys=False))
    assert promtool("test", "rules", path).returncode != 0
