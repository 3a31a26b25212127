"""Slurm drain and resume against a real one-node Slurm (slurmctld, slurmd, munged started
here on free loopback ports, tests/support/slurm.py) and a real agent process following a
kernel-log file: an Xid line appended to the file is what drains the node."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.agent_proc import REPO, AgentProcess, http_get, run_gpuwarden
from tests.support.slurm import SlurmCluster, cluster, missing_binaries, settle, wait_drained
from tests.support.waiting import wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        bool(missing_binaries()),
        reason=f"Slurm or munge not installed (make debs): {missing_binaries()}",
    ),
]

SAVED = REPO / "tests" / "fixtures" / "kernel_log" / "kmsg.txt"
XID79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=2314, name=python3, GPU has fallen off the bus."
XID31 = (
    "NVRM: Xid (PCI:0000:86:00): 31, pid=4411, name=train.py, Ch 00000008, intr 00000000. "
    "MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f_00000000. Fault is of type "
    "FAULT_PDE ACCESS_TYPE_VIRT_READ"
)
RECOVERED = (
    "NVRM: Xid (PCI:0000:3b:00): 154, GPU recovery action changed from 0x2 "
    "(Node Reboot Required) to 0x0 (None)"
)


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    yield from cluster(tmp_path_factory.mktemp("slurm"))


@pytest.fixture
def node(slurm: SlurmCluster) -> Iterator[SlurmCluster]:
    slurm.stop_health_checks()
    slurm.resume()
    yield slurm
    slurm.stop_health_checks()
    slurm.resume()


class KernelLog:
    """A kernel-log file the agent follows; lines are appended as raw /dev/kmsg records."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seq = 100
        path.write_text("")

    def append(self, message: str) -> None:
        self.seq += 1
        with self.path.open("a") as handle:
            handle.write(f"4,{self.seq},{self.seq * 1000},-;{message}\n")


def start_agent(
    tmp_path: Path, slurm: SlurmCluster, resume: str, scontrol: Path | None = None
) -> tuple[AgentProcess, KernelLog]:
    log = KernelLog(tmp_path / "kern.log")
    boot = tmp_path / "boot_id"
    boot.write_text("11111111-2222-3333-4444-555555555555\n")
    off = "".join(
        f"[collectors.{name}]\nenabled = false\n"
        for name in ("gpu", "disk", "processes", "system", "benchmark")
    )
    agent = AgentProcess(
        tmp_path / "agent",
        config_text=off
        + f'[collectors.kernel_log]\npath = "{log.path}"\nboot_id_path = "{boot}"\n'
        + "interval = 0.2\n"
        + f'[actions.slurm]\nenabled = true\nnode_name = "{slurm.node}"\n'
        + f'scontrol = "{scontrol or slurm.scontrol}"\nresume = "{resume}"\n'
        + "retry_initial = 0.2\nretry_max = 0.5\n",
    )
    return agent.start(), log


def metric(agent: AgentProcess, pattern: str) -> list[str]:
    _, body = http_get(agent.metrics_url)
    return [line for line in body.splitlines() if re.search(pattern, line)]


def xid_events(agent: AgentProcess) -> float:
    lines = metric(agent, r'^gpuwarden_events_total\{.*kind="xid"')
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def test_an_xid_79_drains_the_node_naming_it(node: SlurmCluster, tmp_path: Path) -> None:
    agent, log = start_agent(tmp_path, node, resume="never")
    try:
        log.append(XID79)
        reason = wait_drained(node)
        assert reason.startswith("gpuwarden: Xid 79")
        assert "reboot_node" in reason
        assert metric(agent, r'^gpuwarden_repair_required\{action="reboot_node"')
        assert metric(agent, r'^gpuwarden_slurm_drained\{node="[^"]+"\} 1')
    finally:
        agent.stop()


