"""One round policy: the daemon and the one-shot commands (`check`, `diag`) run a collector's
round with the same bound, classify its failures the same way and give every collector its own
pool of blocking-call threads. Every test here runs under both (the `path` fixture)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from agent.contracts.collector import (
    CollectContext,
    Collector,
    CollectorDeps,
    CollectorSettings,
    CollectorSpec,
)
from agent.contracts.errors import CallStillHung, CallTimedOut
from agent.contracts.model import Collection, Event, MetricFamily, MetricType
from agent.program import config_file
from agent.program.diagnose.collect_once import OneShotCollectors
from agent.runtime.core import Runtime
from agent.runtime.state import StateStore

ROUNDS = MetricFamily("gpuwarden_test_rounds", MetricType.GAUGE, "Rounds of a test collector")
KEY = "test:block"


class Misbehaving:
    """A collector whose rounds go wrong in one way each:

    ok: one sample; raise: an exception of its own; own_timeout: a TimeoutError of its own
    (a socket timeout), not the round's; call_timeout: a blocking call that does not
    return; still_hung: the same call asked again while the first one hangs; overrun: a round
    that awaits past any bound without a blocking call (a stuck await, not a stuck thread)."""

    def __init__(self, name: str, mode: str) -> None:
        self.name = name
        self.mode = mode
        self.release = threading.Event()

    def families(self) -> Sequence[MetricFamily]:
        return (ROUNDS,)

    def _block(self) -> None:
        self.release.wait(30)

    async def collect(self, ctx: CollectContext) -> Collection:
        if self.mode == "raise":
            raise RuntimeError("scripted failure")
        if self.mode == "own_timeout":  # a socket or wait_for of the collector's own, at once
            raise TimeoutError("socket read timed out")
        if self.mode == "call_timeout":
            await ctx.call(KEY, self._block)
        if self.mode == "still_hung":
            # A collector that carries on: the next call with the key is refused at once.
            with contextlib.suppress(CallTimedOut):
                await ctx.call(KEY, self._block)
            await ctx.call(KEY, self._block)
        if self.mode == "overrun":
            await asyncio.sleep(30)
        return Collection(samples=[ROUNDS.sample(1.0)])

    async def close(self) -> None:
        self.release.set()


class HangsEverywhere(Misbehaving):
    """Ten calls that stay hung after close(), as ten GPUs stuck in NVML would."""

    async def collect(self, ctx: CollectContext) -> Collection:
        await asyncio.gather(
            *(ctx.call(f"gpu{i}", self._block) for i in range(10)), return_exceptions=True
        )
        return Collection()

    async def close(self) -> None:
        return None  # the threads hang on; the test releases them at its end


class NeedsOneCall(Misbehaving):
    """A healthy collector that makes one quick blocking call (a statvfs, a /proc read)."""

    async def collect(self, ctx: CollectContext) -> Collection:
        await ctx.call("test:quick", sum, [1, 2])
        return Collection(samples=[ROUNDS.sample(1.0)])


@dataclass(frozen=True)
class Seen:
    """One collector's first round, as the path that ran it reports it."""

    error: str
    samples: int
    seconds: float
    emitted: tuple[Event, ...]


RoundPath = Callable[[Mapping[str, Collector], CollectorSettings], Awaitable[dict[str, Seen]]]


def specs_for(collectors: Mapping[str, Collector]) -> dict[str, CollectorSpec[Any]]:
    def made(collector: Collector) -> Callable[[CollectorSettings, CollectorDeps], Collector]:
        return lambda settings, deps: collector

    return {
        name: CollectorSpec(name, "test", CollectorSettings, made(collector))
        for name, collector in collectors.items()
    }


async def through_daemon(
    collectors: Mapping[str, Collector], settings: CollectorSettings
) -> dict[str, Seen]:
    """The daemon: every collector on its own loop; what its status says after round one."""
    cfg = config_file.parse({"prometheus": {"enabled": False}})
    cfg = dataclasses.replace(cfg, collectors=dict.fromkeys(collectors, settings))
    runtime = Runtime(cfg, StateStore.in_memory(), collectors=specs_for(collectors), sinks={})
    await runtime.start()
    try:
        await asyncio.wait_for(runtime.first_round.wait(), 20)
        statuses = {name: runtime.collectors[name] for name in collectors}
        rounds = {n: (s.last_error, len(s.samples), s.duration) for n, s in statuses.items()}
    finally:
        await runtime.stop()
    return {
        name: Seen(
            error,
            samples,
            seconds,
            tuple(e for e in runtime.recent_events if e.source == name),
        )
        for name, (error, samples, seconds) in rounds.items()
    }


