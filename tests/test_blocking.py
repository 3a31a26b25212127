"""PooledCaller's contract: what a blocking call returns or raises, its timeout, a hung key,
and what is left behind (no stray "never retrieved" errors, no second thread per key).

The GPU collector makes one such call per GPU every round: its hand-off is the largest part
of a steady round after the NVML calls themselves (bench/gpu_round.py), so the caller resolves
a call with as few turns of the event loop as it can. These tests hold whatever it does to
the same behaviour."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import gc
import itertools
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from agent.contracts.collector import Call
from agent.contracts.errors import CallStillHung, CallTimedOut
from agent.runtime.blocking import CallPool, PooledCaller, _Handoff
from tests.support.waiting import until


class Boom(Exception):
    pass


async def nothing_left_behind(loop_errors: list[dict[str, Any]]) -> None:
    """Whatever was still to be delivered through the loop has arrived, the garbage is
    collected, and the loop was told of nothing (no exception never retrieved)."""
    await asyncio.sleep(0.05)
    gc.collect()
    await asyncio.sleep(0)
    assert loop_errors == []


MakeCaller = Callable[..., PooledCaller]


@pytest.fixture(params=[0.0, 0.002], ids=["awaits", "waits-in-place"])
def make(request: pytest.FixtureRequest) -> MakeCaller:
    """PooledCaller as the collectors get it: awaiting every answer through the loop, or
    waiting for it in place first (the GPU collector's). The whole contract holds for both."""
    window: float = request.param
    return functools.partial(PooledCaller, wait_in_place=window)


@pytest.fixture
def executor() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    pool = concurrent.futures.ThreadPoolExecutor(4)
    yield pool
    pool.shutdown(wait=False, cancel_futures=True)


@pytest.fixture
async def loop_errors() -> AsyncIterator[list[dict[str, Any]]]:
    """What the running loop's exception handler was given (e.g. "Future exception was
    never retrieved"): empty when the caller leaves nothing behind."""
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: seen.append(context))
    yield seen
    loop.set_exception_handler(previous)


class TestAnswers:
    async def test_returns_the_result_with_arguments_and_keywords(
        self,
        executor: concurrent.futures.ThreadPoolExecutor,
        make: MakeCaller,
    ) -> None:
        caller = make(executor, 5.0)

        def add(a: int, b: int, *, times: int) -> tuple[int, str]:
            return (a + b) * times, threading.current_thread().name

        value, thread = await caller.call("k", add, 2, 3, times=4)
        assert value == 20
        assert thread != threading.current_thread().name  # off the event loop's thread

    async def test_raises_what_the_function_raised(
        self,
        executor: concurrent.futures.ThreadPoolExecutor,
        loop_errors: list[dict[str, Any]],
        make: MakeCaller,
    ) -> None:
        caller = make(executor, 5.0)

        def fail() -> None:
            raise Boom("driver said no")

        for _ in range(3):  # and again: a failed call marks nothing hung
            with pytest.raises(Boom, match="driver said no"):
                await caller.call("k", fail)
        assert caller.hung == {} and caller.outstanding == 0
        await nothing_left_behind(loop_errors)

    async def test_a_timeout_the_function_raises_is_its_answer_not_a_hang(
        self,
        executor: concurrent.futures.ThreadPoolExecutor,
        make: MakeCaller,
    ) -> None:
        """A socket's or a subprocess's TimeoutError inside the call is what the call
        answered: the key is not marked hung and no hang is reported."""
        hangs: list[str] = []
        caller = make(executor, 5.0, on_hang=lambda key, timeout: hangs.append(key))

        def probe() -> None:
            raise TimeoutError("the probe's own socket timed out")

        with pytest.raises(TimeoutError, match="own socket"):
            await caller.call("k", probe)
        assert hangs == [] and caller.hung == {}
        assert await caller.call("k", str, 3) == "3"

    async def test_many_calls_at_once_each_get_their_own_answer(
        self,
        executor: concurrent.futures.ThreadPoolExecutor,
        make: MakeCaller,
    ) -> None:
        caller = make(executor, 5.0)
        answers = await asyncio.gather(*(caller.call(f"k{i}", pow, i, 2) for i in range(50)))
        assert answers == [i * i for i in range(50)]


