"""`gpuwarden bench` for a person: what it tests before it starts, progress while it runs, why a
ratio is missing, and how to get torch when it is not there."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

from agent.program.commands.bench import progress
from tests.test_bench_cli import bench


def test_says_what_it_tests_then_why_no_baseline(tmp_path: Path) -> None:
    first = bench(tmp_path, "--device", "cpu", "--size", "128")
    assert first.returncode == 0, first.stderr
    said = " ".join(first.stderr.split("TFLOP/s")[0].split())  # wrapped to the width
    assert said.startswith("testing the CPU: profile fp32 (float32, matmul precision highest)")
    assert "size 128, 2 windows of 2 products" in said
    assert "no baseline yet: it needs 3 comparable runs" in first.stdout
    assert "0 so far" in first.stdout
    second = bench(tmp_path, "--device", "cpu", "--size", "128")
    assert "1 so far" in second.stdout
    assert "None" not in first.stdout + first.stderr + second.stdout
    history = bench(tmp_path, "--history")
    assert "index None" not in history.stdout and "None" not in history.stdout
    assert "cpu" in history.stdout
    assert "baseline -: fewer than 3 comparable good runs" in history.stdout


def test_torch_missing_says_how_to_get_it(tmp_path: Path) -> None:
    python = tmp_path / "python-without-torch"
    python.write_text('#!/bin/sh\nexec /usr/bin/env -i PYTHONPATH="$PYTHONPATH" python3 -S "$@"\n')
    python.chmod(0o755)
    done = bench(tmp_path, "--device", "cpu", config=f'python = "{python}"\n')
    assert done.returncode == 1
    assert "pip install 'gpuwarden[bench]'" in done.stdout
    assert "collectors.benchmark.python" in done.stdout


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_lines_in_a_log_and_one_line_on_a_terminal() -> None:
    async def run(stream: io.StringIO) -> None:
        async with progress("GPU 0: running", 90.0, stream, every=0.05):
            await asyncio.sleep(0.4)

    log = io.StringIO()
    asyncio.run(run(log))
    lines = log.getvalue().splitlines()
    assert lines and all(line.startswith("GPU 0: running, ") for line in lines)
    assert all(line.endswith("s of at most 90 s") for line in lines)
    terminal = _Terminal()
    asyncio.run(run(terminal))
    text = terminal.getvalue()
    assert "\n" not in text and text.count("\r") >= 2  # rewritten in place
    assert text.endswith("\r\x1b[K")  # and cleared before the result is printed


def test_no_progress_for_a_short_run() -> None:
    async def run(stream: io.StringIO) -> None:
        async with progress("GPU 0: running", 90.0, stream, every=5.0):
            await asyncio.sleep(0.01)

    log = io.StringIO()
    asyncio.run(run(log))
    assert log.getvalue() == ""