async def through_one_shot(
    collectors: Mapping[str, Collector], settings: CollectorSettings
) -> dict[str, Seen]:
    """`check` and `diag`: one round each, one after the other, on one runner."""
    seen = {}
    async with OneShotCollectors(
        "n", dict.fromkeys(collectors, settings), specs=specs_for(collectors)
    ) as runner:
        for name in collectors:
            result = await runner.run(name)
            seen[name] = (result.error, len(result.samples), result.seconds)
    return {
        name: Seen(
            error,
            samples,
            seconds,
            tuple(e for e in runner.extra_emitted if e.source == name),
        )
        for name, (error, samples, seconds) in seen.items()
    }


@pytest.fixture(params=["daemon", "one_shot"])
def path(request: pytest.FixtureRequest) -> RoundPath:
    return through_daemon if request.param == "daemon" else through_one_shot


@pytest.fixture
def released() -> Iterator[list[Misbehaving]]:
    """Collectors whose hung threads are let go when the test ends."""
    made: list[Misbehaving] = []
    yield made
    for collector in made:
        collector.release.set()


# One round only in the test's window: the interval is long, a failing round short.
ONE_ROUND = CollectorSettings(interval=60.0, timeout=0.1)


def daemon_bound(settings: CollectorSettings) -> float:
    """The daemon's documented round bound: four of the longer of interval and call timeout."""
    return max(settings.interval, settings.timeout) * 4


class TestFailureClasses:
    """Each way a round fails reads the same under both paths, and leaves no samples."""

    @pytest.mark.parametrize(
        ("mode", "error"),
        [
            ("ok", re.escape("")),
            ("raise", re.escape("RuntimeError: scripted failure")),
            # Not the round bound: the round raised it long before.
            ("own_timeout", re.escape("TimeoutError: socket read timed out")),
            ("call_timeout", re.escape(str(CallTimedOut(KEY, ONE_ROUND.timeout)))),
            # How long it has hung is measured: any whole number of seconds.
            ("still_hung", re.escape(str(CallStillHung(KEY, 0))).replace("0", r"\d+")),
        ],
    )
    async def test_outcome(self, path: RoundPath, mode: str, error: str) -> None:
        collector = Misbehaving("c", mode)
        [seen] = (await path({"c": collector}, ONE_ROUND)).values()
        assert re.fullmatch(error, seen.error), seen.error
        assert seen.samples == (1 if mode == "ok" else 0)


class TestRoundBound:
    """A round that awaits too long is cut at the daemon's bound, under both paths: interval
    and call timeout each decide it when they are the longer."""

    @pytest.mark.parametrize(
        "settings",
        [
            CollectorSettings(interval=0.1, timeout=0.05),
            CollectorSettings(interval=0.05, timeout=0.2),
        ],
        ids=["interval-decides", "timeout-decides"],
    )
    async def test_overrun(self, path: RoundPath, settings: CollectorSettings) -> None:
        [seen] = (await path({"c": Misbehaving("c", "overrun")}, settings)).values()
        bound = daemon_bound(settings)
        assert seen.error == f"round did not finish within {bound:g} s"
        assert seen.samples == 0
        # Gross bounds only: cut near the bound, long before the collector's 30 s await.
        assert bound * 0.9 <= seen.seconds < 10, seen.seconds


class TestBlockingCalls:
    """The blocking-call pool policy: a hang is an event, and a collector's hung threads are
    its own."""

    async def test_hang_is_reported(self, path: RoundPath, released: list[Misbehaving]) -> None:
        collector = Misbehaving("c", "call_timeout")
        released.append(collector)
        [seen] = (await path({"c": collector}, ONE_ROUND)).values()
        hangs = [e for e in seen.emitted if e.kind == "call_hung"]
        assert [(e.source, e.subject) for e in hangs] == [("c", KEY)]

    async def test_hung_collector_does_not_starve_another(
        self, path: RoundPath, released: list[Misbehaving]
    ) -> None:
        stuck = HangsEverywhere("stuck", "hang")
        released.append(stuck)
        settings = CollectorSettings(interval=60.0, timeout=0.3)
        seen = await path({"stuck": stuck, "healthy": NeedsOneCall("healthy", "ok")}, settings)
        assert (seen["healthy"].error, seen["healthy"].samples) == ("", 1)

    async def test_queued_calls_let_go_quietly(
        self, path: RoundPath, released: list[Misbehaving]
    ) -> None:
        """Ten hung calls on eight threads: two wait in the queue and are cancelled when the
        pool is let go (a stop, a reload, check's exit). That is no error of the loop's."""
        loop = asyncio.get_running_loop()
        errors: list[dict[str, Any]] = []
        loop.set_exception_handler(lambda _, context: errors.append(context))
        try:
            stuck = HangsEverywhere("stuck", "hang")
            released.append(stuck)
            await path({"stuck": stuck}, CollectorSettings(interval=60.0, timeout=0.2))
            await asyncio.sleep(0.2)  # the loop's turn for what the cancellations scheduled
        finally:
            loop.set_exception_handler(None)
        assert [context.get("message") for context in errors] == []