class TestTimeout:
    async def test_times_out_marks_the_key_hung_and_recovers_when_it_returns(
        self,
        executor: concurrent.futures.ThreadPoolExecutor,
        loop_errors: list[dict[str, Any]],
        make: MakeCaller,
    ) -> None:
        hangs: list[tuple[str, float]] = []
        recoveries: list[str] = []
        caller = make(
            executor,
            0.2,
            on_hang=lambda key, timeout: hangs.append((key, timeout)),
            on_recover=lambda key, seconds: recoveries.append(key),
        )
        release = threading.Event()
        calls: list[int] = []

        def stuck() -> str:
            calls.append(1)
            release.wait(30)
            raise Boom("late")  # what it raises once the driver lets go is nobody's now

        try:
            with pytest.raises(CallTimedOut) as raised:
                await caller.call("nvml:gpu0", stuck)
            assert raised.value.key == "nvml:gpu0"
            assert hangs == [("nvml:gpu0", 0.2)]
            assert "nvml:gpu0" in caller.hung
            with pytest.raises(CallStillHung):  # at once, and no second thread
                await caller.call("nvml:gpu0", stuck)
            assert len(calls) == 1
            assert await caller.call("nvml:gpu1", str, 7) == "7"  # other keys go on
        finally:
            release.set()
        await until(lambda: caller.hung == {}, what="the hung call to return")
        assert recoveries == ["nvml:gpu0"]
        assert await caller.call("nvml:gpu0", str, 1) == "1"
        await nothing_left_behind(loop_errors)

    async def test_a_result_just_after_the_timeout_is_not_an_answer(
        self,
        executor: concurrent.futures.ThreadPoolExecutor,
        make: MakeCaller,
    ) -> None:
        caller = make(executor, 0.05)
        release = threading.Event()

        def slow() -> str:
            release.wait(30)
            return "late"

        try:
            with pytest.raises(CallTimedOut):
                await caller.call("k", slow)
        finally:
            release.set()
        await until(lambda: caller.outstanding == 0, what="the call to return")


class TestCancelled:
    async def test_a_cancelled_call_is_abandoned_not_repeated(
        self,
        executor: concurrent.futures.ThreadPoolExecutor,
        loop_errors: list[dict[str, Any]],
        make: MakeCaller,
    ) -> None:
        caller = make(executor, 5.0)
        started = threading.Event()
        release = threading.Event()

        def block() -> None:
            started.set()
            release.wait(30)
            raise Boom("after the round was cancelled")

        task = asyncio.create_task(caller.call("k", block))
        await until(started.is_set, what="the call to start")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert caller.outstanding == 1  # its thread still runs: not waited for at exit
        release.set()
        await until(lambda: caller.outstanding == 0, what="the thread to return")
        await nothing_left_behind(loop_errors)

    async def test_cancelled_while_queued(
        self, loop_errors: list[dict[str, Any]], make: MakeCaller
    ) -> None:
        """One worker, busy: the second call waits in the queue when its round is
        cancelled; it runs later (or never), and nothing is reported either way."""
        pool = concurrent.futures.ThreadPoolExecutor(1)
        caller = make(pool, 5.0)
        release = threading.Event()
        try:
            busy = asyncio.create_task(caller.call("a", release.wait, 30))
            queued = asyncio.create_task(caller.call("b", str, 1))
            await asyncio.sleep(0.05)
            queued.cancel()
            with pytest.raises(asyncio.CancelledError):
                await queued
            release.set()
            assert await busy is True
            await until(lambda: caller.outstanding == 0, what="the queued call to end")
            assert await caller.call("b", str, 2) == "2"
        finally:
            release.set()
            pool.shutdown(wait=True)
        assert loop_errors == []


