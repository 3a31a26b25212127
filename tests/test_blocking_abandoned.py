"""PooledCaller: a call whose round was cancelled before its timeout (a reload, a stop, a round
over its limit) is still the key's call: the next call waits for it, never starts a second
thread beside it, and reports it hung once its timeout has passed."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

from agent.contracts.errors import CallTimedOut
from agent.runtime.blocking import PooledCaller
from tests.support.waiting import until


class TestAbandonedCall:
    """PooledCaller: a call whose awaiting round was cancelled is still the key's call."""

    async def test_waits_for_the_abandoned_call_then_reports_it_hung(self) -> None:
        executor = concurrent.futures.ThreadPoolExecutor(2)
        hangs: list[str] = []
        caller = PooledCaller(executor, 0.3, on_hang=lambda key, timeout: hangs.append(key))
        release = threading.Event()
        entered: list[float] = []

        def block() -> None:
            entered.append(time.monotonic())
            release.wait(30)

        try:
            first = asyncio.create_task(caller.call("k", block))
            await until(lambda: bool(entered), what="the call to start")
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
            assert caller.outstanding == 1
            began = time.monotonic()
            try:
                await caller.call("k", block)
            except CallTimedOut:
                pass
            else:
                raise AssertionError("the second call must time out on the first one")
            assert len(entered) == 1
            assert hangs == ["k"]
            assert "k" in caller.hung
            assert time.monotonic() - began < 2.0  # what was left of the timeout, not more
            release.set()
            await until(lambda: caller.outstanding == 0, what="the thread to return")
            assert caller.hung == {}
            release.clear()
            entered.clear()
            release.set()
            await caller.call("k", block)  # a new call once the old one is done
            assert len(entered) == 1
        finally:
            release.set()
            executor.shutdown(wait=False, cancel_futures=True)

    async def test_an_abandoned_call_that_returns_in_time_is_no_hang(self) -> None:
        executor = concurrent.futures.ThreadPoolExecutor(2)
        caller = PooledCaller(executor, 1.0)
        release = threading.Event()
        calls: list[int] = []

        def work() -> int:
            calls.append(1)
            release.wait(5)
            return len(calls)

        try:
            first = asyncio.create_task(caller.call("k", work))
            await until(lambda: bool(calls), what="the call to start")
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
            second = asyncio.create_task(caller.call("k", work))
            await asyncio.sleep(0.1)
            assert len(calls) == 1  # waiting for the first
            release.set()
            assert await second == 2  # its own call ran after the first returned
            assert caller.hung == {}
        finally:
            release.set()
            executor.shutdown(wait=False, cancel_futures=True)