def test_an_application_xid_does_not_drain(node: SlurmCluster, tmp_path: Path) -> None:
    agent, log = start_agent(tmp_path, node, resume="never")
    try:
        log.append(XID31)
        wait_until(lambda: xid_events(agent) >= 1, 30, "the Xid 31 event")
        settle(1.0)  # the action had its chance to (wrongly) drain
        assert not node.drained(), node.reasons()
        assert metric(agent, r'^gpuwarden_slurm_operations_total\{operation="drain"') == []
    finally:
        agent.stop()


def gpuwarden(agent: AgentProcess, *args: str) -> None:
    done = run_gpuwarden(*args, "--config", str(agent.config_path))
    assert done.returncode == 0, done.stdout + done.stderr


def test_an_xid_79_of_a_paused_reset_does_not_drain(node: SlurmCluster, tmp_path: Path) -> None:
    """`gpuwarden pause`, then the reset logs an Xid 79: the node stays in service; the same
    Xid after `gpuwarden resume` (the GPU came back broken) drains it (docs/pause.md)."""
    agent, log = start_agent(tmp_path, node, resume="never")
    try:
        gpuwarden(agent, "pause", "--for", "10m", "--reason", "nvidia-smi -r")
        log.append(XID79)
        wait_until(lambda: xid_events(agent) >= 1, 30, "the Xid 79 event")
        settle(1.0)  # the action had its chance to (wrongly) drain
        assert not node.drained(), node.reasons()
        assert metric(agent, r"^gpuwarden_repair_required\{") == []
        assert metric(agent, r'^gpuwarden_kernel_log_paused_findings_total\{kind="xid"\} 1')
        gpuwarden(agent, "resume")
        log.append(XID79)
        assert "Xid 79" in wait_drained(node)
    finally:
        agent.stop()


def test_when_cleared_resumes_the_node_it_drained(node: SlurmCluster, tmp_path: Path) -> None:
    agent, log = start_agent(tmp_path, node, resume="when_cleared")
    try:
        log.append(XID79)
        assert "Xid 79" in wait_drained(node)
        log.append(RECOVERED)  # the GPU needs no recovery action any more
        wait_until(lambda: not node.drained(), 30, "the node to be resumed")
        assert metric(agent, r"^gpuwarden_repair_required\{") == []
    finally:
        agent.stop()