async def test_a_call_that_ends_after_its_loop_closed_is_dropped_quietly(make: MakeCaller) -> None:
    """The agent stopped while a call hung: the thread ends later with nobody to tell."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    release = threading.Event()
    errors: list[BaseException] = []

    def run_loop() -> None:
        async def main() -> None:
            caller = make(pool, 0.05)
            with pytest.raises(CallTimedOut):
                await caller.call("k", release.wait, 30)

        try:
            asyncio.run(main())
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    thread = threading.Thread(target=run_loop)
    thread.start()
    thread.join(10)
    release.set()  # the hung call returns now, its loop closed
    pool.shutdown(wait=True)
    assert errors == []


async def test_a_call_to_a_pool_let_go_raises_and_leaves_nothing_behind(
    loop_errors: list[dict[str, Any]],
    make: MakeCaller,
) -> None:
    pool = CallPool(1, "t")
    pool.shutdown()
    caller = make(pool, 0.05)
    with pytest.raises(RuntimeError, match="after shutdown"):
        await caller.call("k", str, 1)
    await asyncio.sleep(0.2)  # past the timeout: no waiter is left for the sweeper
    await nothing_left_behind(loop_errors)
    assert caller.outstanding == 0 and caller.in_flight == 0


class TestOneTimerForAll:
    """The caller times out every call in flight with one timer: each call still ends at its
    own deadline, whatever else is in flight, whichever loop it runs on."""

    async def test_each_hung_call_times_out_at_its_own_deadline(
        self,
        executor: concurrent.futures.ThreadPoolExecutor,
        make: MakeCaller,
    ) -> None:
        caller = make(executor, 0.3)
        release = threading.Event()
        loop = asyncio.get_running_loop()

        async def timed(key: str, delay: float) -> float:
            await asyncio.sleep(delay)
            began = loop.time()
            with pytest.raises(CallTimedOut):
                await caller.call(key, release.wait, 30)
            return loop.time() - began

        try:
            # Staggered, and quick calls coming and going beside them.
            hung = asyncio.gather(timed("a", 0.0), timed("b", 0.1), timed("c", 0.2))
            for _ in range(20):
                assert await caller.call("quick", str, 1) == "1"
                await asyncio.sleep(0.01)
            took = await hung
        finally:
            release.set()
        for seconds in took:
            assert 0.3 <= seconds < 1.0, took

    async def test_a_shorter_timeout_set_while_a_call_is_in_flight_applies_to_the_next(
        self,
        executor: concurrent.futures.ThreadPoolExecutor,
        make: MakeCaller,
    ) -> None:
        """A reload can shorten the timeout of a caller whose earlier call still runs: the
        new call must not wait for the old call's later deadline."""
        caller = make(executor, 20.0)
        release = threading.Event()
        try:
            first = asyncio.create_task(caller.call("old", release.wait, 30))
            await asyncio.sleep(0.05)
            caller.timeout = 0.2
            began = time.monotonic()
            with pytest.raises(CallTimedOut):
                await caller.call("new", release.wait, 30)
            assert time.monotonic() - began < 2.0
        finally:
            release.set()
        assert await first is True

    async def test_a_call_queued_when_its_pool_is_let_go_is_cancelled_not_hung(
        self, make: MakeCaller
    ) -> None:
        """A stop or reload lets the pool go with cancel_futures: a call still queued never
        runs, and must not wait out its timeout to be reported as a hang."""
        pool = concurrent.futures.ThreadPoolExecutor(1)
        hangs: list[str] = []
        caller = make(pool, 5.0, on_hang=lambda key, timeout: hangs.append(key))
        release = threading.Event()
        try:
            busy = asyncio.create_task(caller.call("a", release.wait, 30))
            queued = asyncio.create_task(caller.call("b", str, 1))
            await asyncio.sleep(0.05)
            began = time.monotonic()
            pool.shutdown(wait=False, cancel_futures=True)
            with pytest.raises(asyncio.CancelledError):
                await queued
            assert time.monotonic() - began < 2.0
            assert hangs == []
        finally:
            release.set()
        assert await busy is True


def test_timeouts_still_fire_on_a_new_loop_after_one_stopped_mid_call(make: MakeCaller) -> None:
    """One caller, two loops in turn (a test harness, a command run twice): a call left
    hanging when the first loop ended must not keep the second loop's calls from timing out."""
    pool = concurrent.futures.ThreadPoolExecutor(4)
    caller = make(pool, 0.2)
    release = threading.Event()

    async def leave_one_hanging() -> None:
        task = asyncio.create_task(caller.call("first", release.wait, 30))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    async def then_time_out() -> float:
        began = time.monotonic()
        with pytest.raises(CallTimedOut):
            await caller.call("second", release.wait, 30)
        return time.monotonic() - began

    try:
        asyncio.run(leave_one_hanging())
        assert asyncio.run(asyncio.wait_for(then_time_out(), 5)) < 2.0
    finally:
        release.set()
        pool.shutdown(wait=True)


