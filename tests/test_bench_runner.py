"""The child runner: timeouts, crashes and garbage become outcomes, never exceptions."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from collectors.benchmark.runner import (
    STDOUT_LIMIT,
    ChildRunner,
    default_command,
    parse_child_output,
)
from tests.support.bench import RECORD_CHILD, fake_child


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); it is dead for our purpose
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class TestTimeout:
    """A child that hangs is killed with its whole process group."""

    async def test_sleeping_child_and_its_grandchild_are_killed(self, tmp_path: Path) -> None:
        pid_file = tmp_path / "grandchild.pid"
        command = fake_child(
            tmp_path,
            "sleeper",
            (
                "import subprocess, sys, time\n"
                f"p = subprocess.Popen(['sleep', '300'])\nopen({str(pid_file)!r}, 'w').write(str(p.pid))\n"
                "print('starting', flush=True)\ntime.sleep(300)\n"
            ),
        )
        runner = ChildRunner(command, timeout=1.5)
        outcome = await runner.run([])
        assert outcome.failure == "timeout"
        assert outcome.record is None
        assert outcome.exit_code is None
        assert "1.5 s" in outcome.message
        grandchild = int(pid_file.read_text())
        deadline = time.monotonic() + 5
        while _alive(grandchild) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not _alive(grandchild)

    async def test_cancelled_run_kills_the_child(self, tmp_path: Path) -> None:
        pid_file = tmp_path / "child.pid"
        command = fake_child(
            tmp_path,
            "sleeper",
            (
                f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
                "time.sleep(300)\n"
            ),
        )
        task = asyncio.ensure_future(ChildRunner(command, timeout=60).run([]))
        while not pid_file.exists() or not pid_file.read_text():
            await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert task.cancelled()
        assert not _alive(int(pid_file.read_text()))


class TestCrash:
    """Non-zero exits, signals and garbage are failures with the stderr tail kept."""

    async def test_nonzero_exit_keeps_code_and_stderr(self, tmp_path: Path) -> None:
        command = fake_child(
            tmp_path,
            "crasher",
            (
                "import sys\nsys.stderr.write('x' * 10000 + 'Segmentation in cuBLAS\\n')\n"
                "sys.exit(7)\n"
            ),
        )
        outcome = await ChildRunner(command, timeout=30).run([])
        assert outcome.failure == "crash"
        assert outcome.exit_code == 7
        assert "exit status 7" in outcome.message
        assert outcome.stderr_tail.endswith("Segmentation in cuBLAS\n")
        assert len(outcome.stderr_tail) <= 4096

    async def test_killed_by_signal_is_named(self, tmp_path: Path) -> None:
        command = fake_child(
            tmp_path, "segv", "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n"
        )
        outcome = await ChildRunner(command, timeout=30).run([])
        assert outcome.failure == "crash"
        assert outcome.message == "killed by SIGSEGV"

    async def test_garbage_on_stdout_is_bad_output(self, tmp_path: Path) -> None:
        command = fake_child(tmp_path, "garbage", "print('{not json'); print('hello')\n")
        outcome = await ChildRunner(command, timeout=30).run([])
        assert outcome.failure == "bad_output"
        assert outcome.exit_code == 0

    async def test_a_json_object_that_is_not_a_record_is_bad_output(self, tmp_path: Path) -> None:
        command = fake_child(tmp_path, "other", "print('{\"hello\": 1}')\n")
        outcome = await ChildRunner(command, timeout=30).run([])
        assert outcome.failure == "bad_output"

    async def test_record_with_nonzero_exit_is_a_crash(self, tmp_path: Path) -> None:
        command = fake_child(tmp_path, "late", RECORD_CHILD + "import sys\nsys.exit(139)\n")
        outcome = await ChildRunner(command, timeout=30).run(
            [
                "--size",
                "128",
                "--iterations",
                "1",
                "--profile",
                "fp32",
                "--device",
                "cpu",
                "--min-window",
                "0",
            ]
        )
        assert outcome.failure == "crash"
        assert outcome.record is None

    async def test_error_object_keeps_its_kind(self, tmp_path: Path) -> None:
        body = (
            "import json, sys\nprint(json.dumps({'error': 'out_of_memory', "
            "'message': 'CUDA out of memory'}))\nsys.exit(4)\n"
        )
        outcome = await ChildRunner(fake_child(tmp_path, "oom", body), timeout=30).run([])
        assert outcome.failure == "out_of_memory"
        assert outcome.exit_code == 4
        assert outcome.message == "CUDA out of memory"

    async def test_unknown_error_kind_becomes_error(self, tmp_path: Path) -> None:
        body = 'print(\'{"error": "gremlins", "message": "m"}\')\n'
        outcome = await ChildRunner(fake_child(tmp_path, "odd", body), timeout=30).run([])
        assert outcome.failure == "error"

    async def test_missing_interpreter_is_a_crash_not_an_exception(self) -> None:
        outcome = await ChildRunner(["/nonexistent/python3"], timeout=5).run([])
        assert outcome.failure == "crash"
        assert "cannot start" in outcome.message

    async def test_endless_output_is_bounded(self, tmp_path: Path) -> None:
        body = "import sys\nfor _ in range(3000):\n    sys.stdout.write('y' * 1000 + '\\n')\n"
        outcome = await ChildRunner(fake_child(tmp_path, "chatty", body), timeout=30).run([])
        assert outcome.failure == "bad_output"
        assert STDOUT_LIMIT < 3000 * 1001


class TestParse:
    """The stdout parser takes the last JSON object line and survives anything."""

    def test_last_object_wins_over_noise(self) -> None:
        out = b'warning: something\n{"a": 1}\nnoise\n{"b": 2}\n\n'
        assert parse_child_output(out) == {"b": 2}

    def test_arrays_and_scalars_are_not_records(self) -> None:
        assert parse_child_output(b"[1, 2]\n42\n") is None

    @given(st.binary(max_size=2000))
    def test_any_bytes_parse_or_give_none(self, data: bytes) -> None:
        result = parse_child_output(data)
        assert result is None or isinstance(result, dict)

    @given(
        st.dictionaries(st.text(max_size=10), st.integers() | st.text(max_size=10), max_size=5),
        st.lists(
            st.text(max_size=40).filter(lambda s: "\n" not in s and "\r" not in s), max_size=5
        ),
    )
    def test_an_object_after_noise_is_found(self, obj: dict[str, object], noise: list[str]) -> None:
        data = "\n".join([*noise, json.dumps(obj), ""]).encode()
        assert parse_child_output(data) == obj


class TestAnotherInterpreter:
    """`[collectors.benchmark] python` may name an interpreter that has torch but not gpuwarden:
    the child must still import from this installation, whatever the working directory."""

    async def test_an_interpreter_without_gpuwarden_finds_the_child(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        python = tmp_path / "bare-python"
        # -S: no site-packages, so neither an installed gpuwarden nor an editable one
        python.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
        python.chmod(0o755)
        monkeypatch.chdir(tmp_path)  # the cwd is not the checkout
        outcome = await ChildRunner(default_command(str(python)), timeout=60).run(
            ["--device", "cpu", "--size", "128"]
        )
        # Without site-packages there is no torch either: the child's own answer says so.
        assert "No module named 'collectors'" not in outcome.stderr_tail, outcome.stderr_tail
        assert (outcome.failure, outcome.exit_code) == ("torch_missing", 3), outcome
