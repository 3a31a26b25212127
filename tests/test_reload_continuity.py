"""A reload that restarts a collector is not a success of it: the collector's record (its
counters, its last outcome, when it last succeeded, how long it has been stale) carries over to
the new instance. Before, the new instance started a clean record: a stale collector was cleared
(`collector_recovered`, "delivering again", /healthz 200) by the reload alone and raised again
a few intervals later, its last-success series vanished (Prometheus' stalled-collector alert
resolved and could not fire again) and its counters went back to 0."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from agent.contracts.collector import CollectorDeps, CollectorSettings, CollectorSpec
from agent.runtime.core import Runtime, cancel_tasks
from tests.support.collectors import ROUNDS, ScriptedCollector
from tests.support.waiting import until
from tests.test_reload import FAST, Rig, payload


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    instance = Rig({"a": "ok", "b": "ok"})
    await instance.runtime.start()
    yield instance
    await instance.runtime.stop()


def sample(runtime: Runtime, family: str, name: str) -> float | None:
    values = [
        s.value
        for s in runtime.samples()
        if s.family.name == family and s.label_values[:1] == (name,)
    ]
    return values[0] if values else None


def kinds(runtime: Runtime, kind: str, subject: str) -> list[str]:
    return [e.message for e in runtime.recent_events if e.kind == kind and e.subject == subject]


CHANGES = [
    pytest.param(FAST.replace(interval=0.07), id="interval"),
    pytest.param(FAST.replace(timeout=0.4), id="timeout"),
    pytest.param(FAST.replace(interval=0.06, timeout=0.35), id="both"),
]
FAULTS = [
    pytest.param("raise", "scripted failure", id="raising"),
    pytest.param("hang", "test:block", id="hung-call"),
]


async def stale(rig: Rig, name: str) -> None:
    """Until the health monitor's rule finds `name` stale; then its collector_stale event."""
    runtime = rig.runtime
    await until(lambda: any(i.name == name for i in runtime.stale_items()), what=f"{name} stale")
    runtime.check_stale()
    await runtime.settle()
    assert ("collector", name) in runtime.stale
    assert len(kinds(runtime, "collector_stale", name)) == 1


class TestAStaleCollectorStaysStale:
    @pytest.mark.parametrize(("mode", "why"), FAULTS)
    @pytest.mark.parametrize("change", CHANGES)
    async def test_restarted_while_failing(
        self, rig: Rig, mode: str, why: str, change: CollectorSettings
    ) -> None:
        runtime = rig.runtime
        old = rig.current("a")
        await until(lambda: runtime.collectors["a"].success is True, what="a's first success")
        rig.modes["a"] = old.mode = mode  # the collector starts failing, and so will its next
        await stale(rig, "a")
        last_success = sample(runtime, "gpuwarden_collector_last_success_timestamp_seconds", "a")
        runs = sample(runtime, "gpuwarden_collector_runs_total", "a")
        failures = sample(runtime, "gpuwarden_collector_failures_total", "a")
        assert last_success is not None and runs is not None and failures is not None

        report = await runtime.reload(rig.with_collectors(a=change))
        assert report.applied == ("collector a restarted",)
        assert rig.current("a") is not old
        runtime.check_stale()  # what the health monitor does at its next turn
        await runtime.settle()
        # Still stale: no all-clear, no second raise, the cause still named.
        assert kinds(runtime, "collector_recovered", "a") == []
        assert len(kinds(runtime, "collector_stale", "a")) == 1
        assert ("collector", "a") in runtime.stale
        health = runtime.health()
        assert not health.ok
        (problem,) = [p for p in health.problems if "collector a" in p]
        assert why in problem, problem
        # The series that alert rules read go on, and counters do not go back.
        assert (
            sample(runtime, "gpuwarden_collector_last_success_timestamp_seconds", "a")
            == last_success
        )
        assert sample(runtime, "gpuwarden_collector_success", "a") == 0.0
        assert (sample(runtime, "gpuwarden_collector_runs_total", "a") or 0) >= runs
        assert (sample(runtime, "gpuwarden_collector_failures_total", "a") or 0) >= failures

        # A round that succeeds is the all-clear, once.
        rig.modes["a"] = rig.current("a").mode = "ok"
        rig.current("a").release.set()
        await until(lambda: runtime.collectors["a"].success is True, what="a succeeds again")
        runtime.check_stale()
        await runtime.settle()
        assert kinds(runtime, "collector_recovered", "a") == ["collector a is delivering again"]
        assert len(kinds(runtime, "collector_stale", "a")) == 1

    @pytest.mark.parametrize("change", CHANGES)
    async def test_never_succeeded_keeps_its_clock(self, change: CollectorSettings) -> None:
        rig = Rig({"a": "raise", "b": "ok"})
        runtime = rig.runtime
        await runtime.start()
        try:
            await stale(rig, "a")
            since = runtime.collectors["a"].started
            await runtime.reload(rig.with_collectors(a=change))
            runtime.check_stale()
            await runtime.settle()
            assert kinds(runtime, "collector_recovered", "a") == []
            assert ("collector", "a") in runtime.stale
            assert runtime.collectors["a"].stale_from() == since
            assert (
                sample(runtime, "gpuwarden_collector_last_success_timestamp_seconds", "a") is None
            )
        finally:
            await runtime.stop()