class TestCallEach:
    """Several calls side by side (one per GPU): each answer or exception, in order."""

    async def test_answers_and_exceptions_in_order(
        self, executor: concurrent.futures.ThreadPoolExecutor, make: MakeCaller
    ) -> None:
        caller = make(executor, 0.3)
        release = threading.Event()

        def fail() -> None:
            raise Boom("no")

        try:
            calls: list[Call[Any]] = [
                ("a", pow, (2, 3)),
                ("hangs", release.wait, (30,)),
                ("b", fail, ()),
            ]
            first = await caller.call_each(calls)
            assert first[0] == 8 and isinstance(first[1], CallTimedOut)
            assert isinstance(first[2], Boom)
            again = await caller.call_each([("hangs", str, (1,)), ("a", str, (2,))])
            assert isinstance(again[0], CallStillHung) and again[1] == "2"
        finally:
            release.set()
        await until(lambda: caller.outstanding == 0, what="the hung call to return")
        assert caller.in_flight == 0

    async def test_cancelled_every_call_still_running_stays_its_keys(
        self,
        executor: concurrent.futures.ThreadPoolExecutor,
        make: MakeCaller,
        loop_errors: list[dict[str, Any]],
    ) -> None:
        """A round cancelled while its calls run (a reload, a stop): none of them is started
        again beside itself, and nothing is left for the loop to complain about."""
        caller = make(executor, 5.0)
        release = threading.Event()
        runs: list[str] = []

        def block(key: str) -> str:
            runs.append(key)
            release.wait(30)
            raise Boom(f"{key} after the round was cancelled")

        keys = ["gpu0", "gpu1", "gpu2"]
        task = asyncio.create_task(caller.call_each([(k, block, (k,)) for k in keys]))
        await until(lambda: len(runs) == 3, what="the three calls to start")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert caller.outstanding == 3 and caller.in_flight == 0
        second = asyncio.create_task(caller.call_each([(k, block, (k,)) for k in keys]))
        await asyncio.sleep(0.1)
        assert sorted(runs) == keys  # each key waits for its own call: no second thread
        release.set()
        assert [str(outcome) for outcome in await second] == [
            f"{k} after the round was cancelled" for k in keys
        ]
        assert len(runs) == 6
        await until(lambda: caller.outstanding == 0, what="the threads to return")
        await nothing_left_behind(loop_errors)


@contextlib.asynccontextmanager
async def loop_stalls() -> AsyncIterator[list[float]]:
    """How long the loop stood still while the body ran: the gaps between the ticks of a task
    that ticks every 10 ms (filled in when the body is done)."""
    loop = asyncio.get_running_loop()
    ticks: list[float] = []
    gaps: list[float] = []

    async def tick() -> None:
        while True:
            ticks.append(loop.time())
            await asyncio.sleep(0.01)

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.05)
    try:
        yield gaps
        await asyncio.sleep(0.05)  # a tick after the last stall, to measure it
    finally:
        ticker.cancel()
        gaps.extend(b - a for a, b in itertools.pairwise(ticks))


