"""The write probe: writes, times and removes its file; refuses without a directory or space."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from agent.contracts.errors import ConfigError
from agent.contracts.settings import build
from collectors.io_probe import (
    MIB,
    PROBE_PREFIX,
    IoProbeCollector,
    IoProbeSettings,
    ProbeRefused,
    run_write_probe,
)
from tests.support.host import make_deps, pooled_caller, run_round, values


class TestRunWriteProbe:
    """The plain function `gpuwarden check --io-test` reuses."""

    def test_writes_measures_and_removes(self, tmp_path: Path) -> None:
        result = run_write_probe(tmp_path, 2, free_margin_bytes=0)
        assert result.size_bytes == 2 * MIB
        assert result.write_seconds > 0
        assert result.sync_latency_seconds > 0
        assert result.throughput_bytes_per_second == result.size_bytes / result.write_seconds
        assert list(tmp_path.iterdir()) == []

    @pytest.mark.parametrize("directory", [None, ""])
    def test_refuses_without_a_directory(self, directory: str | None) -> None:
        with pytest.raises(ProbeRefused, match="no directory"):
            run_write_probe(directory, 1)

    def test_refuses_a_file_or_missing_path(self, tmp_path: Path) -> None:
        (tmp_path / "file").write_text("x")
        for path in (tmp_path / "file", tmp_path / "missing"):
            with pytest.raises(ProbeRefused, match="not a directory"):
                run_write_probe(path, 1)

    def test_refuses_when_the_margin_would_be_crossed(self, tmp_path: Path) -> None:
        available = shutil.disk_usage(tmp_path).free
        with pytest.raises(ProbeRefused, match="margin"):
            # The margin is set just above what the real file system has left.
            run_write_probe(tmp_path, 1, free_margin_bytes=available)
        assert list(tmp_path.iterdir()) == []

    def test_removes_the_file_when_the_write_fails_midway(self, tmp_path: Path) -> None:
        calls = 0
        used_before = shutil.disk_usage(tmp_path).used

        def clock() -> float:
            nonlocal calls
            calls += 1
            if calls == 3:
                # Written to, and no name for it in the directory: a kill here leaves nothing
                # (tests/test_io_probe_kill.py).
                assert shutil.disk_usage(tmp_path).used > used_before
                assert [p for p in tmp_path.iterdir() if p.name.startswith(PROBE_PREFIX)] == []
                raise RuntimeError("interrupted between the sync test and the burst")
            return float(calls)

        with pytest.raises(RuntimeError, match="interrupted"):
            run_write_probe(tmp_path, 1, free_margin_bytes=0, clock=clock)
        assert list(tmp_path.iterdir()) == []


class TestCollector:
    """The io_probe collector: off by default, needs directories, reports a refusal as a series."""

    def test_enabled_without_directories_is_a_config_error(self) -> None:
        with pytest.raises(ConfigError, match="no directory"):
            build(IoProbeSettings, {"enabled": True}, "collectors.io_probe")

    def test_relative_directory_is_a_config_error(self) -> None:
        with pytest.raises(ConfigError, match="absolute"):
            build(IoProbeSettings, {"enabled": True, "directories": ["data"]})

    async def test_probe_and_refusal_in_one_round(self, tmp_path: Path) -> None:
        good, full = tmp_path / "good", tmp_path / "missing"
        good.mkdir()
        settings = IoProbeSettings(
            enabled=True, directories=(str(good), str(full)), size_mib=1, free_margin_mib=0
        )
        collector = IoProbeCollector(settings, make_deps())
        with pooled_caller(timeout=60) as caller:
            result = await run_round(collector, caller, now=123.0)
            again = await run_round(collector, caller, now=124.0)
        assert values(result, "gpuwarden_io_probe_write_bytes_per_second")[(str(good),)] > 0
        assert values(result, "gpuwarden_io_probe_last_run_timestamp_seconds") == {
            (str(good),): 123.0
        }
        errors = values(result, "gpuwarden_io_probe_error")
        assert errors[(str(good), "refused")] == 0
        assert errors[(str(full), "refused")] == 1
        assert [(e.kind, e.subject) for e in result.events] == [("io_probe_refused", str(full))]
        assert again.events == []
        assert os.listdir(good) == []
