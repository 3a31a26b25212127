"""`make install` (scripts/install.sh) into a staging root, and the example configuration."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

from agent.program import config_file as config
from tests.support.deb import build_wheel
from tests.support.rules import RULES, RUNBOOK_PLACEHOLDER, alert_rules, promtool

ROOT = Path(__file__).resolve().parents[1]
# scripts/ is not a package: load the generator by path.
_spec = importlib.util.spec_from_file_location("config_example", ROOT / "scripts/config_example.py")
assert _spec is not None
assert _spec.loader is not None
config_example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(config_example)

PREFIX = "/opt/gpuwarden"
RUNBOOK_URL = "https://git.example.org/ops/gpuwarden/-/blob/main/docs/runbook.md"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel of this tree, built offline from a copy (no build files left in the tree)."""
    return build_wheel(ROOT, tmp_path_factory.mktemp("wheel")).wheel


@pytest.fixture(scope="module")
def staged(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    destdir = tmp_path_factory.mktemp("destdir")
    env = {
        **os.environ,
        "DESTDIR": str(destdir),
        "PACKAGE": str(wheel),
        "PIP_ARGS": "--no-deps --no-index",
        "PYTHON": sys.executable,
        "CREATE_USER": "1",
        "RUNBOOK_URL": RUNBOOK_URL,
    }
    done = subprocess.run(
        ["sh", str(ROOT / "scripts/install.sh")],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return destdir


class TestStagedInstall:
    """Everything lands under DESTDIR, pointing at the final paths."""

    def test_layout(self, staged: Path) -> None:
        for path in (
            "etc/systemd/system/gpuwarden.service",
            "etc/systemd/system/gpuwarden-watch.service",
            "usr/lib/sysusers.d/gpuwarden.conf",
            "usr/lib/tmpfiles.d/gpuwarden.conf",
            "etc/gpuwarden/gpuwarden.toml",
            "opt/gpuwarden/share/prometheus/gpuwarden-rules.yml",
            "opt/gpuwarden/share/prometheus/dcgm-compat-rules.yml",
            "opt/gpuwarden/share/grafana/gpuwarden.json",
            "opt/gpuwarden/share/alertmanager/alertmanager.yml",
            "opt/gpuwarden/venv/bin/gpuwarden",
        ):
            assert (staged / path).is_file(), path
        secret = staged / "etc/gpuwarden/mqtt-password"
        assert secret.stat().st_mode & 0o777 == 0o600

    def test_runbook_links_point_where_the_runbook_is_published(self, staged: Path) -> None:
        installed = staged / "opt/gpuwarden/share/prometheus/gpuwarden-rules.yml"
        text = installed.read_text()
        assert text == RULES.read_text().replace(f"{RUNBOOK_PLACEHOLDER}#", f"{RUNBOOK_URL}#")
        urls = [r["annotations"]["runbook_url"] for r in alert_rules(text).values()]
        assert urls and all(u.startswith(f"{RUNBOOK_URL}#") for u in urls)
        assert promtool("check", "rules", installed).returncode == 0

    @pytest.mark.parametrize(
        "url", ["git.example.org/runbook.md", "https://x/a b", "https://x/r.md#top", "https://x/&"]
    )
    def test_a_runbook_url_sed_would_mangle_is_refused_first(
        self, url: str, tmp_path: Path
    ) -> None:
        env = {**os.environ, "DESTDIR": str(tmp_path / "stage"), "RUNBOOK_URL": url}
        done = subprocess.run(
            ["sh", str(ROOT / "scripts/install.sh")],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 2
        assert "RUNBOOK_URL" in done.stderr and url in done.stderr
        assert not (tmp_path / "stage").exists()  # nothing installed

    def test_scripts_name_the_final_prefix(self, staged: Path) -> None:
        script = (staged / "opt/gpuwarden/venv/bin/gpuwarden").read_text()
        assert script.startswith(f"#!{PREFIX}/venv/bin/python")
        assert str(staged) not in script

    def test_installed_command_runs(self, staged: Path, tmp_path: Path) -> None:
        # The wheel went in without dependencies (offline); borrow them from the test's venv.
        env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"]}
        python = staged / "opt/gpuwarden/venv/bin/python"
        done = subprocess.run(
            [
                str(python),
                str(staged / "opt/gpuwarden/venv/bin/gpuwarden"),
                "config",
                "check",
                "--config",
                str(staged / "etc/gpuwarden/gpuwarden.toml"),
            ],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr

    def test_user_created_in_the_staging_root(self, staged: Path) -> None:
        passwd = (staged / "etc/passwd").read_text()
        assert any(line.startswith("gpuwarden:") for line in passwd.splitlines())

    def test_edited_config_is_kept(self, staged: Path, wheel: Path) -> None:
        config_path = staged / "etc/gpuwarden/gpuwarden.toml"
        config_path.write_text('node_id = "edited"\n')
        env = {
            **os.environ,
            "DESTDIR": str(staged),
            "PACKAGE": str(wheel),
            "PIP_ARGS": "--no-deps --no-index",
            "PYTHON": sys.executable,
        }
        subprocess.run(
            ["sh", str(ROOT / "scripts/install.sh")],
            env=env,
            check=True,
            capture_output=True,
            timeout=300,
        )
        assert config_path.read_text() == 'node_id = "edited"\n'


class TestConfigExample:
    """configs/gpuwarden.toml.example: generated from the code, and valid once uncommented."""

    def test_matches_the_code(self) -> None:
        current = (ROOT / "configs/gpuwarden.toml.example").read_text()
        assert current == config_example.render(), (
            "configs/gpuwarden.toml.example is out of date: "
            "run python scripts/config_example.py --write"
        )

    def test_uncommented_it_is_the_defaults(self) -> None:
        lines = []
        for line in (ROOT / "configs/gpuwarden.toml.example").read_text().splitlines():
            is_key = line.startswith("#") and " = " in line and not line.startswith("# ")
            if is_key and "..." not in line:
                lines.append(line[1:].split("   #")[0])
            elif not is_key:
                lines.append(line)
        data = tomllib.loads("\n".join(lines))
        assert data["watch"]["stale_after_intervals"] == 3.0
        parsed = config.parse(data)
        assert parsed.sections == config.parse({}).sections
