"""The alert rules over the kernel-log counters, across a restart of the agent (promtool).

What a scrape sees of a counter around an agent's kill -9 and restart (one scrape missed while
it was down): the rules' two branches (`increase()`, and a series that is new on a target that
was up) must fire for a finding that was stored but never scraped, and must not fire for a
restart that found nothing new. The agent's side (the counter carried at the count it had:
tests/test_kernel_log_counts_restart.py) gives the "carried" shapes; the "from zero" shapes
are what the agent gave before, in which the finding never reaches the rule.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.support.rules import alert_rules, promtool

TARGET = 'job="gpuwarden", instance="n1:9400"'
XID = f'gpuwarden_xid_errors_total{{{TARGET}, gpu="0", uuid="GPU-1", pci_bus_id="0000:3b:00.0", model="H200", xid="79"}}'
STORAGE = f'gpuwarden_kernel_log_findings_total{{{TARGET}, kind="io_error"}}'
OOM = f'gpuwarden_kernel_log_findings_total{{{TARGET}, kind="oom_kill"}}'
UP = f"up{{{TARGET}}}"
UP_VALUES = "1x19 0 1x10"
"""Scraped every minute; down at 20m (killed), up again from 21m."""

CASES = [
    # (case, alert, series, its values, fires at 22m)
    # Stored, killed before the scrape: the count the agent had is the one it comes back with.
    ("first xid, carried", "GpuwardenCriticalXid", XID, "_x20 1x10", True),
    ("another xid, carried", "GpuwardenCriticalXid", XID, "2x19 _ 3x10", True),
    ("io error, carried", "GpuwardenKernelStorageErrors", STORAGE, "0x19 _ 1x10", True),
    ("io storm, carried", "GpuwardenKernelStorageErrors", STORAGE, "7x19 _ 12x10", True),
    ("oom kill, carried", "GpuwardenOomKills", OOM, "0x19 _ 1x10", True),
    # A restart that found nothing: no page.
    ("xid, nothing new", "GpuwardenCriticalXid", XID, "2x19 _ 2x10", False),
    ("io error, nothing new", "GpuwardenKernelStorageErrors", STORAGE, "4x19 _ 4x10", False),
    # Before: counted from zero, the stored finding never shows.
    ("first xid, from zero", "GpuwardenCriticalXid", XID, "_x31", False),
    ("io error, from zero", "GpuwardenKernelStorageErrors", STORAGE, "0x19 _ 0x10", False),
    ("oom kill, from zero", "GpuwardenOomKills", OOM, "3x19 _ 0x10", False),
    # Why the count must be exact: one that came back lower reads as a reset, and pages.
    ("io errors, came back lower", "GpuwardenKernelStorageErrors", STORAGE, "9x19 _ 2x10", True),
]


@pytest.mark.parametrize(
    ("alert", "series", "values", "fires"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_the_rule_across_a_restart(
    tmp_path: Path, alert: str, series: str, values: str, fires: bool
) -> None:
    expr = alert_rules()[alert]["expr"]
    test = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {"series": UP, "values": UP_VALUES},
                    {"series": series, "values": values},
                ],
                "promql_expr_test": [
                    {
                        "expr": f"count({expr})",
                        "eval_time": "22m",
                        "exp_samples": [{"labels": "{}", "value": 1}] if fires else [],
                    }
                ],
            }
        ],
    }
    path = tmp_path / "restart.test.yml"
    path.write_text(yaml.safe_dump(test))
    result = promtool("test", "rules", path)
    assert result.returncode == 0, result.stdout + result.stderr