class TestAHealthyCollectorIsNotMadeStale:
    async def test_a_shorter_interval_counts_from_the_reload(self) -> None:
        """The old success, long ago by the new interval, does not make it stale."""
        rig = Rig({"a": "ok", "b": "ok"}, settings=CollectorSettings(interval=5.0, timeout=0.3))
        runtime = rig.runtime
        await runtime.start()
        try:
            await until(lambda: runtime.collectors["a"].success is True, what="a's first round")
            done = runtime.collectors["a"].last_success
            assert done is not None
            await until(lambda: time.time() - done > 1.0, what="a second after the round")
            await runtime.reload(rig.with_collectors(a=FAST))
            started = runtime.collectors["a"].started
            # Just inside the new limit (3 x 0.05 + 0.3), counted from the reload, not from
            # the old success more than a second before it.
            assert not [i for i in runtime.stale_items(started + 0.4) if i.name == "a"]
        finally:
            await runtime.stop()


class TestAStoppedCollectorsAllClear:
    async def test_disabled_while_stale_says_it_no_longer_runs(self, rig: Rig) -> None:
        runtime = rig.runtime
        rig.modes["a"] = rig.current("a").mode = "raise"
        await stale(rig, "a")
        await runtime.reload(rig.with_collectors(a=FAST.replace(enabled=False)))
        runtime.check_stale()
        await runtime.settle()
        assert kinds(runtime, "collector_recovered", "a") == [
            "collector a no longer runs (stopped by a reload)"
        ]
        assert runtime.health().ok


class TestAReloadDuringTheFirstRound:
    """READY=1 (and the first heap trim) wait for every collector's first round. A collector
    that a reload stopped before its first round ended was waited for anyway: nothing set
    `first_round` again, and the real agent said READY=1 only after FIRST_ROUND_WAIT (30 s),
    with a warning that a round was still running."""

    @pytest.mark.parametrize(
        "change",
        [
            pytest.param({"slow": FAST.replace(enabled=False)}, id="disabled"),
            pytest.param(None, id="removed"),
            pytest.param({"slow": FAST.replace(timeout=0.3)}, id="restarted"),
        ],
    )
    async def test_what_no_longer_runs_is_not_waited_for(
        self, change: dict[str, CollectorSettings] | None
    ) -> None:
        rig = Rig({"a": "ok", "slow": "hang"}, settings=FAST.replace(timeout=60.0))
        runtime = rig.runtime
        await runtime.start()
        try:
            await until(lambda: runtime.collectors["a"].rounds_done > 0, what="a's first round")
            assert rig.current("slow").calls_started == 1  # its first round is under way
            assert not runtime.first_round.is_set()
            if change is None:
                new = dataclasses.replace(rig.config, collectors={"a": FAST.replace(timeout=60.0)})
            else:
                rig.modes["slow"] = "ok"
                new = rig.with_collectors(**change)
            await runtime.reload(new)
            await until(runtime.first_round.is_set, what="every running collector's first round")
        finally:
            await runtime.stop()


