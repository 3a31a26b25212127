"""Seconds from a finding to a drained Slurm node, side by side: the agent's own drain (an Xid
79 line appended to the kernel log it follows) against `gpuwarden check --slurm` as slurmd's
HealthCheckProgram (HealthCheckInterval=2 here; 300 s is common in production, and the check's
wait adds to it), and from the all-clear (Xid 154 to None) to the resume.

A real one-node Slurm (munged, slurmctld, slurmd on free loopback ports, tests/support/slurm.py)
and a real agent process (an Xid is an event at first sight, the reader woken by the append).

    python bench/slurm_drain.py [--runs 3]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.slurm import SlurmCluster, cluster, missing_binaries
from tests.support.waiting import wait_until
from tests.test_actions_slurm import RECOVERED, SAVED, XID79, start_agent


def timed(action: Callable[[], object], done: Callable[[], bool], timeout: float = 120.0) -> float:
    began = time.monotonic()
    action()
    wait_until(done, timeout)
    return time.monotonic() - began


def agent_runs(slurm: SlurmCluster, work: Path, runs: int) -> tuple[list[float], list[float]]:
    drains, resumes = [], []
    for n in range(runs):
        slurm.resume()
        (work / f"agent{n}").mkdir()
        agent, log = start_agent(work / f"agent{n}", slurm, resume="when_cleared")
        try:
            drains.append(timed(functools.partial(log.append, XID79), slurm.drained))
            resumes.append(timed(functools.partial(log.append, RECOVERED), slurm.undrained))
        finally:
            agent.stop()
    return drains, resumes


def health_check_runs(slurm: SlurmCluster, runs: int) -> list[float]:
    slurm.health_config.parent.mkdir(parents=True, exist_ok=True)
    slurm.health_config.write_text(
        f'node_id = "hc"\nstate_dir = "{slurm.health_config.parent / "state"}"\n'
        f'[prometheus]\nenabled = false\n[collectors.kernel_log]\npath = "{SAVED}"\n'
        f'[actions.slurm]\nnode_name = "{slurm.node}"\nscontrol = "{slurm.scontrol}"\n'
    )
    out = []
    for _ in range(runs):
        slurm.stop_health_checks()
        slurm.resume()
        out.append(timed(slurm.health_flag.touch, slurm.drained))
    slurm.stop_health_checks()
    slurm.resume()
    return out


def row(name: str, values: list[float]) -> str:
    return f"{name:<46} {statistics.median(values):>8.2f} {min(values):>8.2f} {max(values):>8.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    if missing_binaries():
        print(f"needs Slurm and munge (make debs): missing {missing_binaries()}")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for slurm in cluster(work / "slurm"):
            drains, resumes = agent_runs(slurm, work, args.runs)
            checks = health_check_runs(slurm, args.runs)
    print(f"{'seconds, ' + str(args.runs) + ' runs':<46} {'median':>8} {'min':>8} {'max':>8}")
    print(row("agent: Xid 79 appended -> node drained", drains))
    print(row("agent: Xid 154 to None -> node resumed", resumes))
    print(row("HealthCheckProgram (interval 2 s) -> drained", checks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
