"""One collector round, the same for the daemon and for the one-shot commands.

The daemon (`Runtime`, one round per interval) and `check`/`diag` (`OneShotCollectors`, one
round now) both build a collector's blocking-call pool with `collector_pool` and run its rounds
with `run_round`, so a collector that hangs, raises or overruns gets the same bound and the same
error text whether the daemon runs it or `check` does:

- the round bound is `round_limit(settings)`: four times the longer of the collector's interval
  and its call timeout. Generous on purpose: every blocking call has its own, shorter timeout,
  and the bound catches only a round stuck in an await of its own. `check` therefore waits as
  long as the daemon before it calls a round stuck (40 s for interval 10 and timeout 5; the
  disk collector's 30 s interval gives 120 s), where it used to cut at max(2 x timeout, 5 s);
- a call that timed out or is still hung reads as its exception's own text ("nvml:gpu0: no
  answer within 5 s"), an overrun as "round did not finish within N s", anything else the
  round raised (a TimeoutError of its own included) as "Type: message";
- each collector has its own pool of THREAD_POOL_SIZE threads, and a call that hangs is an
  event (`call_hung`, then `call_recovered` when it returns);
- the GPU collector's caller waits for each answer in place for up to 2 ms before it awaits
  it (`WAIT_IN_PLACE`).

What a path does with an outcome (the daemon's status and snapshot, check's findings) stays
with that path.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from agent.contracts.collector import CollectContext, Collector, CollectorSettings
from agent.contracts.errors import CallStillHung, CallTimedOut
from agent.contracts.model import Event, RepairAction, Sample, Severity
from agent.runtime.blocking import CallPool, PooledCaller

THREAD_POOL_SIZE = 8
"""Threads per collector. Bounded: each hung resource holds at most one thread. Each collector
has its own pool, so GPUs hung in NVML cannot queue the disk or kernel-log reads behind them
(and make those look hung too)."""

WAIT_IN_PLACE = {"gpu": 0.002}
"""Collectors whose calls the loop's thread waits for in place, and for how long (seconds).
The GPU collector's steady read answers in 0.2-0.6 ms on the lent H200, and waiting for it in
place took a tenth off its round there (bench/gpu_round.py, bench/gpu_handoff.py); a slower
read (a full round, a hung GPU) blocks the loop for 2 ms, then is awaited as usual. Every other
collector's calls are awaited: a file system or /proc read has no such bound."""

ROUND_LIMIT_FACTOR = 4
"""A round may take this many of the longer of its collector's interval and call timeout."""


def round_limit(settings: CollectorSettings) -> float:
    """Seconds one round of a collector with these settings may take."""
    return max(settings.interval, settings.timeout) * ROUND_LIMIT_FACTOR


class CollectorPool(NamedTuple):
    """A collector's blocking-call thread pool and the caller its rounds use."""

    caller: PooledCaller
    executor: CallPool

    def shutdown(self) -> None:
        """Let the pool go without waiting: a hung call keeps its thread until it returns."""
        self.executor.shutdown(wait=False, cancel_futures=True)


def collector_pool(name: str, timeout: float, emit: Callable[[Event], None]) -> CollectorPool:
    """The pool for collector `name`: THREAD_POOL_SIZE threads, `timeout` per call, and a hung
    call (and its late return) told through `emit` as an event of the collector's."""
    executor = CallPool(THREAD_POOL_SIZE, f"gpuwarden-{name}")
    caller = PooledCaller(
        executor,
        timeout,
        on_hang=lambda key, limit: emit(_hung_event(name, key, limit)),
        on_recover=lambda key, took: emit(_recovered_event(name, key, took)),
        wait_in_place=WAIT_IN_PLACE.get(name, 0.0),
    )
    return CollectorPool(caller, executor)


def _hung_event(name: str, key: str, timeout: float) -> Event:
    return Event(
        source=name,
        kind="call_hung",
        severity=Severity.WARNING,
        repair_action=RepairAction.NONE,
        subject=key,
        message=f"{name}: call {key} did not return within {timeout:g} s; "
        "it is not retried until it returns",
        action="look for a hung driver, device or network mount behind " + key,
    )


def _recovered_event(name: str, key: str, took: float) -> Event:
    return Event(
        source=name,
        kind="call_recovered",
        severity=Severity.INFO,
        repair_action=RepairAction.NONE,
        subject=key,
        message=f"{name}: call {key} returned after {took:.1f} s",
    )


class Failure(enum.Enum):
    """How a round failed: the classes a path may treat differently (the daemon logs the
    traceback of a RAISED round, the others are expected weather)."""

    CALL_TIMED_OUT = "call_timed_out"
    CALL_STILL_HUNG = "call_still_hung"
    ROUND_LIMIT = "round_limit"
    RAISED = "raised"


@dataclass(frozen=True)
class RoundOutcome:
    """What one round gave: samples and events, or an error (and then neither)."""

    samples: tuple[Sample, ...] = ()
    events: tuple[Event, ...] = ()
    error: str = ""
    failure: Failure | None = None
    exception: BaseException | None = None
    """What the collector raised, for a traceback in the log; None on success."""
    seconds: float = 0.0
    """How long the round ran (monotonic)."""
    started: float = 0.0
    """Wall-clock start (the round's `ctx.now`), seconds since the epoch."""

    @property
    def ok(self) -> bool:
        return self.failure is None


async def run_round(
    collector: Collector,
    caller: PooledCaller,
    settings: CollectorSettings,
    round_number: int,
    now: float | None = None,
) -> RoundOutcome:
    """Run one `collect` within `round_limit(settings)` and classify how it ended.

    `now`: the round's wall-clock start, when the caller has already recorded it as its
    attempt time (default: now). A cancellation (a stop, a reload) is not an outcome: it
    propagates."""
    ctx = CollectContext(caller=caller, now=time.time() if now is None else now, round=round_number)
    limit = round_limit(settings)
    started = time.monotonic()

    def failed(failure: Failure, error: str, exc: BaseException) -> RoundOutcome:
        return RoundOutcome(
            error=error,
            failure=failure,
            exception=exc,
            seconds=time.monotonic() - started,
            started=ctx.now,
        )

    # asyncio.timeout, not wait_for: only it tells the bound's TimeoutError from one the
    # collector raised itself (a socket timeout), which is an exception like any other.
    bound = asyncio.timeout(limit)
    try:
        async with bound:
            result = await collector.collect(ctx)
    except CallTimedOut as exc:
        return failed(Failure.CALL_TIMED_OUT, str(exc), exc)
    except CallStillHung as exc:
        return failed(Failure.CALL_STILL_HUNG, str(exc), exc)
    except TimeoutError as exc:
        if not bound.expired():
            return failed(Failure.RAISED, f"{type(exc).__name__}: {exc}", exc)
        return failed(Failure.ROUND_LIMIT, f"round did not finish within {limit:g} s", exc)
    except Exception as exc:
        return failed(Failure.RAISED, f"{type(exc).__name__}: {exc}", exc)
    return RoundOutcome(
        samples=tuple(result.samples),
        events=tuple(result.events),
        seconds=time.monotonic() - started,
        started=ctx.now,
    )
