"""The scheduler: intervals, failures and hangs stay with their own collector."""

from __future__ import annotations

import asyncio
import threading

from agent.contracts.model import Severity
from agent.runtime.core import Runtime
from tests.support.collectors import ScriptedCollector, scripted_runtime
from tests.support.waiting import announced, until


async def run_for(
    seconds: float, modes: dict[str, str], interval: float = 0.1, timeout: float = 0.3
) -> tuple[Runtime, dict[str, ScriptedCollector]]:
    runtime, made = scripted_runtime(modes, interval=interval, timeout=timeout)
    await runtime.start()
    await asyncio.sleep(seconds)
    return runtime, made


class TestIntervals:
    """Each collector runs on its own interval."""

    async def test_rounds_follow_interval(self) -> None:
        runtime, made = await run_for(1.0, {"a": "ok"}, interval=0.1)
        try:
            rounds = len(made["a"].rounds)
            # 1.0 s at 0.1 s: about 10 rounds; generous bounds, this is not a timing test.
            assert 4 <= rounds <= 14
            gaps = [b - a for a, b in zip(made["a"].rounds, made["a"].rounds[1:], strict=False)]
            assert all(gap > 0.05 for gap in gaps)  # no bursts to catch up
        finally:
            await runtime.stop()

    async def test_first_round_event_and_samples(self) -> None:
        runtime, _ = await run_for(0.3, {"a": "ok"})
        try:
            assert runtime.first_round.is_set()
            assert len(await announced(runtime, "first_round")) == 1
            assert all(e.node == runtime.node_id for e in runtime.recent_events)
            names = {s.family.name for s in runtime.samples()}
            assert "gpuwarden_test_rounds" in names
        finally:
            await runtime.stop()


class TestIsolation:
    """A failing or hanging collector changes only its own status."""

    async def test_raising_collector(self) -> None:
        runtime, _ = await run_for(0.6, {"good": "ok", "bad": "raise"})
        try:
            good, bad = runtime.collectors["good"], runtime.collectors["bad"]
            assert good.success is True and good.failures == 0
            assert bad.success is False and bad.failures >= 2
            assert "scripted failure" in bad.last_error
            labels = {
                s.label_values
                for s in runtime.samples()
                if s.family.name == "gpuwarden_test_rounds"
            }
            assert ("good",) in labels and ("bad",) not in labels
            success = {
                s.label_values[0]: s.value
                for s in runtime.samples()
                if s.family.name == "gpuwarden_collector_success"
            }
            assert success == {"good": 1.0, "bad": 0.0}
        finally:
            await runtime.stop()

    async def test_hang_reported_once_no_thread_growth(self) -> None:
        runtime, made = await run_for(
            0.6, {"good": "ok", "stuck": "hang"}, interval=0.05, timeout=0.1
        )
        try:
            threads_before = threading.active_count()
            good_rounds = len(made["good"].rounds)
            await asyncio.sleep(0.8)
            assert len(made["good"].rounds) > good_rounds  # the others keep going
            stuck = runtime.collectors["stuck"]
            assert made["stuck"].calls_started == 1  # not started again while it hangs
            assert len(made["stuck"].rounds) > 5
            assert stuck.success is False and "hung" in stuck.last_error
            assert threading.active_count() <= threads_before + 1
            hung_events = await announced(runtime, "call_hung")
            assert len(hung_events) == 1
            assert hung_events[0].severity is Severity.WARNING
            hung = {
                s.label_values[0]: s.value
                for s in runtime.samples()
                if s.family.name == "gpuwarden_collector_hung_calls"
            }
            assert hung == {"good": 0.0, "stuck": 1.0}
            # The call returns: the hang clears, the collector succeeds again.
            made["stuck"].release.set()
            assert len(await announced(runtime, "call_recovered")) == 1
            recovered = runtime.collectors["stuck"]  # a fresh name: mypy narrowed `stuck`
            # Its next round, after the announcement, is the one that succeeds.
            await until(lambda: recovered.success is True, 10, "a round that succeeds")
            assert not recovered.caller.hung
        finally:
            await runtime.stop()

    async def test_slow_collector_does_not_delay_others(self) -> None:
        runtime, made = await run_for(
            1.0, {"fast": "ok", "slow": "slow"}, interval=0.05, timeout=1.0
        )
        try:
            assert len(made["fast"].rounds) > 2 * len(made["slow"].rounds)
            assert runtime.collectors["slow"].success is True
        finally:
            await runtime.stop()


class TestHealth:
    """Health names the collector that went stale."""

    async def test_stale_collector_in_health(self) -> None:
        runtime, _ = await run_for(0.2, {"good": "ok", "bad": "raise"}, interval=0.05, timeout=0.05)
        try:
            later = runtime.started + 60
            runtime.collectors["good"].last_success = later
            health = runtime.health(now=later)
            assert not health.ok
            assert len(health.problems) == 1
            assert "collector bad stale" in health.problems[0]
            assert "scripted failure" in health.problems[0]
        finally:
            await runtime.stop()

    async def test_close_called_on_stop(self) -> None:
        runtime, made = await run_for(0.1, {"a": "ok"})
        await runtime.stop()
        assert made["a"].closed
