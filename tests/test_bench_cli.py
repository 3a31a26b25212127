"""`gpuwarden bench`: one run now, the history, and importing the field guide's file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from collectors.benchmark.child import PLANT_WRONG_RESULT_ENV
from tests.test_bench_history import GUIDE_LINE

REPO = Path(__file__).resolve().parents[1]


def bench(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None, config: str = ""
) -> subprocess.CompletedProcess[str]:
    config_path = tmp_path / "gpuwarden.toml"
    config_path.write_text(
        f'state_dir = "{tmp_path / "state"}"\n[collectors.benchmark]\n'
        f"iterations = 2\nwarmup = 1\nsamples = 2\nmin_window_seconds = 0.0\n" + config
    )
    return subprocess.run(
        [sys.executable, "-m", "agent.program.cli", "bench", "--config", str(config_path), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
    )


class TestRunNow:
    """A run on the CPU prints the record, appends it to the history, and sets the exit code."""

    def test_json_record_then_history(self, tmp_path: Path) -> None:
        done = bench(tmp_path, "--device", "cpu", "--size", "128", "--json")
        assert done.returncode == 0, done.stderr
        lines = done.stdout.strip().splitlines()
        assert len(lines) == 1
        record = json.loads(lines[0])
        assert record["size"] == 128
        assert record["correct"] is True
        assert record["source"] == "cli"
        assert record["estimated_tflops"] > 0
        shown = bench(tmp_path, "--history")
        assert shown.returncode == 0
        assert "cpu" in shown.stdout
        assert " 128 " in shown.stdout
        as_json = bench(tmp_path, "--history", "--json")
        assert json.loads(as_json.stdout)["median_seconds"] == record["median_seconds"]

    def test_wrong_result_exits_3_with_the_critical_finding(self, tmp_path: Path) -> None:
        done = bench(
            tmp_path,
            "--device",
            "cpu",
            "--dtype",
            "bfloat16",
            "--size",
            "128",
            env={PLANT_WRONG_RESULT_ENV: "1"},
        )
        assert done.returncode == 3, done.stderr
        assert "WRONG RESULT" in done.stdout
        assert "CRITICAL" in done.stdout
        assert "bf16" in done.stdout

    def test_no_gpu_exits_1(self, tmp_path: Path) -> None:
        done = bench(tmp_path)
        assert done.returncode == 1
        assert "no GPU" in done.stderr

    def test_size_outside_profile_is_a_usage_error(self, tmp_path: Path) -> None:
        done = bench(tmp_path, "--device", "cpu", "--size", "9000")
        assert done.returncode == 2
        assert "size" in done.stderr


class TestImport:
    """A gpu_benchmark.jsonl from the field guide's script joins the history."""

    def test_import_with_uuid_skips_duplicates_and_reports_bad_lines(self, tmp_path: Path) -> None:
        guide = tmp_path / "gpu_benchmark.jsonl"
        second = GUIDE_LINE.replace("10:00:00Z", "11:00:00Z")
        guide.write_text(f"{GUIDE_LINE}\n{second}\nTraceback (most recent call last):\n")
        done = bench(tmp_path, "--import", str(guide), "--gpu-uuid", "GPU-1234")
        assert done.returncode == 1  # one line was not a record
        assert "imported 2 run(s)" in done.stdout
        assert "line 3 skipped" in done.stderr
        again = bench(tmp_path, "--import", str(guide))
        assert "imported 0 run(s)" in again.stdout
        saved = [
            json.loads(line)
            for line in (tmp_path / "state" / "benchmark-history.jsonl").read_text().splitlines()
        ]
        assert [r["gpu_uuid"] for r in saved] == ["GPU-1234", "GPU-1234"]
        assert {r["source"] for r in saved} == {"import"}
        shown = bench(tmp_path, "--history")
        assert "GPU-1234" in shown.stdout
        assert "burst" in shown.stdout
