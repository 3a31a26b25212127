"""Randomized faults over the real agent and a real broker: what the node sees is delivered.

A seeded schedule (tests/support/chaos.py) of NVML Xids, kernel-log Xid lines and their twins,
kill -9 and SIGTERM restarts, SIGHUPs (the same file, a changed interval, a broken value), the
broker stopped and started or hung (SIGSTOP), the state disk (a real tmpfs) filled and freed,
and waits; then everything healed and the invariants checked (the module's docstring there).
A failure prints its seed and schedule; the same seed draws the same schedule again:
`GPUWARDEN_CHAOS_SEEDS=7,8 pytest tests/test_chaos.py`, or many seeds and longer schedules
with `python scripts/chaos.py`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.chaos import Chaos, env_seeds, report

SEEDS = env_seeds([1, 2])
STEPS = int(os.environ.get("GPUWARDEN_CHAOS_STEPS", "10"))


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_what_the_node_sees_is_delivered_whatever_happens(tmp_path: Path, seed: int) -> None:
    chaos = Chaos(seed, tmp_path)
    violations = chaos.run(STEPS)
    assert not violations, report(chaos)