def test_a_person_clears_what_has_no_all_clear_and_the_node_resumes(
    node: SlurmCluster, tmp_path: Path
) -> None:
    """`gpuwarden repairs clear`: the GPU behind an Xid 79 was replaced (no line of the log
    will ever take it back); the person says so, and the node it drained is resumed."""
    agent, log = start_agent(tmp_path, node, resume="when_cleared")
    try:
        log.append(XID79)
        assert "Xid 79" in wait_drained(node)
        listed = run_gpuwarden("repairs", "--json", "--config", str(agent.config_path))
        assert listed.returncode == 0, listed.stderr
        (held,) = json.loads(listed.stdout)["repairs"]
        assert (held["action"], held["kind"]) == ("reboot_node", "xid")
        done = run_gpuwarden(
            "repairs",
            "clear",
            "--subject",
            held["subject"],
            "--reason",
            "GPU replaced, RMA 1234",
            "--config",
            str(agent.config_path),
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.startswith("cleared: reboot_node for ")
        wait_until(lambda: not node.drained(), 30, "the node to be resumed")
        assert metric(agent, r"^gpuwarden_repair_required\{") == []
        assert metric(agent, r'^gpuwarden_events_total\{.*kind="repair_cleared"')
    finally:
        agent.stop()


def test_a_node_a_person_drained_is_never_resumed(node: SlurmCluster, tmp_path: Path) -> None:
    node.drain("maintenance: new PSU")
    agent, log = start_agent(tmp_path, node, resume="when_cleared")
    try:
        log.append(XID79)
        wait_until(lambda: xid_events(agent) >= 1, 30, "the Xid 79 event")
        log.append(RECOVERED)
        wait_until(lambda: xid_events(agent) >= 2, 30, "the Xid 154 event")
        settle(1.0)
        assert node.drained()
        assert node.reason() == "maintenance: new PSU"  # neither taken over nor resumed
    finally:
        agent.stop()


def test_a_person_redraining_with_their_reason_keeps_it(node: SlurmCluster, tmp_path: Path) -> None:
    agent, log = start_agent(tmp_path, node, resume="when_cleared")
    try:
        log.append(XID79)
        wait_drained(node)
        node.drain("replacing GPU 3")  # a person takes the drain over
        log.append(RECOVERED)
        wait_until(lambda: xid_events(agent) >= 2, 30, "the Xid 154 event")
        settle(1.0)
        assert node.drained()
        assert node.reason() == "replacing GPU 3"
    finally:
        agent.stop()


def test_check_as_health_check_program_drains_a_failing_node(node: SlurmCluster) -> None:
    # The saved log has an Xid 79: check FAILs, and slurmd's HealthCheckProgram (every 2 s)
    # runs `gpuwarden check --slurm`, which drains the node with a one-line reason.
    node.health_config.parent.mkdir(parents=True, exist_ok=True)
    node.health_config.write_text(
        f'node_id = "hc"\nstate_dir = "{node.health_config.parent / "state"}"\n'
        f'[prometheus]\nenabled = false\n[collectors.kernel_log]\npath = "{SAVED}"\n'
        f'[actions.slurm]\nnode_name = "{node.node}"\nscontrol = "{node.scontrol}"\n'
    )
    node.health_flag.touch()
    reason = wait_drained(node, 90)
    assert reason.startswith("gpuwarden: check: ")
    assert "Xid 79" in reason


def test_check_slurm_prints_one_line_and_exits_as_check(node: SlurmCluster, tmp_path: Path) -> None:
    config = tmp_path / "gpuwarden.toml"
    config.write_text(
        f'node_id = "hc"\nstate_dir = "{tmp_path / "state"}"\n[prometheus]\nenabled = false\n'
        f'[collectors.kernel_log]\npath = "{SAVED}"\n[actions.slurm]\n'
        f'node_name = "{node.node}"\nscontrol = "{node.scontrol}"\nresume = "when_cleared"\n'
    )
    argv = [sys.executable, "-m", "agent", "check", "--slurm", "--no-torch"]
    argv += ["--expect-gpus", "0", "--config", str(config)]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("gpuwarden: check: ")
    assert node.drained()
    assert node.reason().startswith("gpuwarden: check: ")
    # A passing check resumes what check drained (resume = when_cleared): an empty log.
    (tmp_path / "empty.log").write_text("")
    config.write_text(config.read_text().replace(str(SAVED), str(tmp_path / "empty.log")))
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode in (0, 1), done.stdout + done.stderr
    assert "resumed" in done.stdout
    wait_until(lambda: not node.drained(), 20, "the node to be resumed")


def test_a_failing_scontrol_is_retried_and_reported_once(
    node: SlurmCluster, tmp_path: Path
) -> None:
    # The controller cannot be reached for the first three runs (as when slurmctld restarts).
    calls = tmp_path / "calls"
    flaky = tmp_path / "scontrol"
    flaky.write_text(
        "#!/bin/sh\n"
        f'echo x >> "{calls}"\n'
        f'if [ "$(wc -l < "{calls}")" -le 3 ]; then\n'
        '  echo "slurm_load_node error: Unable to contact slurm controller" >&2; exit 1\n'
        "fi\n"
        f'exec "{node.scontrol}" "$@"\n'
    )
    flaky.chmod(0o755)
    agent, log = start_agent(tmp_path, node, resume="never", scontrol=flaky)
    try:
        log.append(XID79)
        assert "Xid 79" in wait_drained(node)
        failed = metric(
            agent, r'^gpuwarden_slurm_operations_total\{operation="show",outcome="failed"'
        )
        assert failed and float(failed[0].rsplit(" ", 1)[1]) == 3
        reported = metric(agent, r'^gpuwarden_events_total\{.*kind="slurm_action_failed"')
        assert len(reported) == 1
        assert reported[0].endswith(" 1.0") or reported[0].endswith(" 1")
    finally:
        agent.stop()
