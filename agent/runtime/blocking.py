"""Blocking calls off the event loop: a bounded thread pool, a timeout per call, no pile-up.

A call that times out leaves its thread running (Python cannot kill a thread stuck in a driver
or in statvfs on a dead NFS server). Its key is marked hung: further calls with that key fail at
once with `CallStillHung` until the old call returns, so one stuck resource holds one thread,
never one more per round.

A call whose round is cancelled before its timeout (a reload restarting the collector, a stop,
a round over its limit) also leaves its thread running. It stays the key's call: the next call
with that key waits for it for what is left of its timeout and then, if it still runs, marks it
hung; it never starts a second thread beside it. The runtime keeps one PooledCaller per
collector across restarts of that collector, so a reload forgets neither.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from agent.contracts.errors import CallStillHung, CallTimedOut

P = ParamSpec("P")
T = TypeVar("T")

HangListener = Callable[[str, float], None]


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    """Hand a late result to the loop, unless the loop is gone (the agent stopped while the
    call hung): then there is nobody left to tell."""
    with contextlib.suppress(RuntimeError):  # "Event loop is closed"
        loop.call_soon_threadsafe(fn, *args)


class _Expired(Exception):
    """Set on a call's waiter when its timeout passed before the thread answered. A class of
    its own, so that a TimeoutError the function itself raises (a socket's) is its answer,
    not a hang."""


def _deliver(
    loop: asyncio.AbstractEventLoop,
    waiter: asyncio.Future[Any],
    done: concurrent.futures.Future[Any],
) -> None:
    """The pool future's done callback, in the pool thread (or on the loop, when the call had
    ended before the callback was added): the answer goes to the loop."""
    _call_soon(loop, _settle, waiter, done)


def _settle(waiter: asyncio.Future[Any], done: concurrent.futures.Future[Any]) -> None:
    """On the loop: the thread's answer, unless the waiter timed out or was cancelled first
    (the answer is nobody's then). A call still queued when its pool was let go never ran:
    its waiter is cancelled at once, not left to time out as a false hang."""
    if waiter.done():
        return
    if done.cancelled():
        waiter.cancel()
        return
    exc = done.exception()
    if exc is None:
        waiter.set_result(done.result())
    else:
        waiter.set_exception(exc)


def _retrieve(done: asyncio.Future[Any]) -> None:
    if not done.cancelled():
        done.exception()


class PooledCaller:
    """A `BlockingCaller` for one collector, on a thread pool shared by all of them."""

    def __init__(
        self,
        executor: concurrent.futures.Executor,
        timeout: float,
        on_hang: HangListener | None = None,
        on_recover: HangListener | None = None,
    ) -> None:
        self._executor = executor
        self.timeout = timeout
        self._hung: dict[str, float] = {}
        self._abandoned: dict[str, tuple[float, concurrent.futures.Future[Any]]] = {}
        """Calls still running whose caller was cancelled before their timeout."""
        self._on_hang = on_hang
        self._on_recover = on_recover
        self._deadlines: dict[asyncio.Future[Any], float] = {}
        """Waiters of calls in flight -> when their timeout passes (the loop's clock)."""
        self._sweeper: asyncio.TimerHandle | None = None
        self._sweeper_loop: asyncio.AbstractEventLoop | None = None

    @property
    def hung(self) -> dict[str, float]:
        """Keys of calls still running past their timeout -> monotonic time they started."""
        return dict(self._hung)

    @property
    def in_flight(self) -> int:
        """Calls awaited now (each with its deadline)."""
        return len(self._deadlines)

    @property
    def outstanding(self) -> int:
        """Threads running a call nobody awaits any more: hung, or abandoned by a cancelled
        round. The process must not wait for them at exit."""
        return len(self._hung) + len(self._abandoned)

    async def call(self, key: str, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        started = self._hung.get(key)
        if started is not None:
            raise CallStillHung(key, time.monotonic() - started)
        loop = asyncio.get_running_loop()
        if key in self._abandoned:
            await self._wait_abandoned(key, loop)
        # Everything the loop needs is made before the thread starts, and the answer comes
        # from the pool future's done callback (after a CallPool has counted the thread idle
        # again): one turn of the loop to settle, one to resume. The round of every GPU makes
        # such a call; the hand-off is most of what a steady round costs beyond the NVML calls
        # (bench/gpu_round.py). One timer for all calls in flight, not one per call: a steady
        # round's calls return in microseconds.
        waiter: asyncio.Future[T] = loop.create_future()
        self._deadlines[waiter] = deadline = loop.time() + self.timeout
        self._arm(loop, deadline)
        started = time.monotonic()
        try:
            future = self._executor.submit(fn, *args, **kwargs)  # raises once the pool is let go
            future.add_done_callback(functools.partial(_deliver, loop, waiter))
            return await waiter
        except _Expired:
            self._mark_hung(key, started, future, loop)
            raise CallTimedOut(key, self.timeout) from None
        except asyncio.CancelledError:
            # The round was cancelled (a stop, a reload): the thread finishes later, and
            # stays this key's call until then.
            self._abandon(key, started, future, loop)
            raise
        finally:
            del self._deadlines[waiter]

    def _arm(self, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        """The sweeper runs by `deadline` (a shorter timeout set by a reload comes earlier)."""
        sweeper = self._sweeper
        if sweeper is not None and self._sweeper_loop is loop and sweeper.when() <= deadline:
            return
        if sweeper is not None:
            sweeper.cancel()
        self._sweeper = loop.call_at(deadline, self._sweep, loop)
        self._sweeper_loop = loop

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        """Time out every call past its deadline; run again by the next one in flight."""
        self._sweeper = self._sweeper_loop = None
        now = loop.time()
        for waiter, deadline in list(self._deadlines.items()):
            if waiter.get_loop() is not loop:  # a loop that stopped while its call hung
                if waiter.get_loop().is_closed():
                    del self._deadlines[waiter]
                continue
            if deadline <= now and not waiter.done():
                waiter.set_exception(_Expired())
        later = [
            deadline
            for waiter, deadline in self._deadlines.items()
            if deadline > now and waiter.get_loop() is loop
        ]
        if later:
            self._arm(loop, min(later))

    def _abandon(
        self,
        key: str,
        started: float,
        future: concurrent.futures.Future[Any],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        if future.done():
            return
        self._abandoned[key] = (started, future)
        future.add_done_callback(lambda done: _call_soon(loop, self._abandoned_done, key, done))

    def _abandoned_done(self, key: str, done: concurrent.futures.Future[Any]) -> None:
        entry = self._abandoned.get(key)
        if entry is not None and entry[1] is done:
            del self._abandoned[key]

    async def _wait_abandoned(self, key: str, loop: asyncio.AbstractEventLoop) -> None:
        """Wait for the key's abandoned call for what is left of its timeout. Its result is
        not ours (other arguments, another round): only its end is waited for. Still running
        then, it is hung, reported as such, and this call raises CallTimedOut."""
        started, future = self._abandoned[key]
        left = self.timeout - (time.monotonic() - started)
        waiter = asyncio.wrap_future(future)
        waiter.add_done_callback(_retrieve)
        # asyncio.wait, not wait_for: it neither raises what the old call raised nor cancels
        # it when this round is cancelled in turn.
        await asyncio.wait([waiter], timeout=max(left, 0.0))
        if future.done():
            self._abandoned_done(key, future)
            return
        if key in self._hung:  # another caller of this key got here first
            raise CallStillHung(key, time.monotonic() - self._hung[key])
        self._abandoned_done(key, future)
        self._mark_hung(key, started, future, loop)
        raise CallTimedOut(key, self.timeout)

    def _mark_hung(
        self,
        key: str,
        started: float,
        future: concurrent.futures.Future[Any],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._hung[key] = started
        future.add_done_callback(lambda done: _call_soon(loop, self._recovered, key, started, done))
        if self._on_hang is not None:
            self._on_hang(key, self.timeout)

    def _recovered(self, key: str, started: float, done: concurrent.futures.Future[Any]) -> None:
        if self._hung.get(key) == started:
            del self._hung[key]
        if done.cancelled():
            # Still queued when its pool was let go (a stop, a reload): it never ran, so
            # nothing returned, and `exception()` would raise in the loop's callback.
            return
        done.exception()  # retrieve it, so a late failure is not logged as never retrieved
        if self._on_recover is not None:
            self._on_recover(key, time.monotonic() - started)


_Job = tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class CallPool(concurrent.futures.Executor):
    """At most `size` threads for one collector's blocking calls.

    ThreadPoolExecutor counts a thread idle only after the call's future is done, so a round
    that is told its answer and makes its next call at once often finds no idle thread and
    starts another (a reload test saw the pool grow under load). Here a thread is idle again
    before the future is done (the answer reaches PooledCaller from the done callback), and a
    new thread starts only when every thread is busy. The thread that went idle last takes the
    next call: sequential calls run on one thread, its stack and caches warm.

    Threads are daemons: one stuck in a driver or on a dead file server must not keep the
    process from exiting (the agent exits at once when calls are outstanding)."""

    def __init__(self, size: int, name: str) -> None:
        if size < 1:
            raise ValueError(f"a pool needs at least one thread, got {size}")
        self._size = size
        self._name = name
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._workers: list[_Worker] = []
        self._backlog: deque[_Job] = deque()
        self._shut = False

    @property
    def threads(self) -> int:
        """Threads started so far (busy or idle)."""
        with self._lock:
            return len(self._workers)

    @property
    def idle(self) -> int:
        """Threads waiting for a call."""
        with self._lock:
            return len(self._idle)

    def submit(
        self, fn: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        job: _Job = (future, fn, args, kwargs)
        with self._lock:
            if self._shut:
                raise RuntimeError("cannot schedule new calls after shutdown")
            if self._idle:
                self._idle.pop().inbox.put(job)
            elif len(self._workers) < self._size:
                worker = _Worker(self, f"{self._name}_{len(self._workers)}")
                self._workers.append(worker)
                worker.inbox.put(job)
                worker.thread.start()
            else:
                self._backlog.append(job)
        return future

    def _next(self, worker: _Worker) -> None:
        """A worker's call ended: the next queued call to it, or it is idle (or it ends)."""
        with self._lock:
            if self._backlog:
                worker.inbox.put(self._backlog.popleft())
            elif self._shut:
                worker.inbox.put(None)
            else:
                self._idle.append(worker)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._shut = True
            backlog = list(self._backlog) if cancel_futures else []
            if cancel_futures:
                self._backlog.clear()
            idle, self._idle = self._idle, []
            workers = list(self._workers)
        for future, *_ in backlog:
            future.cancel()
        for worker in idle:
            worker.inbox.put(None)
        if wait:
            for worker in workers:
                worker.thread.join()


class _Worker:
    def __init__(self, pool: CallPool, name: str) -> None:
        self.pool = pool
        self.inbox: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        while (job := self.inbox.get()) is not None:
            future, fn, args, kwargs = job
            del job
            if not future.set_running_or_notify_cancel():
                self.pool._next(self)
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                self.pool._next(self)  # idle before the answer is out: see CallPool
                future.set_exception(exc)
                del exc
            else:
                self.pool._next(self)
                future.set_result(result)
                del result
            del future, fn, args, kwargs