class TestWaitInPlace:
    """A caller that waits in place (the GPU collector's) blocks the loop's thread for at most
    its window: one window for all the calls of a round (`call_each`)."""

    async def test_the_calls_of_a_round_run_side_by_side_not_one_after_another(self) -> None:
        pool = CallPool(4, "t")
        caller = PooledCaller(pool, 5.0, wait_in_place=1.0)

        def read(index: int) -> int:
            time.sleep(0.3)
            return index

        began = time.monotonic()
        try:
            answers = await caller.call_each([(f"nvml:gpu{i}", read, (i,)) for i in range(4)])
        finally:
            pool.shutdown()
        assert answers == [0, 1, 2, 3]
        assert time.monotonic() - began < 1.0  # one after another: 1.2 s

    async def test_calls_side_by_side_block_the_loop_for_one_window_not_one_each(
        self, executor: concurrent.futures.ThreadPoolExecutor
    ) -> None:
        caller = PooledCaller(executor, 1.5, wait_in_place=0.3)
        release = threading.Event()
        try:
            async with loop_stalls() as gaps:
                outcomes = await caller.call_each(
                    [(f"nvml:gpu{i}", release.wait, (30,)) for i in range(4)]
                )
        finally:
            release.set()
        assert all(isinstance(outcome, CallTimedOut) for outcome in outcomes), outcomes
        # The loop stood still for one window in all (a window for each: 1.2 s).
        stalls = [gap for gap in gaps if gap > 0.1]
        assert sum(stalls) < 0.75, stalls

    async def test_the_loop_is_blocked_no_longer_than_the_window(
        self, executor: concurrent.futures.ThreadPoolExecutor
    ) -> None:
        """A call that hangs blocks the loop for the window, then the loop runs on (its
        heartbeat, /metrics, the kernel log) until the call times out."""
        caller = PooledCaller(executor, 1.0, wait_in_place=0.05)
        release = threading.Event()
        try:
            async with loop_stalls() as gaps:
                with pytest.raises(CallTimedOut):
                    await caller.call("nvml:gpu0", release.wait, 30)
        finally:
            release.set()
        assert len(gaps) > 20 and max(gaps) < 0.4, max(gaps)

    async def test_a_window_longer_than_the_timeout_ends_at_the_timeout(
        self, executor: concurrent.futures.ThreadPoolExecutor
    ) -> None:
        caller = PooledCaller(executor, 0.2, wait_in_place=30.0)
        release = threading.Event()
        began = time.monotonic()
        try:
            with pytest.raises(CallTimedOut):
                await caller.call("k", release.wait, 30)
        finally:
            release.set()
        assert time.monotonic() - began < 2.0
        await until(lambda: caller.outstanding == 0, what="the call to return")

    async def test_answers_as_the_window_closes_each_arrive_once(
        self,
        executor: concurrent.futures.ThreadPoolExecutor,
        loop_errors: list[dict[str, Any]],
    ) -> None:
        """Answers that come just before, at and just after the end of the window: each is
        the call's answer, taken in place or through the loop, never lost or given twice."""
        caller = PooledCaller(executor, 5.0, wait_in_place=0.001)

        def answer(i: int) -> int:
            time.sleep((i % 5) * 0.0005)  # 0 to 2 ms around a 1 ms window
            if i % 7 == 0:
                raise Boom(str(i))
            return i

        for i in range(300):
            if i % 7 == 0:
                with pytest.raises(Boom, match=f"^{i}$"):
                    await caller.call("k", answer, i)
            else:
                assert await caller.call("k", answer, i) == i
        assert caller.in_flight == 0 and caller.outstanding == 0
        await nothing_left_behind(loop_errors)


