"""A SIGHUP that comes while the file is being written in place reads the finished file.

A file truncated and written again (an editor, `cat >`, a tool that does not rename) is empty or
half written for a moment. Before, a reload then read it: a part cut at a line is valid TOML and
was applied as if meant (the collectors it did not name back to their defaults, one the file
disables started), a part cut inside a line was refused, and either way nothing applied the
finished file until the next SIGHUP."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.contracts.errors import ConfigError
from agent.program import config_file
from agent.program.commands import run as run_command
from agent.runtime.core import ReloadReport
from tests.support.agent_proc import AgentProcess, http_get
from tests.support.waiting import until, wait_until

BEFORE = "[collectors.system]\ninterval = 7.0\n[collectors.processes]\nenabled = false\n"
AFTER = BEFORE.replace("7.0", "8.0")


def intervals(agent: AgentProcess) -> dict[str, str]:
    body = http_get(agent.metrics_url)[1]
    return dict(
        re.findall(r'gpuwarden_collector_interval_seconds\{collector="(\w+)"\} (\S+)', body)
    )


def watched(agent: AgentProcess) -> dict[str, str]:
    """The two collectors the files name: system's interval, processes' if it runs."""
    return {k: v for k, v in intervals(agent).items() if k in {"system", "processes"}}


def in_place(cut: Callable[[str], int]) -> Callable[[AgentProcess, str], None]:
    """Truncate, write the text up to `cut(text)`, SIGHUP, then the rest, as a slow writer."""

    def write(agent: AgentProcess, text: str) -> None:
        at = cut(text)
        with agent.config_path.open("w") as f:
            f.write(text[:at])
            f.flush()
            agent.signal(signal.SIGHUP)
            time.sleep(0.02)
            f.write(text[at:])

    return write


def renamed(agent: AgentProcess, text: str) -> None:
    spare = agent.config_path.with_suffix(".new")
    spare.write_text(text)
    os.replace(spare, agent.config_path)
    agent.signal(signal.SIGHUP)


WRITES = [
    pytest.param(in_place(lambda text: 0), id="empty"),
    pytest.param(in_place(lambda text: text.index("[collectors.system]")), id="cut-at-a-table"),
    pytest.param(in_place(lambda text: text.index("interval = 8") + 6), id="cut-in-a-line"),
    pytest.param(
        in_place(lambda text: text.index("[collectors.processes]")), id="cut-before-a-disable"
    ),
    pytest.param(renamed, id="renamed-into-place"),
]


class TestHalfWrittenFile:
    @pytest.mark.parametrize("write", WRITES)
    def test_the_finished_file_applies(
        self, tmp_path: Path, write: Callable[[AgentProcess, str], None]
    ) -> None:
        agent = AgentProcess(tmp_path, config_text=BEFORE)
        agent.start()
        try:
            assert watched(agent) == {"system": "7.0"}
            head = agent.config_path.read_text().split("[collectors.system]")[0]
            write(agent, head + AFTER)
            wait_until(lambda: "configuration reloaded" in agent.log(), 20, "the reload")
            assert watched(agent) == {"system": "8.0"}  # processes stays disabled
            reloads = [ln for ln in agent.log().splitlines() if "configuration reloaded" in ln]
            assert len(reloads) == 1, reloads
            assert '"changes": ["collector system restarted"]' in reloads[0]
            assert "reload refused" not in agent.log()
        finally:
            assert agent.stop() == 0


class TestAFileThatKeepsChanging:
    def test_refused_with_the_file_and_why(self, tmp_path: Path) -> None:
        path = tmp_path / "gpuwarden.toml"
        path.write_text(BEFORE)
        done = threading.Event()

        def keep_writing() -> None:
            n = 0
            while not done.is_set():
                n += 1
                path.write_text(BEFORE + f"# {n}\n")
                time.sleep(0.01)

        writer = threading.Thread(target=keep_writing)
        writer.start()
        try:
            with pytest.raises(ConfigError) as info:
                run_command.load_settled(path, quiet=0.1, bound=0.5)
        finally:
            done.set()
            writer.join()
        assert info.value.file == str(path)
        assert "kept changing" in str(info.value)
        assert "SIGHUP again" in str(info.value)
        # Once it is written, the same call reads it.
        assert (
            run_command.load_settled(path, quiet=0.1, bound=0.5).collectors["system"].interval
            == 7.0
        )


class TestABurstOfSighups:
    async def test_one_read_answers_the_sighups_before_it(self, tmp_path: Path) -> None:
        """Ten SIGHUPs in a moment: one reload (each waits for the file to settle: ten in a
        row would be five seconds of reloads); one more after it: another."""
        path = tmp_path / "gpuwarden.toml"
        path.write_text(f'state_dir = "{tmp_path}"\n[prometheus]\nenabled = false\n')
        loaded: list[str] = []

        class Counting:
            async def reload(self, new: config_file.Config) -> ReloadReport:
                loaded.append(new.source)
                return ReloadReport()

            def reload_refused(self, reason: str) -> None:
                raise AssertionError(reason)

        reloads: asyncio.Queue[None] = asyncio.Queue()
        loop = asyncio.create_task(run_command._reload_loop(Counting(), path, reloads))  # type: ignore[arg-type]
        try:
            for _ in range(10):
                reloads.put_nowait(None)
            await until(lambda: len(loaded) == 1, what="the reload")
            await until(reloads.empty, what="the burst taken")
            reloads.put_nowait(None)
            await until(lambda: len(loaded) == 2, what="the next reload")
            await asyncio.sleep(2 * run_command.SETTLE)  # nothing else is queued
            assert loaded == [str(path)] * 2
        finally:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)

    def test_the_real_agent_applies_the_last_file(self, tmp_path: Path) -> None:
        agent = AgentProcess(tmp_path, config_text=BEFORE)
        agent.start()
        try:
            head = agent.config_path.read_text().split("[collectors.system]")[0]
            for n in range(10):
                agent.config_path.write_text(head + BEFORE.replace("7.0", f"{n + 10}.0"))
                agent.signal(signal.SIGHUP)
                time.sleep(0.1)
            wait_until(lambda: watched(agent) == {"system": "19.0"}, 30, "the last file")
            assert "reload refused" not in agent.log()
        finally:
            assert agent.stop() == 0
