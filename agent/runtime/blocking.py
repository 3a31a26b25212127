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

A caller may wait for a quick answer in place (`wait_in_place`): the loop's thread blocks on a
lock for at most that long before it goes back to the loop and awaits the answer as usual. On
the lent H200 the hand-off to the pool thread and back costs a steady GPU round about as much
as its NVML calls do; waiting in place skips the loop's part of the way back (the wake through
its self-pipe, the task's resumption), which took a tenth off the round (bench/gpu_handoff.py).
A round of several calls that should run side by side (one per GPU) starts them all before it
waits for any (`call_each`), and blocks the loop for one window in all. Whatever the calls do,
the loop is blocked no longer, so a hung call still times out while heartbeats, /metrics and
the kernel log go on.
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, ParamSpec, TypeVar

from agent.contracts.collector import Call
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


class _Handoff:
    """A call's answer for a caller that waits in place: the pool thread's done callback
    releases a lock the loop's thread waits on. Once the loop stops waiting, the answer is
    delivered like any other (`_deliver`); the guard decides which of the two happens."""

    __slots__ = ("_guard", "_in_place", "_loop", "_ready", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop, waiter: asyncio.Future[Any]) -> None:
        self._loop = loop
        self._waiter = waiter
        self._ready = threading.Lock()
        self._ready.acquire()
        self._guard = threading.Lock()
        self._in_place = True

    def done(self, future: concurrent.futures.Future[Any]) -> None:
        """The pool future's done callback (in the pool thread, or on the loop when the call
        ended before the callback was added)."""
        with self._guard:
            if self._in_place:
                self._ready.release()
                return
        _deliver(self._loop, self._waiter, future)

    def taken_in_place(self, window: float) -> bool:
        """Block this thread up to `window` seconds for the answer. False: none came, and it
        will reach the waiter through the loop instead."""
        if self._ready.acquire(timeout=window):
            return True
        with self._guard:
            if self._ready.acquire(blocking=False):  # it came as the window closed
                return True
            self._in_place = False
            return False


def _answer(done: concurrent.futures.Future[T]) -> T:
    """A finished pool future's outcome, as awaiting its waiter would give it."""
    if done.cancelled():  # queued when its pool was let go: never ran (see `_settle`)
        raise asyncio.CancelledError
    return done.result()


@dataclass(slots=True, eq=False)
class _Pending(Generic[T]):
    """A call started and not yet waited for."""

    key: str
    loop: asyncio.AbstractEventLoop
    waiter: asyncio.Future[T]
    future: concurrent.futures.Future[T]
    started: float
    """Monotonic."""
    handoff: _Handoff | None
    """None: the answer is awaited through the loop (no wait in place)."""
    in_place_until: float
    """Monotonic: the end of the window to wait in place."""


def _retrieve(done: asyncio.Future[Any]) -> None:
    if not done.cancelled():
        done.exception()


class PooledCaller:
    """A `BlockingCaller` for one collector, on a thread pool shared by all of them.

    `wait_in_place`: seconds the loop's thread may block on each call for its answer before
    it awaits it (0: never block; see the module's docstring)."""

    def __init__(
        self,
        executor: concurrent.futures.Executor,
        timeout: float,
        on_hang: HangListener | None = None,
        on_recover: HangListener | None = None,
        *,
        wait_in_place: float = 0.0,
    ) -> None:
        self._executor = executor
        self.timeout = timeout
        self.wait_in_place = wait_in_place
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
        return await self._finish(await self._start(key, fn, args, kwargs))

    async def call_each(self, calls: Sequence[Call[T]]) -> list[T | Exception]:
        """Start every call, then wait for each: the answer, or the exception it ended with
        (`CallStillHung`, `CallTimedOut`, the function's own), in the order of `calls`. The
        calls run side by side, and a caller that waits in place blocks the loop for at most
        one window for all of them."""
        pending: list[_Pending[T] | Exception] = []
        outcomes: list[T | Exception] = []
        waiting = False
        try:
            for key, fn, args in calls:
                try:
                    pending.append(await self._start(key, fn, args, {}))
                except Exception as exc:
                    pending.append(exc)
            waiting = True
            for call in pending:
                if isinstance(call, Exception):
                    outcomes.append(call)
                    continue
                try:
                    answer: T = await self._finish(call)
                except Exception as exc:
                    outcomes.append(exc)
                else:
                    outcomes.append(answer)
        except asyncio.CancelledError:
            # The call being waited for abandoned itself (`_finish`); the rest never were.
            for call in pending[len(outcomes) + 1 if waiting else 0 :]:
                if not isinstance(call, Exception):
                    self._drop(call)
            raise
        return outcomes

    async def _start(
        self, key: str, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> _Pending[T]:
        started = self._hung.get(key)
        if started is not None:
            raise CallStillHung(key, time.monotonic() - started)
        loop = asyncio.get_running_loop()
        if key in self._abandoned:
            await self._wait_abandoned(key, loop)
        # Everything the loop needs is made before the thread starts, and the answer comes
        # from the pool future's done callback (after a CallPool has counted the thread idle
        # again): taken in place, or in one turn of the loop to settle and one to resume. The
        # round of every GPU makes such a call; the hand-off is most of what a steady round
        # costs beyond the NVML calls (bench/gpu_round.py). One timer for all calls in
        # flight, not one per call: a steady round's calls return in microseconds.
        waiter: asyncio.Future[T] = loop.create_future()
        self._deadlines[waiter] = deadline = loop.time() + self.timeout
        self._arm(loop, deadline)
        started = time.monotonic()
        window = min(self.wait_in_place, self.timeout)
        try:
            future = self._executor.submit(fn, *args, **kwargs)  # raises once the pool is let go
        except BaseException:
            del self._deadlines[waiter]
            raise
        handoff = None
        if window > 0:
            handoff = _Handoff(loop, waiter)
            future.add_done_callback(handoff.done)
        else:
            future.add_done_callback(functools.partial(_deliver, loop, waiter))
        return _Pending(key, loop, waiter, future, started, handoff, started + window)

    async def _finish(self, call: _Pending[T]) -> T:
        try:
            if call.handoff is not None and call.handoff.taken_in_place(
                max(call.in_place_until - time.monotonic(), 0.0)
            ):
                return _answer(call.future)
            return await call.waiter
        except _Expired:
            self._mark_hung(call.key, call.started, call.future, call.loop)
            raise CallTimedOut(call.key, self.timeout) from None
        except asyncio.CancelledError:
            # The round was cancelled (a stop, a reload): the thread finishes later, and
            # stays this key's call until then.
            self._abandon(call.key, call.started, call.future, call.loop)
            raise
        finally:
            del self._deadlines[call.waiter]

    def _drop(self, call: _Pending[Any]) -> None:
        """A call started but never waited for (its round was cancelled first)."""
        call.waiter.cancel()
        del self._deadlines[call.waiter]
        self._abandon(call.key, call.started, call.future, call.loop)

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
