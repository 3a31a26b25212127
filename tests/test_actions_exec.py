"""`[actions.exec]`: a real hook program run by a real Runtime for each event at or above the
severity, the event JSON on its standard input, without blocking anything else."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import sys
import time
from pathlib import Path

import pytest

from agent.contracts.errors import ConfigError
from agent.contracts.model import Event, Severity
from agent.program import config_file as config
from agent.program import registry
from agent.runtime.core import Runtime
from agent.runtime.state import StateStore
from exporters.actions.sink import ActionsSink
from tests.support.waiting import announced, until


def hook(tmp_path: Path, body: str) -> str:
    path = tmp_path / "hook.py"
    path.write_text(f"import json, os, sys, time\n{body}\n")
    return str(path)


def runtime(command: list[str], **exec_settings: object) -> Runtime:
    cfg = config.parse(
        {
            "prometheus": {"enabled": False},
            "actions": {"exec": {"command": command, **exec_settings}},
        }
    )
    cfg = dataclasses.replace(cfg, collectors={})  # no collectors: only the events sent here
    return Runtime(cfg, StateStore.in_memory(), collectors={}, sinks=registry.SINKS)


def event(severity: Severity, n: int) -> Event:
    return Event("test", "thing", severity, f"event {n}", subject=f"s{n}")


def hook_of(rt: Runtime) -> ActionsSink:
    sink = rt.sinks["actions"]
    assert isinstance(sink, ActionsSink)
    return sink


async def test_each_event_at_or_above_the_severity_reaches_the_hook_once(
    tmp_path: Path,
) -> None:
    seen = tmp_path / "seen"
    script = hook(
        tmp_path,
        f"e = json.load(sys.stdin)\nopen({str(seen)!r}, 'a').write(e['id'] + ' ' + e['severity'] + '\\n')",
    )
    rt = runtime([sys.executable, script], min_severity="warning", max_concurrent=3)
    await rt.start()
    try:
        events = [
            event(s, n)
            for n, s in enumerate([Severity.INFO, Severity.WARNING] * 5 + [Severity.CRITICAL] * 3)
        ]
        for e in events:
            rt.emit(e)
        wanted = sorted(e.id for e in events if e.severity >= Severity.WARNING)

        def lines() -> list[str]:
            return seen.read_text().splitlines() if seen.exists() else []

        await until(lambda: len(lines()) >= len(wanted), 30, "every hook run")
        await asyncio.sleep(0.5)  # a duplicate would have come by now
        assert sorted(line.split()[0] for line in lines()) == wanted
        sink = hook_of(rt).exec
        assert sink is not None
        assert sink.outcomes["ok"] == len(wanted)
    finally:
        await rt.stop()


async def test_a_hook_is_killed_at_its_timeout_with_what_it_started(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    script = hook(
        tmp_path,
        "import subprocess\n"
        "child = subprocess.Popen(['sleep', '300'])\n"
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
        "time.sleep(300)",
    )
    rt = runtime([sys.executable, script], timeout=1.0)
    await rt.start()
    try:
        rt.emit(event(Severity.CRITICAL, 1))
        await until(lambda: pids.exists() and " " in pids.read_text(), 20, "the hook to start")
        hook_pid, child_pid = (int(p) for p in pids.read_text().split())
        sink = hook_of(rt).exec
        assert sink is not None
        await until(lambda: sink.outcomes["timeout"] == 1, 20, "the timeout")
        for pid in (hook_pid, child_pid):  # the whole process group went
            await until(functools.partial(_gone, pid), 10, f"pid {pid} to end")
        failed = await announced(rt, "exec_hook_failed")
        assert len(failed) == 1
        assert failed[0].attributes["reason"] == "timeout"
    finally:
        await rt.stop()


def _gone(pid: int) -> bool:
    return not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead: its parent (the hook, or us) has not reaped it yet.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


async def test_failures_are_counted_each_and_raised_once(tmp_path: Path) -> None:
    script = hook(tmp_path, "sys.stdin.read()\nsys.exit(3)")
    rt = runtime([sys.executable, script], max_concurrent=1)
    await rt.start()
    try:
        for n in range(4):
            rt.emit(event(Severity.CRITICAL, n))
        sink = hook_of(rt).exec
        assert sink is not None
        await until(lambda: sink.outcomes["exit_code"] == 4, 30, "four failed runs")
        failed = await announced(rt, "exec_hook_failed")
        assert len(failed) == 1
        assert "exit code 3" in failed[0].message
        series = {(s.family.name, s.label_values): s.value for s in rt.samples()}
        assert series[("gpuwarden_exec_hook_runs_total", ("exit_code",))] == 4
    finally:
        await rt.stop()


async def test_a_program_that_cannot_start_is_a_failure_not_a_crash(tmp_path: Path) -> None:
    rt = runtime([str(tmp_path / "no-such-hook")])
    await rt.start()
    try:
        rt.emit(event(Severity.CRITICAL, 1))
        sink = hook_of(rt).exec
        assert sink is not None
        await until(lambda: sink.outcomes["not_started"] == 1, 20, "the failed start")
        assert len(await announced(rt, "exec_hook_failed")) == 1
    finally:
        await rt.stop()


async def test_a_slow_hook_never_delays_delivery(tmp_path: Path) -> None:
    script = hook(tmp_path, "sys.stdin.read()\ntime.sleep(30)")
    rt = runtime([sys.executable, script], max_concurrent=1, timeout=60.0)
    heard: list[tuple[float, Event]] = []
    rt.subscribe(lambda e: heard.append((time.monotonic(), e)))
    await rt.start()
    try:
        sent = time.monotonic()
        events = [event(Severity.CRITICAL, n) for n in range(20)]
        for e in events:
            rt.emit(e)
        await until(lambda: len(heard) >= len(events), 5, "every event at the other listener")
        sink = hook_of(rt).exec
        assert sink is not None
        assert sink.running == 1  # the first hook still sleeps; the rest wait their turn
        assert heard[-1][0] - sent < 5  # a gross bound: not 30 s of hook per event
        stored = rt.store.recent_events(limit=50)
        assert {e.id for e in events} <= {e.id for e in stored}
        loop_lag = time.monotonic()
        await asyncio.sleep(0.01)
        assert time.monotonic() - loop_lag < 1.0  # the loop is free
    finally:
        stopping = time.monotonic()
        await rt.stop()
        assert time.monotonic() - stopping < 5  # stop kills the running hook, no wait


def test_the_settings_refuse_what_cannot_work() -> None:
    with pytest.raises(ConfigError, match=r"actions\.exec\.timeout"):
        config.parse({"actions": {"exec": {"command": ["x"], "timeout": 0}}})
    with pytest.raises(ConfigError, match="restart_application"):
        config.parse({"actions": {"slurm": {"drain_on": ["restart_application"]}}})
    with pytest.raises(ConfigError, match="reset_gpus"):
        config.parse({"actions": {"slurm": {"drain_on": ["reset_gpus"]}}})
    with pytest.raises(ConfigError, match=r"actions\.slurm\.resume"):
        config.parse({"actions": {"slurm": {"resume": "always"}}})
