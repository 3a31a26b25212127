"""`gpuwarden check` has a line per watched checkpoint location; `diag` an index of them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from agent.program.diagnose.diag import DiagOptions, build_bundle
from tests.support.checkpoints import HOUR, age, write_hf, write_torch
from tests.support.diag import load, make_proc_tree, write_config
from tests.test_diag import read_bundle

ROOT = Path(__file__).resolve().parents[1]


def config_with(tmp_path: Path, locations: dict[str, Path]) -> Path:
    tables = "".join(
        f'[[collectors.checkpoints.locations]]\nname = "{name}"\npath = "{path}"\nmax_age = 7200\n'
        for name, path in locations.items()
    )
    extra = "[collectors.checkpoints]\nenabled = true\n" + tables
    return write_config(tmp_path / "conf", proc_root=make_proc_tree(tmp_path / "proc"), extra=extra)


def check(cfg: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent", "check", "--config", str(cfg), "--json", "--no-torch",
         "--expect-gpus", "0"],
        capture_output=True, text=True, timeout=120, check=False, cwd=ROOT,
    )  # fmt: skip


class TestCheckLines:
    def test_a_line_per_location_good_and_bad(self, tmp_path: Path) -> None:
        good, bad = tmp_path / "good", tmp_path / "bad"
        good.mkdir()
        bad.mkdir()
        write_hf(good / "checkpoint-300", step=300)
        age(good / "checkpoint-300", HOUR / 2)
        broken = write_torch(bad / "step_5.pt")
        broken.write_bytes(broken.read_bytes()[:-300])
        age(broken, HOUR)
        done = check(config_with(tmp_path, {"good": good, "bad": bad}))
        data = json.loads(done.stdout)
        lines = {f["name"]: f for f in data["findings"] if f["area"] == "checkpoints"}
        assert set(lines) == {"checkpoints good", "checkpoints bad"}, done.stdout
        assert lines["checkpoints good"]["status"] == "OK"
        assert "step 300" in lines["checkpoints good"]["detail"]
        assert lines["checkpoints bad"]["status"] == "FAIL"
        assert "1 corrupt" in lines["checkpoints bad"]["detail"]
        assert done.returncode == 2

    def test_stale_is_a_warning(self, tmp_path: Path) -> None:
        old = tmp_path / "old"
        old.mkdir()
        age(write_torch(old / "step_1.pt"), 3 * HOUR)
        done = check(config_with(tmp_path, {"old": old}))
        lines = [f for f in json.loads(done.stdout)["findings"] if f["area"] == "checkpoints"]
        assert [f["status"] for f in lines] == ["WARN"], lines
        assert "3.0 h old" in lines[0]["detail"]


class TestDiagIndex:
    async def test_index_names_sizes_steps_and_no_contents(self, tmp_path: Path) -> None:
        loc = tmp_path / "ckpts"
        loc.mkdir()
        directory = write_hf(loc / "checkpoint-40", step=40)
        marker = "content-marker-7f3a9"
        (directory / "trainer_state.json").write_text(
            json.dumps({"global_step": 40, "note": marker})
        )
        age(directory, HOUR)
        cfg = load(config_with(tmp_path, {"run": loc}))
        out = tmp_path / "bundle.tar.gz"
        await build_bundle(cfg, DiagOptions(output=out, run_torch_probe=False, process_gap=0.05))
        members = read_bundle(out)
        index = json.loads(
            next(v for k, v in members.items() if k.endswith("checkpoints/index.json"))
        )
        entry = index["run"]["checkpoints"][0]
        assert (entry["name"], entry["status"], entry["step"]) == ("checkpoint-40", "complete", 40)
        assert entry["size_bytes"] > 0 and entry["age_seconds"] >= HOUR - 5
        assert not any(marker.encode() in data for data in members.values())