class SlowToClose(ScriptedCollector):
    """Closes in a while, as the GPU collector does (it joins its NVML event thread)."""

    async def close(self) -> None:
        await asyncio.sleep(0.3)
        await super().close()


class TestNoGapInTheSnapshot:
    """A scrape or a heartbeat during a reload sees the restarted collector, with its last
    series, until its new instance's first round replaces them. Before, it was missing while
    the old instance closed (up to 2 s) and had no series until the new one's first round:
    every GPU series and the collector's own were absent from a scrape then (a pending alert's
    `for` starts again, a firing one resolves and fires again)."""

    @pytest.mark.parametrize(
        ("slow_close", "slow_round"),
        [(True, False), (False, True), (True, True)],
        ids=["slow-close", "slow-first-round", "both"],
    )
    async def test_seen_all_through_a_restart(self, slow_close: bool, slow_round: bool) -> None:
        modes = {"a": "ok", "b": "ok"}
        made: list[ScriptedCollector] = []

        def make(settings: CollectorSettings, deps: CollectorDeps) -> ScriptedCollector:
            mode = "slow" if slow_round and made else "ok"
            kind = SlowToClose if slow_close else ScriptedCollector
            made.append(kind("a", mode, deps))
            return made[-1]

        rig = Rig(modes)
        runtime = rig.runtime
        runtime._specs["a"] = CollectorSpec("a", "test", CollectorSettings, make)
        await runtime.start()
        seen: list[tuple[bool, bool, bool]] = []
        done = asyncio.Event()

        async def scrape() -> None:
            while not done.is_set():
                series = {
                    s.label_values[0] for s in runtime.samples() if s.family.name == ROUNDS.name
                }
                success = sample(runtime, "gpuwarden_collector_success", "a")
                beat = payload(runtime)["collectors"]
                seen.append(("a" in series, success is not None, "a" in beat))
                await asyncio.sleep(0.005)

        try:
            await until(lambda: runtime.collectors["a"].success is True, what="a's first round")
            scraper = asyncio.create_task(scrape())
            await runtime.reload(rig.with_collectors(a=FAST.replace(interval=0.07)))
            new = made[-1]
            await until(lambda: len(new.rounds) >= 2, what="the new instance's rounds")
            done.set()
            await scraper
            assert len(made) == 2 and made[0].closed
            assert seen and all(all(s) for s in seen), [s for s in seen if not all(s)][:5]
        finally:
            done.set()
            await runtime.stop()

    async def test_a_disabled_collector_goes(self, rig: Rig) -> None:
        runtime = rig.runtime
        await until(lambda: runtime.collectors["a"].success is True, what="a's first round")
        await runtime.reload(rig.with_collectors(a=FAST.replace(enabled=False)))
        assert sample(runtime, "gpuwarden_collector_success", "a") is None
        assert not [
            s
            for s in runtime.samples()
            if s.family.name == ROUNDS.name and s.label_values[0] == "a"
        ]
        assert "a" not in payload(runtime)["collectors"]


