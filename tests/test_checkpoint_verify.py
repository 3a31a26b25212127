"""`gpuwarden checkpoint verify`, run as a person runs it: a child process on real files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.checkpoints import HOUR, age, write_hf, write_sidecar, write_torch


def verify(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent", "checkpoint", "verify", "--gap", "0.2", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


class TestVerify:
    def test_all_complete_exit_0_and_names_the_restart_point(self, tmp_path: Path) -> None:
        write_hf(tmp_path / "checkpoint-100", step=100)
        write_hf(tmp_path / "checkpoint-200", step=200)
        age(tmp_path / "checkpoint-100", 2 * HOUR)
        age(tmp_path / "checkpoint-200", HOUR)
        done = verify(tmp_path, "--json")
        assert done.returncode == 0, done.stdout + done.stderr
        data = json.loads(done.stdout)["paths"][str(tmp_path)]
        assert data["restart_from"]["name"] == "checkpoint-200"
        assert data["restart_from"]["step"] == 200
        table = verify(tmp_path)
        assert table.returncode == 0
        assert f"restart from: {tmp_path / 'checkpoint-200'}" in table.stdout

    def test_corrupt_newest_exit_2_and_the_older_is_the_restart_point(self, tmp_path: Path) -> None:
        good = write_torch(tmp_path / "step_1.pt")
        bad = write_torch(tmp_path / "step_2.pt")
        write_sidecar(bad, "f" * 64)
        age(good, 2 * HOUR)
        age(bad, HOUR)
        done = verify(tmp_path, "--json")
        assert done.returncode == 2, done.stdout + done.stderr
        data = json.loads(done.stdout)["paths"][str(tmp_path)]
        assert data["restart_from"]["name"] == "step_1.pt"
        statuses = {c["name"]: (c["status"], c["checksum"]) for c in data["checkpoints"]}
        assert statuses["step_2.pt"] == ("corrupt", "mismatch")

    def test_a_fresh_file_is_incomplete_exit_1_and_a_single_path_works(
        self, tmp_path: Path
    ) -> None:
        old = write_torch(tmp_path / "step_1.pt")
        age(old, HOUR)
        write_torch(tmp_path / "step_2.pt")  # just written, but the same at both looks
        done = verify(tmp_path, "--settle", "3600", "--json")
        assert done.returncode == 0, done.stdout + done.stderr
        assert (
            json.loads(done.stdout)["paths"][str(tmp_path)]["restart_from"]["name"] == "step_2.pt"
        )
        single = verify(old, "--json")
        assert single.returncode == 0, single.stdout + single.stderr
        assert json.loads(single.stdout)["paths"][str(old)]["restart_from"]["name"] == "step_1.pt"

    def test_a_growing_file_is_incomplete(self, tmp_path: Path) -> None:
        path = write_torch(tmp_path / "step_9.pt")
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"import time\nf=open({str(path)!r},'ab')\nfor _ in range(40):\n f.write(b'x'*100); f.flush(); time.sleep(0.05)",
            ]
        )
        try:
            done = verify(path, "--json", "--settle", "3600")
        finally:
            child.wait(timeout=30)
        assert done.returncode == 2, done.stdout
        only = json.loads(done.stdout)["paths"][str(path)]["checkpoints"][0]
        assert only["status"] == "incomplete"

    def test_a_missing_path_exit_2(self, tmp_path: Path) -> None:
        done = verify(tmp_path / "nope")
        assert done.returncode == 2
        assert "nope" in done.stdout
        assert not os.path.exists(tmp_path / "nope")
