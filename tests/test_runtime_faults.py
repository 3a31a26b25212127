"""Faults around the runtime: hung threads at exit, pool starvation, first round, reloads."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent.contracts.collector import CollectContext, CollectorSettings, CollectorSpec
from agent.contracts.model import Collection, Event, MetricFamily, Severity
from agent.program import config_file as config
from agent.program.commands import run as run_command
from agent.runtime.core import ReloadReport, Runtime
from agent.runtime.state import StateStore
from tests.support.agent_proc import REPO
from tests.support.collectors import scripted_runtime
from tests.support.waiting import until


class ManyHangs:
    """Hangs on ten resources at once, as eight GPUs stuck in NVML would."""

    name = "stuck"

    def __init__(self) -> None:
        self.release = threading.Event()

    def families(self) -> Sequence[MetricFamily]:
        return ()

    async def collect(self, ctx: CollectContext) -> Collection:
        await asyncio.gather(
            *(ctx.call(f"gpu{i}", self.release.wait, 30) for i in range(10)), return_exceptions=True
        )
        return Collection()

    async def close(self) -> None:
        self.release.set()


class TestPools:
    """One collector's hung calls cannot starve another's."""

    async def test_hung_gpus_do_not_queue_other_collectors(self) -> None:
        stuck = ManyHangs()
        runtime, _ = scripted_runtime({"disk": "slow"}, interval=0.1, timeout=0.5)
        spec: CollectorSpec[Any] = CollectorSpec(
            "stuck", "test", CollectorSettings, lambda settings, deps: stuck
        )
        runtime._specs["stuck"] = spec
        cfg = runtime.config
        runtime.config = dataclasses.replace(
            cfg,
            collectors={**cfg.collectors, "stuck": CollectorSettings(interval=0.1, timeout=0.3)},
        )
        await runtime.start()
        try:
            await asyncio.sleep(1.5)
            assert runtime.hung_calls() == 10
            disk = runtime.collectors["disk"]
            assert disk.success is True, disk.last_error
            assert disk.failures == 0
        finally:
            await runtime.stop()


class TestFirstRound:
    """READY waits for every collector's first round, not the fastest one's."""

    async def test_first_round_waits_for_the_slow_collector(self) -> None:
        runtime, made = scripted_runtime({"fast": "ok", "slow": "slow"}, interval=0.05, timeout=1.0)
        await runtime.start()
        try:
            await asyncio.sleep(0.1)  # fast has run rounds; slow's first (0.2 s) is running
            assert len(made["fast"].rounds) >= 1
            assert not runtime.first_round.is_set()
            await asyncio.wait_for(runtime.first_round.wait(), 5)
            assert runtime.collectors["slow"].rounds_done >= 1
        finally:
            await runtime.stop()


class TestReloadFailure:
    """A reload that fails part way does not end reloading."""

    async def test_reload_loop_survives(self, tmp_path: Path) -> None:
        calls: list[str] = []

        class Flaky:
            async def reload(self, new: config.Config) -> ReloadReport:
                calls.append(new.source)
                if len(calls) == 1:
                    raise RuntimeError("collector factory failed")
                return ReloadReport(applied=("ok",))

            def reload_refused(self, reason: str) -> None:
                calls.append(f"refused: {reason}")

        path = tmp_path / "c.toml"
        path.write_text("node_id = 'n'\n")
        queue: asyncio.Queue[None] = asyncio.Queue()
        task = asyncio.create_task(run_command._reload_loop(Flaky(), path, queue))  # type: ignore[arg-type]
        queue.put_nowait(None)
        await until(lambda: len(calls) == 2, what="the failed reload")
        queue.put_nowait(None)  # the next SIGHUP (one sent with it would be the same reload)
        await until(lambda: len(calls) == 3, what="the next reload")
        task.cancel()
        assert calls == [str(path), "refused: RuntimeError: collector factory failed", str(path)]


class TestOutboxAge:
    """The outbox's age counts from queueing, not from when the event happened."""

    def test_old_event_is_queued_now(self) -> None:
        store = StateStore.in_memory()
        week_ago = time.time() - 7 * 86400
        store.record_event(
            Event(
                source="kernel_log",
                kind="xid",
                severity=Severity.CRITICAL,
                message="Xid 79 from last week's log",
                time=week_ago,
            ),
            outbox=True,
        )
        [entry] = store.outbox_peek()
        assert entry.created > time.time() - 60


class NeverReturns(ManyHangs):
    """Its calls stay hung after close(), like a thread stuck in a driver ioctl."""

    async def close(self) -> None:
        return None


def runtime_with(collector: ManyHangs) -> Runtime:
    runtime, _ = scripted_runtime({})
    runtime._specs[collector.name] = CollectorSpec(
        collector.name, "test", CollectorSettings, lambda settings, deps: collector
    )
    runtime.config = dataclasses.replace(
        runtime.config, collectors={collector.name: CollectorSettings(interval=0.1, timeout=0.3)}
    )
    return runtime


HANG_SCRIPT = """
import asyncio
from agent.program.commands import run as run_command
from tests.test_runtime_faults import NeverReturns, runtime_with

async def main() -> tuple[int, int]:
    runtime = runtime_with(NeverReturns())
    await runtime.start()
    await asyncio.sleep(0.5)
    await runtime.stop()
    return 0, runtime.hung_calls()

code, hung = asyncio.run(main())
print("hung", hung, flush=True)
if hung:
    run_command.exit_now(code)
"""


class TestExitWithHungCall:
    """A call hung in a driver does not hold the process after a clean stop."""

    def test_process_exits(self) -> None:
        began = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-c", HANG_SCRIPT],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        took = time.monotonic() - began
        assert result.returncode == 0, result.stderr
        assert "hung 10" in result.stdout
        # The hung call blocks for 30 s; a process that waited for it would take that long.
        assert took < 25, took
