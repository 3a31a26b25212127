"""The GPU round benches run to the end on the fake NVML and print every row they promise:
the issue's speed goals are read from them on the H200, so they must not rot here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(script: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--fake", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_gpu_round_prints_the_round_awaited_bare_and_the_ratio() -> None:
    out = run("gpu_round.py", "--runs", "20", "--paced", "0", "--fake-gpus", "2")
    for row in (
        "gpu round, steady (fast reads)",
        "the same, answers awaited",
        "bare pynvml, the same",
        "gpu round, GPM due",
        "gpu round, full (static + slow)",
        "median over batches of (steady round / bare calls)",
        "hand-off and back, the collector's caller",
        "nvidia-smi: absent on this host",
    ):
        assert row in out, row


def test_gpu_handoff_prints_each_way_and_the_phases() -> None:
    out = run("gpu_handoff.py", "--runs", "30", "--paced", "0")
    for row in (
        "the agent's (waits in place <= 2 ms)",
        "answers awaited through the loop",
        "inline (no hand-off: the floor)",
        "bare pynvml, the same",
        "calls start -> read starts in the pool thread",
        "answer -> round end (samples, checks)",
    ):
        assert row in out, row
    phases = [line for line in out.splitlines() if line.endswith(" us")]
    assert len(phases) == 5 and all(float(line.split()[-2]) > 0 for line in phases), phases