class TestAStopDuringAReload:
    """SIGTERM while a reload retires the old instances (each close may take a while): the
    stop closes every instance the reload built and never ran (before, they were never
    closed: with them anything they held), and no round runs after the stop."""

    @pytest.mark.parametrize("after", [0.1, 0.45, 0.75], ids=["first-close", "second", "third"])
    async def test_every_instance_closed(self, after: float) -> None:
        made: list[ScriptedCollector] = []

        def make(name: str) -> Any:
            def build(settings: CollectorSettings, deps: CollectorDeps) -> ScriptedCollector:
                made.append(SlowToClose(name, "ok", deps))
                return made[-1]

            return build

        rig = Rig({"a": "ok", "b": "ok", "c": "ok"})
        runtime = rig.runtime
        for name in ("a", "b", "c"):
            runtime._specs[name] = CollectorSpec(name, "test", CollectorSettings, make(name))
        await runtime.start()
        await until(runtime.first_round.is_set, what="the first rounds")
        changes = rig.with_collectors(
            a=FAST.replace(enabled=False),
            b=FAST.replace(interval=0.07),
            c=FAST.replace(interval=0.08),
        )

        async def reloading() -> None:  # as `gpuwarden run`'s reload loop runs it
            await runtime.reload(changes)

        reload = asyncio.create_task(reloading())
        await asyncio.sleep(after)  # a point inside the retiring: not a timing claim
        await cancel_tasks([reload])  # what `gpuwarden run` does with it when the stop begins
        await runtime.stop()
        assert len(made) == 5
        assert [c.name for c in made if not c.closed] == []
        rounds = [len(c.rounds) for c in made]
        await asyncio.sleep(0.2)
        assert [len(c.rounds) for c in made] == rounds  # nothing runs after the stop


OFF = FAST.replace(enabled=False)
SEQUENCES = [
    pytest.param([OFF, FAST], id="disabled-enabled"),
    pytest.param([OFF, FAST.replace(interval=0.07)], id="disabled-enabled-changed"),
    pytest.param([OFF, OFF.replace(interval=0.07), FAST], id="disabled-changed-enabled"),
    pytest.param([OFF, FAST, OFF, FAST], id="twice"),
    pytest.param([FAST.replace(interval=0.07), OFF, FAST], id="restarted-disabled-enabled"),
    pytest.param([OFF, "refused", FAST], id="enable-refused-then-built"),
]


class TestCountersOfTheProcess:
    """`gpuwarden_collector_runs_total` and `..._failures_total` count the collector's rounds in
    this process: a reload that disables it and a later one that enables it again is no
    restart of the agent. Before, the collector came back with both at 0."""

    @pytest.mark.parametrize("mode", ["ok", "raise"])
    @pytest.mark.parametrize("sequence", SEQUENCES)
    async def test_never_lower_over_the_reloads(
        self, mode: str, sequence: list[CollectorSettings | str]
    ) -> None:
        rig = Rig({"a": mode, "b": "ok"})
        runtime = rig.runtime
        families = ("gpuwarden_collector_runs_total", "gpuwarden_collector_failures_total")
        high: dict[str, float] = {}

        def check() -> None:
            for family in families:
                value = sample(runtime, family, "a")
                if value is not None:
                    assert value >= high.get(family, value), (family, value, high)
                    high[family] = max(value, high.get(family, value))

        def rounds_ran(goal: float) -> bool:
            return (sample(runtime, families[0], "a") or 0.0) >= goal

        await runtime.start()
        try:
            await until(lambda: rounds_ran(3), what="a's first rounds")
            check()
            for step in sequence:
                if step == "refused":
                    rig.refuse["a"] = "no"
                    await runtime.reload(rig.with_collectors(a=FAST))
                    rig.refuse.clear()
                    check()
                    continue
                assert isinstance(step, CollectorSettings)
                await runtime.reload(rig.with_collectors(a=step))
                check()
                if step.enabled:
                    goal = high[families[0]] + 2
                    await until(functools.partial(rounds_ran, goal), what="a's rounds again")
                    check()
            assert high[families[0]] >= 5
            if mode == "raise":
                assert high[families[1]] >= 5
        finally:
            await runtime.stop()
