"""Every event the agent raises says what must be done, as data: each `Event(...)` written in
collectors/, exporters/ and agent/ passes `repair_action` (a new kind without one fails here),
and every bucket and recovery action of the Xid catalog maps to a repair action."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from agent.contracts.model import Event, RepairAction, Severity
from collectors import _repair
from collectors._xid_catalog import BUCKETS, catalog, lookup_event

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("agent", "collectors", "exporters")


def _event_calls() -> list[tuple[str, int, ast.Call]]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id == "Event"
                ):
                    found.append((str(path.relative_to(ROOT)), node.lineno, node))
    return found


def test_the_scan_finds_the_event_sites() -> None:
    # The class of problem is "an event without a repair action"; the scan must see them all.
    files = {f for f, _, _ in _event_calls()}
    assert {"collectors/_xid.py", "collectors/gpu/collector.py", "agent/runtime/core.py"} <= files
    assert len(_event_calls()) >= 40


def test_every_event_site_names_its_repair_action() -> None:
    missing = [
        f"{f}:{line}"
        for f, line, call in _event_calls()
        if not any(k.arg == "repair_action" for k in call.keywords)
    ]
    assert missing == []


def test_every_catalog_bucket_and_recovery_action_maps() -> None:
    _repair.check_mapping()
    assert set(_repair.BUCKET_REPAIR) == set(BUCKETS)
    names = {a.name.lower() for a in catalog().recovery_actions.values()}
    assert names == set(_repair.RECOVERY_REPAIR)


@pytest.mark.parametrize(
    ("code", "text", "expected"),
    [
        (79, "pid=1, GPU has fallen off the bus.", RepairAction.REBOOT_NODE),
        (31, "pid=1, name=python, Ch 00000008, MMU Fault", RepairAction.RESTART_APPLICATION),
        (48, "An uncorrectable double bit error", RepairAction.RESET_GPU),
        (149, "NETIR_LINK_EVT  Fatal   XC0 i0 Link 01", RepairAction.RESET_GPU),
        (149, "NETIR_LINK_EVT  Nonfatal XC0 i0 Link 01", RepairAction.INVESTIGATE),
        (
            154,
            "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)",
            RepairAction.REBOOT_NODE,
        ),
        (
            154,
            "GPU recovery action changed from 0x0 (None) to 0x4 (Drain and Reset)",
            RepairAction.DRAIN_AND_RESET,
        ),
        (
            154,
            "GPU recovery action changed from 0x2 (Node Reboot Required) to 0x0 (None)",
            RepairAction.NONE,
        ),
    ],
)
def test_a_line_gets_its_repair(code: int, text: str, expected: RepairAction) -> None:
    assert _repair.repair_for(lookup_event(code, text)) is expected


def test_recovery_to_none_clears_the_gpu() -> None:
    cleared = lookup_event(154, "changed from 0x2 (Node Reboot Required) to 0x0 (None)")
    assert _repair.clears_for(cleared) == ("*",)
    raised = lookup_event(154, "changed from 0x0 (None) to 0x1 (GPU Reset Required)")
    assert _repair.clears_for(raised) == ()


def test_old_payloads_without_repair_action_still_read() -> None:
    new = Event(
        "gpu", "xid", Severity.CRITICAL, "m", repair_action=RepairAction.RESET_GPU, clears=("a",)
    )
    data = new.to_dict()
    assert data["repair_action"] == "reset_gpu"
    assert Event.from_dict(data) == new
    old = {k: v for k, v in data.items() if k not in ("repair_action", "clears")}
    assert Event.from_dict(old).repair_action is RepairAction.NONE
    assert Event.from_dict(old).clears == ()


def test_every_host_kind_of_the_kernel_log_has_a_repair() -> None:
    from collectors.kernel_log import host

    # decided by the record's severity
    per_record = {"machine_check", "memory_error", "hardware_error"}
    assert set(host.HOST_KINDS) == set(host.HOST_REPAIR) | per_record
    assert host._hardware_repair(Severity.CRITICAL) is RepairAction.HARDWARE_INSPECTION
    assert host._hardware_repair(Severity.WARNING) is RepairAction.INVESTIGATE


def test_scan_json_names_the_repair_of_each_finding(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    log = tmp_path / "kern.log"
    log.write_text(
        "4,1,1,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus.\n"
        "4,2,2,-;NVRM: Xid (PCI:0000:86:00): 31, pid=4411, name=train.py, Ch 00000008, "
        "MMU Fault\n"
        "3,3,3,-;I/O error, dev sdb, sector 2048 op 0x1:(WRITE) flags 0x800 phys_seg 1 prio "
        "class 2\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "agent", "scan", "--json", str(log)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    found = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(f["kind"], f["repair_action"]) for f in found] == [
        ("xid", "reboot_node"),
        ("xid", "restart_application"),
        ("io_error", "check_storage"),
    ]


async def test_check_json_names_the_repair_of_each_finding(tmp_path: Path) -> None:
    from agent.program.diagnose.check import CheckOptions, run_check
    from tests.support.diag import load, make_proc_tree, write_config

    saved = ROOT / "tests" / "fixtures" / "kernel_log" / "kmsg.txt"
    extra = f'[collectors.kernel_log]\npath = "{saved}"\n'
    cfg = load(write_config(tmp_path, proc_root=make_proc_tree(tmp_path / "proc"), extra=extra))
    report = await run_check(cfg, CheckOptions(torch=False, expect_gpus=0, process_gap=0.05))
    findings = report.to_dict()["findings"]
    assert all("repair_action" in f for f in findings)
    xid79 = [f for f in findings if f["area"] == "kernel" and f["name"].startswith("Xid 79")]
    assert [f["repair_action"] for f in xid79] == ["reboot_node"]
