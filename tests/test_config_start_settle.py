"""The first read at start waits for a finished file, as a reload does.

An agent started while its configuration is being written (Ansible's template and the edits
after it, each renamed over the last; an editor or `cat >` writing in place; a slow copy still
appending) read whatever the file held at that moment: a part cut inside a line was a TOML
error and the agent did not start; a part cut at a line is valid TOML and the agent started
with half a configuration (the collectors the rest names at their defaults, one the rest
disables running). Now the start reads the file as a reload does
(agent/program/config_loader.py `settled`): once it stood still for a moment and through the
read, within a bound; a file that really is bad still fails the start at once, naming the
file, the key and what was expected.

The writers here keep the file changing for about two seconds from before the agent process
starts (its imports take a good part of that), so that its first look falls inside the write.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.contracts.errors import ConfigError
from agent.program.commands import run as run_command
from tests.support.agent_proc import AgentProcess, http_get, run_gpuwarden

REST = "[collectors.system]\ninterval = 8.0\n[collectors.processes]\nenabled = false\n"
"""What the finished file says after the agent's own head (state_dir, the metrics port)."""
WRITE_FOR = 2.0
"""Seconds each writer keeps the file changing, in steps well inside the settle time."""
STEP = 0.1


def intervals(agent: AgentProcess) -> dict[str, str]:
    body = http_get(agent.metrics_url)[1]
    found = re.findall(r'gpuwarden_collector_interval_seconds\{collector="(\w+)"\} (\S+)', body)
    return {k: v for k, v in found if k in {"system", "processes"}}


def head_of(agent: AgentProcess) -> str:
    agent.config_text = ""
    agent.write_config()
    return agent.config_path.read_text()


def in_chunks(size: int | None) -> Callable[[Path, str], None]:
    """Truncate and write in place, as a slow writer: the agent's head, comment lines for
    about `WRITE_FOR` seconds, then the settings a piece at a time (`size` bytes, None: a
    line), so that the file is cut at a line or inside one all along."""

    def write(path: Path, text: str) -> None:
        head, rest = text.split("[collectors.system]")
        rest = "[collectors.system]" + rest
        padding = [f"# written by the test, part {n}\n" for n in range(int(WRITE_FOR / STEP))]
        if size is None:
            pieces = rest.splitlines(keepends=True)
        else:
            pieces = [rest[i : i + size] for i in range(0, len(rest), size)]
        with path.open("w") as f:
            f.write(head)
            f.flush()
            for piece in [*padding, *pieces]:
                time.sleep(STEP)
                f.write(piece)
                f.flush()

    return write


def renamed_in_steps(path: Path, text: str) -> None:
    """Ansible's way: the template, then one edit after another, each a whole file renamed
    over the last; every one of them is valid TOML, only the last is what was meant."""
    head = text.split("[collectors.system]", maxsplit=1)[0]
    stages = [head, head + "[collectors.system]\ninterval = 3.0\n"]
    spare = path.with_suffix(".tmp")
    deadline = time.monotonic() + WRITE_FOR
    n = 0
    while time.monotonic() < deadline:
        spare.write_text(stages[n % 2] + f"# pass {n}\n")
        os.replace(spare, path)
        n += 1
        time.sleep(STEP)
    spare.write_text(text)
    os.replace(spare, path)


WRITERS = [
    pytest.param(in_chunks(None), id="appended-a-line-at-a-time"),
    pytest.param(in_chunks(7), id="appended-cut-inside-lines"),
    pytest.param(renamed_in_steps, id="renamed-over-in-steps"),
]


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[list[AgentProcess]]:
    started: list[AgentProcess] = []
    yield started
    for agent in started:
        agent.stop()


class TestAFileBeingWrittenAtStart:
    @pytest.mark.parametrize("writer", WRITERS)
    def test_the_agent_starts_with_the_finished_file(
        self,
        tmp_path: Path,
        agents: list[AgentProcess],
        writer: Callable[[Path, str], None],
    ) -> None:
        agent = AgentProcess(tmp_path)
        agents.append(agent)
        text = head_of(agent) + REST
        thread = threading.Thread(target=writer, args=(agent.config_path, text), daemon=True)
        thread.start()
        time.sleep(STEP)  # the write is under way
        agent.write_config = lambda: None  # type: ignore[method-assign]  # the writer's file
        agent.start(wait=False)
        agent.wait_ready(timeout=30.0)
        thread.join(timeout=30.0)
        assert agent.config_path.read_text().endswith(REST)  # the writer is done
        assert intervals(agent) == {"system": "8.0"}, agent.log()  # processes stays off
        assert "configuration error" not in agent.log()


class TestABadFileStillFailsTheStart:
    @pytest.mark.parametrize(
        ("rest", "named", "expected"),
        [
            pytest.param(
                "[collectors.system]\ninterval = ", "TOML syntax error", "end of document", id="cut"
            ),
            pytest.param(
                '[collectors.system]\ninterval = "fast"\n',
                "collectors.system.interval",
                "expected",
                id="type",
            ),
            pytest.param("[collectors.systen]\n", "collectors.systen", "known: ", id="unknown"),
        ],
    )
    def test_exit_2_naming_the_file_the_key_and_what_was_expected(
        self, tmp_path: Path, rest: str, named: str, expected: str
    ) -> None:
        agent = AgentProcess(tmp_path)
        path = agent.config_path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(head_of(agent) + rest)
        started = time.monotonic()
        result = run_gpuwarden("run", "--config", str(path), timeout=60.0)
        took = time.monotonic() - started
        assert result.returncode == 2, result.stderr
        assert str(path) in result.stderr
        assert named in result.stderr
        assert expected in result.stderr
        assert took < 60.0  # a hang guard: a bad file is no reason to wait out the bound

    def test_a_file_that_never_settles_is_refused_within_the_bound(self, tmp_path: Path) -> None:
        path = tmp_path / "gpuwarden.toml"
        path.write_text(REST)
        done = threading.Event()

        def keep_writing() -> None:
            n = 0
            while not done.is_set():
                n += 1
                path.write_text(REST + f"# {n}\n")
                time.sleep(0.01)

        writer = threading.Thread(target=keep_writing)
        writer.start()
        try:
            with pytest.raises(ConfigError) as info:
                run_command.load_settled(path, quiet=0.1, bound=0.5, again=run_command.START_AGAIN)
        finally:
            done.set()
            writer.join()
        assert info.value.file == str(path)
        assert "kept changing" in str(info.value)
        assert "start the agent again" in str(info.value)