class TestHandoff:
    """The two ways an answer reaches a caller that waited in place, whatever the order of the
    pool thread's done callback and the end of the window."""

    def test_an_answer_as_the_window_closes_is_taken_in_place(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        loop = asyncio.new_event_loop()
        try:
            waiter: asyncio.Future[int] = loop.create_future()
            handoff = _Handoff(loop, waiter)
            answered: concurrent.futures.Future[int] = concurrent.futures.Future()
            answered.set_result(7)
            ready = threading.Lock()
            ready.acquire()

            class ClosingWindow:
                """The timed wait gives up, and the answer lands right after it."""

                def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
                    if blocking and timeout != -1:
                        handoff.done(answered)
                        return False
                    return ready.acquire(blocking, timeout)

                def release(self) -> None:
                    ready.release()

            monkeypatch.setattr(handoff, "_ready", ClosingWindow())
            assert handoff.taken_in_place(0.01) is True
            loop.run_until_complete(asyncio.sleep(0))
            assert not waiter.done()  # not delivered a second time through the loop
        finally:
            loop.close()

    def test_an_answer_after_the_window_goes_through_the_loop(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            waiter: asyncio.Future[int] = loop.create_future()
            handoff = _Handoff(loop, waiter)
            assert handoff.taken_in_place(0.001) is False
            answered: concurrent.futures.Future[int] = concurrent.futures.Future()
            answered.set_result(7)
            threading.Thread(target=handoff.done, args=(answered,)).start()
            assert loop.run_until_complete(asyncio.wait_for(waiter, 5)) == 7
        finally:
            loop.close()


class TestCallPool:
    """The collectors' pool (agent/runtime/blocking.py CallPool): a thread is idle again
    before the caller hears the answer, so a round's next call never starts another."""

    async def test_sequential_calls_run_on_one_thread(self, make: MakeCaller) -> None:
        pool = CallPool(8, "t")
        caller = make(pool, 5.0)
        names: set[str] = set()
        try:
            for _ in range(300):  # each call made the moment the last one answered
                names.add(await caller.call("k", lambda: threading.current_thread().name))
        finally:
            pool.shutdown()
        assert len(names) == 1, names

    def test_a_thread_is_idle_before_its_answer_is_out(self) -> None:
        """What the loop hears through the future's done callback finds the thread idle
        already: the round's next call reuses it (ThreadPoolExecutor counts it idle only
        after every callback, so the next call started another thread under load)."""
        pool = CallPool(8, "t")
        release = threading.Event()
        seen: list[int] = []
        try:
            future = pool.submit(release.wait, 5)
            future.add_done_callback(lambda done: seen.append(pool.idle))
            release.set()
            assert future.result(5) is True
            assert seen == [1]
            assert pool.threads == 1
        finally:
            pool.shutdown()

    async def test_busy_threads_grow_the_pool_to_its_bound_then_calls_queue(
        self, make: MakeCaller
    ) -> None:
        pool = CallPool(3, "t")
        caller = make(pool, 5.0)
        release = threading.Event()
        try:
            held = [asyncio.create_task(caller.call(f"k{i}", release.wait, 30)) for i in range(3)]
            await until(lambda: pool.threads == 3, what="three threads")
            queued = asyncio.create_task(caller.call("q", str, 5))
            await asyncio.sleep(0.1)
            assert not queued.done() and pool.threads == 3  # bounded: it waits for a thread
            release.set()
            assert await queued == "5"
            assert await asyncio.gather(*held) == [True, True, True]
            assert pool.threads == 3
        finally:
            release.set()
            pool.shutdown()

    def test_the_thread_idle_last_takes_the_next_call(self) -> None:
        pool = CallPool(4, "t")
        release = [threading.Event() for _ in range(2)]
        try:
            first = pool.submit(lambda: (release[0].wait(5), threading.current_thread().name))
            second = pool.submit(lambda: (release[1].wait(5), threading.current_thread().name))
            release[0].set()
            name_first = first.result(5)[1]
            time.sleep(0.05)
            release[1].set()
            name_second = second.result(5)[1]
            time.sleep(0.05)
            # Both idle now, the second one last: it takes the next call.
            assert pool.submit(lambda: threading.current_thread().name).result(5) == name_second
            assert name_first != name_second
        finally:
            for event in release:
                event.set()
            pool.shutdown()

    def test_answers_and_exceptions_through_the_future(self) -> None:
        pool = CallPool(2, "t")
        try:
            assert pool.submit(pow, 2, 10).result(5) == 1024
            with pytest.raises(Boom):
                pool.submit(lambda: (_ for _ in ()).throw(Boom("no"))).result(5)
            assert pool.submit(str, 1).result(5) == "1"  # the thread survived the exception
        finally:
            pool.shutdown()

    def test_shutdown_cancels_what_waits_and_lets_idle_threads_go(self) -> None:
        pool = CallPool(1, "t")
        release = threading.Event()
        running = pool.submit(release.wait, 30)
        waiting = pool.submit(str, 1)
        pool.shutdown(wait=False, cancel_futures=True)
        assert waiting.cancelled()
        with pytest.raises(RuntimeError, match="after shutdown"):
            pool.submit(str, 2)
        release.set()
        assert running.result(5) is True
        pool.shutdown(wait=True)  # the busy thread ends after its call
        assert all(not t.is_alive() for t in threading.enumerate() if t.name == "t_0")

    def test_a_stuck_call_does_not_keep_the_process_from_exiting(self) -> None:
        code = (
            "import threading\n"
            "from agent.runtime.blocking import CallPool\n"
            "pool = CallPool(1, 'stuck')\n"
            "pool.submit(threading.Event().wait)\n"
            "print('exiting')\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True
        )
        assert out.stdout.strip() == "exiting"
