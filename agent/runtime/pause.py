"""The runtime's side of a pause: who is asked to let go of the GPUs, until when, and the end.

`PauseControl.pause` asks every running `PausableCollector` (agent/contracts/pause.py) to
release the GPUs, all at once, and returns what each did; a pause already in force is
extended: its deadline moves, and every collector is asked again (one that did not let go
the first time tries again; one that did says it still holds nothing), so the answer is the
truth now. `resume` lifts it, wakes
each such collector for a round at once and returns that round's events (a GPU that did not
come back is one). A collector built while a pause is in force (a reload) is paused before
its first round.

Every pause ends: at its deadline the runtime resumes by itself, logs a warning and raises a
`gpu_resumed` event that says so. The pause is kept in the state store with its deadline and
the boot id: an agent restarted meanwhile (systemd restarting it, an upgrade) stays paused
until the same deadline, because the reset it was paused for may still be under way, and a
reboot ends it (the reset is over, whatever it was).

`history` (shared with the collectors) holds the pause in force and the last ended ones, kept
in the store too: the kernel-log collector judges a record by the pause it was logged in,
however late it is read (docs/pause.md, "Kernel-log findings during a pause").
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

import structlog

from agent.contracts.clock import StepWatch
from agent.contracts.collector import KeyValueStore
from agent.contracts.errors import GpuwardenError
from agent.contracts.model import Event, RepairAction, Severity
from agent.contracts.pause import (
    PausableCollector,
    PauseHistory,
    PauseSettings,
    PauseState,
    PauseWindow,
    Released,
)

if TYPE_CHECKING:
    from agent.runtime.core import CollectorStatus

log = structlog.get_logger(component="pause")

NAMESPACE: Final = "runtime"
KEY: Final = "gpu_pause"
HISTORY_KEY: Final = "gpu_pause_history"
HISTORY_KEPT: Final = 16
"""Ended pauses remembered (with the one in force): records logged in them and read later,
after the resume or by an agent restarted meanwhile, are still judged paused."""
RELEASE_BOUND: Final = 30.0
"""Seconds a collector may take to let go (its round in flight ends first)."""
FIRST_ROUND_BOUND: Final = 20.0
"""Seconds `resume` waits for the first rounds after the pause (a benchmark run that starts
right away is not waited for to its end)."""


class PauseRefused(GpuwardenError):
    """A pause the agent does not accept (a duration out of range)."""


@dataclass(frozen=True)
class PauseReply:
    state: PauseState
    extended: bool
    released: tuple[Released, ...]

    @property
    def ok(self) -> bool:
        return all(r.released for r in self.released)


@dataclass(frozen=True)
class ResumeReply:
    resumed: bool
    """False: there was no pause to end."""
    why: str = ""
    first_round: Mapping[str, tuple[Event, ...]] = field(default_factory=dict)
    """Collector -> the events its first round after the pause raised."""
    waited_out: tuple[str, ...] = ()
    """Collectors whose first round did not end within FIRST_ROUND_BOUND."""


class PauseControl:
    def __init__(
        self,
        store: KeyValueStore,
        settings: PauseSettings,
        boot_id: str,
        *,
        collectors: Callable[[], Mapping[str, CollectorStatus]],
        emit: Callable[[Event], None],
        flush: Callable[[], Awaitable[object]],
    ) -> None:
        """`flush`: store what the store guard holds now (in the runtime's store thread)."""
        self._store = store
        self._flush = flush
        self.settings = settings
        self._boot = boot_id
        self._collectors = collectors
        self._emit = emit
        self._lock = asyncio.Lock()
        self._deadline: asyncio.Task[None] | None = None
        self.state: PauseState | None = None
        self.released: dict[str, Released] = {}
        """What each collector said when it was last asked to let go (this pause)."""
        self.history = PauseHistory()
        """This pause and the last ended ones, shared with the collectors (a kernel-log
        record logged in one is judged by it, whenever it is read)."""
        self._ended: list[PauseWindow] = []
        self._restore_history()
        self._restore()
        self._publish()

    # -- persistence --------------------------------------------------------------------------

    def _restore(self) -> None:
        """The pause kept by an earlier run of the agent: in force again if this boot's and
        not past its deadline; otherwise gone, and said so."""
        try:
            stored = self._store.get(NAMESPACE, KEY)
        except GpuwardenError as exc:
            log.warning("stored pause not read; not paused", error=str(exc))
            return
        if stored is None:
            return
        try:
            if not isinstance(stored, dict):
                raise TypeError(f"expected an object, got {type(stored).__name__}")
            state = PauseState(
                float(stored["since"]),
                float(stored["until"]),
                str(stored.get("reason", "")),
                str(stored.get("by", "")),
            )
            boot = str(stored.get("boot", ""))
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("stored pause unreadable; dropped", error=str(exc))
            self._store.delete(NAMESPACE, KEY)
            return
        now = time.time()
        if self._boot and boot and boot != self._boot:
            self._store.delete(NAMESPACE, KEY)
            log.info("the pause of an earlier boot ended with the reboot")
            return
        if now >= state.until:
            self._store.delete(NAMESPACE, KEY)
            self._end_window(state, state.until)
            self._emit(self._resumed_event(state, "deadline", while_stopped=True))
            return
        self.state = state
        log.warning(
            "still paused after a restart: the GPUs stay released until the deadline",
            until=state.until,
            reason=state.reason,
        )

    def _restore_history(self) -> None:
        """The pauses that ended before this run; an unreadable entry is dropped, said once."""
        try:
            stored = self._store.get(NAMESPACE, HISTORY_KEY)
        except GpuwardenError as exc:
            log.warning(
                "pause history not read; records are judged by this run's pauses only",
                error=str(exc),
            )
            return
        self._ended, bad = ended_pauses(stored)
        if bad:
            log.warning("stored pause history: unreadable entries dropped", dropped=bad)

    def _end_window(self, state: PauseState, ended: float) -> None:
        """Remember the pause that ended (kept in the store, the last HISTORY_KEPT)."""
        self._ended.append(PauseWindow(state.since, ended, state.reason, state.by))
        self._ended = self._ended[-HISTORY_KEPT:]
        self._store.put(
            NAMESPACE,
            HISTORY_KEY,
            [
                {"since": w.since, "ended": w.ended, "reason": w.reason, "by": w.by}
                for w in self._ended
            ],
        )

    def _publish(self) -> None:
        """Hand the collectors the pauses as they are now: the ended ones and this one."""
        current = self.state
        live = [PauseWindow(current.since, None, current.reason, current.by)] if current else []
        self.history.replace([*live, *reversed(self._ended)])

    def _persist(self, state: PauseState) -> None:
        self._store.put(
            NAMESPACE,
            KEY,
            {
                "since": state.since,
                "until": state.until,
                "reason": state.reason,
                "by": state.by,
                "boot": self._boot,
            },
        )

    # -- pause --------------------------------------------------------------------------------

    def duration(self, seconds: float | None) -> float:
        if seconds is None:
            return self.settings.default_duration
        if not 0 < seconds <= self.settings.max_duration:
            raise PauseRefused(
                f"a pause lasts more than 0 and at most {self.settings.max_duration:g} s "
                f"([pause] max_duration), not {seconds:g} s"
            )
        return seconds

    async def pause(self, seconds: float | None, reason: str = "", by: str = "") -> PauseReply:
        length = self.duration(seconds)
        async with self._lock:
            now = time.time()
            earlier = self.state
            extended = earlier is not None
            since = earlier.since if earlier is not None else now
            # Asked again without a reason, the pause is still for what it was asked for (the
            # heartbeat, the notice and the kernel log's marks keep saying it).
            if earlier is not None and not reason:
                reason = earlier.reason
            state = PauseState(since, now + length, reason, by)
            self.state = state
            self._publish()  # a record logged from now on is the pause's, whoever reads it
            # Stored before letting go: an agent killed meanwhile comes back paused (and
            # `gpuwarden check` sees it), not up to a store-writer cycle later.
            self._persist(state)
            await self._flush()
            # All at once: every gate shuts before any of them waits for its round, so the
            # benchmark cannot start a child on a GPU while the gpu collector lets go (NVML
            # itself waits for the calls in flight, whoever made them).
            # Every one, paused already or not: asked again, a part that did not let go the
            # first time (a call or a child stuck in the driver) tries again and says how it
            # stands now, and the answer is this pause's, not what the first one said.
            todo = self._pausable()
            answers = await asyncio.gather(*(self._pause_one(s) for s in todo.values()))
            self.released = dict(zip(todo, answers, strict=True))
            self.arm()
            self._emit(
                Event(
                    source="runtime",
                    kind="gpu_paused",
                    severity=Severity.INFO,
                    repair_action=RepairAction.NONE,
                    subject="host",
                    message=(
                        f"GPU monitoring {'stays paused' if extended else 'paused'} on request "
                        f"until {_clock(state.until)} ({length:g} s)"
                        + (f": {reason}" if reason else "")
                        + (f" (by {by})" if by else "")
                    ),
                    action="gpuwarden resume when the GPU work is done; it resumes by itself "
                    "at the deadline",
                    attributes={
                        **state.to_dict(),
                        "extended": extended,
                        "not_released": ", ".join(
                            n for n, r in sorted(self.released.items()) if not r.released
                        ),
                    },
                )
            )
            return PauseReply(state, extended, tuple(self.released.values()))

    async def _pause_one(self, status: CollectorStatus) -> Released:
        collector = status.collector
        assert isinstance(collector, PausableCollector)
        try:
            released = await asyncio.wait_for(collector.pause(), RELEASE_BOUND)
        except TimeoutError:
            released = Released(status.name, False, f"did not let go within {RELEASE_BOUND:g} s")
        except Exception as exc:  # a bug in one collector must not leave the others holding
            log.exception("collector failed to pause", collector=status.name)
            released = Released(status.name, False, f"{type(exc).__name__}: {exc}")
        status.paused = True  # its gate is shut in any case: no new round uses the GPUs
        status.samples = ()  # its GPU series go now, not a round later
        (log.info if released.released else log.warning)(
            "collector paused",
            collector=status.name,
            released=released.released,
            detail=released.detail,
        )
        return released

    async def enter(self, status: CollectorStatus) -> None:
        """Before a collector's first round: one built while paused (a reload, or a start
        with a pause kept from the last run) is paused first."""
        if self.state is None or not isinstance(status.collector, PausableCollector):
            return
        async with self._lock:
            if self.state is not None and not status.paused:
                self.released[status.name] = await self._pause_one(status)

    def _pausable(self) -> dict[str, CollectorStatus]:
        return {
            name: status
            for name, status in self._collectors().items()
            if isinstance(status.collector, PausableCollector)
        }

    # -- resume -------------------------------------------------------------------------------

    async def resume(self, why: str = "requested", by: str = "") -> ResumeReply:
        async with self._lock:
            state = self.state
            if state is None:
                return ResumeReply(False)
            self.state = None
            self.released = {}
            # Ended before any collector resumes: a record the GPUs log from here is theirs.
            self._end_window(state, time.time())
            self._publish()
            self._store.delete(NAMESPACE, KEY)
            await self._flush()
            if self._deadline is not None and self._deadline is not asyncio.current_task():
                self._deadline.cancel()
            self._deadline = None
            lifted = time.monotonic()
            resumed: dict[str, tuple[CollectorStatus, float]] = {}
            for name, status in self._pausable().items():
                collector = status.collector
                assert isinstance(collector, PausableCollector)
                try:
                    await asyncio.wait_for(collector.resume(), RELEASE_BOUND)
                except Exception:
                    log.exception("collector failed to resume", collector=name)
                status.paused = False
                # Its first round is one that begins from now: one in flight began paused.
                resumed[name] = (status, time.monotonic())
                status.wake.set()  # its first round now, not an interval later
            self._emit(self._resumed_event(state, why, by=by))
        first, late = await _first_rounds(resumed, self._collectors, lifted)
        return ResumeReply(True, why, first, late)

    def _resumed_event(
        self, state: PauseState, why: str, *, by: str = "", while_stopped: bool = False
    ) -> Event:
        held = time.time() - state.since
        if why == "deadline":
            text = (
                f"the pause that began {_clock(state.since)} reached its deadline "
                f"{_clock(state.until)}"
                + (" while the agent was stopped" if while_stopped else "")
                + ": GPU monitoring resumed by itself"
            )
        else:
            text = f"GPU monitoring resumed on request after {held:.0f} s paused" + (
                f" (by {by})" if by else ""
            )
        return Event(
            source="runtime",
            kind="gpu_resumed",
            severity=Severity.WARNING if why == "deadline" else Severity.INFO,
            repair_action=RepairAction.NONE,
            subject="host",
            message=text,
            action="if the GPU work is not done, pause again (gpuwarden pause --for ...)"
            if why == "deadline"
            else "",
            attributes={**state.to_dict(), "why": why},
        )

    # -- the deadline -------------------------------------------------------------------------

    def arm(self) -> None:
        """(Re)start the timer that ends the pause at its deadline. On the loop."""
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if self.state is not None:
            # The step watch starts with the deadline, not when the task first runs.
            self._deadline = asyncio.create_task(
                self._expire(self.state.until, StepWatch()), name="pause"
            )

    async def _expire(self, until: float, steps: StepWatch) -> None:
        # The deadline is a wall-clock time (it outlives a restart), checked every second; a
        # step of the wall clock moves the pause's times with it first, so the pause lasts
        # what was asked for: a step back must not stretch it (a year back would leave the
        # GPUs unwatched for a year), a step forward must not end it early.
        while True:
            if delta := steps.step():
                until = self._clock_stepped(delta)
            left = until - time.time()
            if left <= 0:
                break
            await asyncio.sleep(min(left, 1.0))
        log.warning("the pause reached its deadline: resuming GPU monitoring")
        await self.resume(why="deadline")

    def _clock_stepped(self, delta: float) -> float:
        """Move the pause in force by a step of the wall clock, as reported and as kept;
        returns its deadline."""
        state = self.state
        if state is None:
            return time.time()
        state = dataclasses.replace(state, since=state.since + delta, until=state.until + delta)
        self.state = state
        self._publish()
        self._persist(state)
        log.warning("the wall clock stepped; the pause moved with it", seconds=delta)
        return state.until

    async def stop(self) -> None:
        task, self._deadline = self._deadline, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def ended_pauses(stored: object) -> tuple[list[PauseWindow], int]:
    """The ended pauses as the store keeps them (HISTORY_KEY), and how many entries could not
    be read (skipped). Also for `gpuwarden check`, which reads the running agent's store."""
    if stored is None:
        return [], 0
    windows: list[PauseWindow] = []
    bad = 0
    for entry in stored if isinstance(stored, list) else [stored]:
        try:
            if not isinstance(entry, dict):
                raise TypeError(f"expected an object, got {type(entry).__name__}")
            windows.append(
                PauseWindow(
                    float(entry["since"]),
                    float(entry["ended"]),
                    str(entry.get("reason", "")),
                    str(entry.get("by", "")),
                )
            )
        except (KeyError, TypeError, ValueError):
            bad += 1
    return windows, bad


class _FirstRound:
    """Watches one instance of a collector for its first round that began at `after` or later
    (time.monotonic()), and keeps that round's events: a later round's do not replace them."""

    def __init__(self, status: CollectorStatus, after: float) -> None:
        self.status = status
        self.after = after
        self.events: tuple[Event, ...] | None = None
        status.round_watchers.append(self._ended)

    def _ended(self) -> None:
        status = self.status
        if self.events is None and status.last_round_began >= self.after:
            self.events = tuple(status.last_events) if status.success else ()
            self.close()

    def close(self) -> None:
        with contextlib.suppress(ValueError):
            self.status.round_watchers.remove(self._ended)


async def _first_rounds(
    resumed: Mapping[str, tuple[CollectorStatus, float]],
    running: Callable[[], Mapping[str, CollectorStatus]],
    lifted: float,
) -> tuple[dict[str, tuple[Event, ...]], tuple[str, ...]]:
    """Wait (bounded) for each collector's first round after the resume: the first that
    began (time.monotonic()) after it was resumed, as `resumed` says, and ended; its events.
    A round in flight then began paused: it called nothing and found nothing, and taking it
    for the first round made the command report nothing (a GPU the reset left out unsaid).

    Of the instance that runs under the collector's name (`running`): a reload that replaced
    it meanwhile retired the one resumed, whose rounds are over, and its successor, installed
    after the hold was lifted (`lifted`), never ran paused. One that a reload stopped is not
    waited for."""
    deadline = time.monotonic() + FIRST_ROUND_BOUND
    watching = {name: _FirstRound(status, since) for name, (status, since) in resumed.items()}
    gone: set[str] = set()
    try:
        while time.monotonic() < deadline:
            for name, watch in watching.items():
                now = running().get(name)
                if now is None:
                    gone.add(name)
                elif now is not watch.status and watch.events is None:
                    watch.close()
                    watching[name] = _FirstRound(now, lifted)
                    if now.first_round_events is not None:  # it ran before this look
                        watching[name].events = tuple(now.first_round_events)
                        watching[name].close()
            if all(w.events is not None for n, w in watching.items() if n not in gone):
                break
            await asyncio.sleep(0.05)
    finally:
        for watch in watching.values():
            watch.close()
    first = {n: w.events for n, w in watching.items() if n not in gone and w.events is not None}
    late = tuple(n for n, w in watching.items() if n not in gone and w.events is None)
    return first, late


def _clock(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))
