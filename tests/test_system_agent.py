"""The host collectors inside the real agent process: they run, and /metrics passes promtool."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from agent.program import registry
from tests.support.agent_proc import AgentProcess, http_get

PROMTOOL = shutil.which("promtool")


def _wait_for(agent: AgentProcess, needles: list[str], timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    body = ""
    while time.monotonic() < deadline:
        _, body = http_get(agent.metrics_url)
        if all(n in body for n in needles):
            return body
        time.sleep(0.2)
    raise AssertionError(f"missing {needles} after {timeout} s:\n{body}\n{agent.log()}")


def _every_family_once() -> str:
    """One sample of every family the host collectors declare, in the exposition format."""
    from agent.contracts.model import MetricFamily, Sample
    from exporters.exposition import render
    from tests.support.host import make_deps

    families: list[MetricFamily] = []
    for name in ("disk", "processes", "system", "io_probe"):
        spec = registry.collector_spec(name)
        families += spec.make(spec.defaults(), make_deps()).families()
    samples: list[Sample] = [f.sample(1, *("x" for _ in f.labels)) for f in families]
    return render(families, samples).decode()


class TestNames:
    """Every declared host family passes promtool's lint, with samples or not."""

    @pytest.mark.skipif(PROMTOOL is None, reason="promtool (Debian package prometheus) missing")
    def test_promtool_is_clean_on_every_family(self) -> None:
        assert PROMTOOL is not None
        body = _every_family_once()
        assert "gpuwarden_process_disk_sleep_seconds" in body
        lint = subprocess.run(
            [PROMTOOL, "check", "metrics"], input=body, text=True, capture_output=True, check=False
        )
        assert (lint.returncode, lint.stdout + lint.stderr) == (0, "")


class TestHostCollectorsInTheAgent:
    """disk, processes, system and io_probe configured from TOML, served on /metrics."""

    @pytest.mark.skipif(PROMTOOL is None, reason="promtool (Debian package prometheus) missing")
    def test_metrics_are_served_and_lint_clean(
        self, agent_process: AgentProcess, tmp_path: Path
    ) -> None:
        probe_dir = tmp_path / "probe"
        probe_dir.mkdir()
        agent_process.config_text = (
            "[collectors.disk]\ninterval = 1.0\n"
            "[collectors.processes]\ninterval = 1.0\n"
            "[collectors.system]\ninterval = 1.0\n"
            f'[collectors.io_probe]\nenabled = true\ndirectories = ["{probe_dir}"]\n'
            "size_mib = 1\nfree_margin_mib = 0\n"
        )
        agent_process.start()
        body = _wait_for(
            agent_process,
            [
                f'gpuwarden_collector_success{{collector="{name}"}} 1.0'
                for name in ("disk", "processes", "system", "io_probe")
            ]
            + [
                "gpuwarden_filesystem_size_bytes{device=",
                'gpuwarden_processes{state="sleeping"}',
                "gpuwarden_io_probe_write_bytes_per_second{",
            ],
        )
        assert PROMTOOL is not None
        lint = subprocess.run(
            [PROMTOOL, "check", "metrics"], input=body, text=True, capture_output=True, check=False
        )
        problems = [
            line
            for line in (lint.stdout + lint.stderr).splitlines()
            if "gpuwarden_filesystem" in line
            or "gpuwarden_process" in line
            or "gpuwarden_io_probe" in line
            or "gpuwarden_mount" in line
            or "gpuwarden_zombie" in line
            or "gpuwarden_previous_boot" in line
        ]
        assert problems == []
        assert list(probe_dir.iterdir()) == []
