"""`[actions.exec]`: a program run for each new event at or above a severity (never for a
finding logged while the GPUs were paused).

The event's JSON (the MQTT payload) is the hook's standard input; it runs without a shell, in
its own process group, killed with that group at `timeout`. The listener only queues: a slow
or hanging hook never delays the agent, its rounds or the other sinks. At most
`max_concurrent` hooks run at once; a full queue drops the event and counts it. A failure
(an exit code other than 0, a timeout, a program that cannot start) is counted by reason and
raised as one event per streak of failures; the next success ends the streak.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Sequence
from typing import Final

import structlog

from agent.contracts.model import Event, MetricFamily, MetricType, RepairAction, Sample, Severity
from agent.contracts.pause import DURING_PAUSE
from agent.contracts.sink import SinkContext
from exporters.actions import process
from exporters.actions.settings import ExecSettings

log = structlog.get_logger(component="exec_hook")

SOURCE: Final = "actions"
KIND_FAILED: Final = "exec_hook_failed"

RUNS = MetricFamily(
    "gpuwarden_exec_hook_runs_total",
    MetricType.COUNTER,
    "Runs of the [actions.exec] hook, by outcome (ok, exit_code, timeout, not_started)",
    ("outcome",),
)
DROPPED = MetricFamily(
    "gpuwarden_exec_hook_dropped_total",
    MetricType.COUNTER,
    "Events not handed to the hook because its queue was full",
)
RUNNING = MetricFamily("gpuwarden_exec_hook_running", MetricType.GAUGE, "Hooks running now")


class ExecHook:
    def __init__(self, settings: ExecSettings, context: SinkContext) -> None:
        self.settings = settings
        self.context = context
        self.queue: asyncio.Queue[Event] = asyncio.Queue(settings.queue_limit)
        self.outcomes: Counter[str] = Counter(dict.fromkeys(("ok",), 0))
        self.dropped = 0
        self.running = 0
        self._failing = False

    def on_event(self, event: Event) -> None:
        # Its own failure events would feed a failing hook forever. A finding logged while
        # the GPUs were paused is what the reset itself writes: no hook acts on it, whatever
        # min_severity says (agent/contracts/pause.py).
        if (
            event.severity < self.settings.severity
            or (event.source == SOURCE and event.kind == KIND_FAILED)
            or event.attributes.get(DURING_PAUSE) is True
        ):
            return
        try:
            self.queue.put_nowait(event)
        except asyncio.QueueFull:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 100 == 0:
                log.warning("exec hook queue full; event dropped", dropped=self.dropped)

    async def run(self) -> None:
        workers = [
            asyncio.create_task(self._worker(), name=f"exec-hook-{i}")
            for i in range(self.settings.max_concurrent)
        ]
        try:
            await asyncio.gather(*workers)
        finally:
            for task in workers:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*workers, return_exceptions=True)

    async def _worker(self) -> None:
        while True:
            event = await self.queue.get()
            self.running += 1
            try:
                outcome = await process.run(
                    self.settings.command, self.settings.timeout, stdin=event.to_json().encode()
                )
            finally:
                self.running -= 1
            self._record(event, outcome)

    def _record(self, event: Event, outcome: process.Outcome) -> None:
        if outcome.ok:
            self.outcomes["ok"] += 1
            self.context.record_delivery("actions")
            if self._failing:
                log.info("exec hook succeeds again")
            self._failing = False
            return
        reason = "not_started" if outcome.error else "timeout" if outcome.timed_out else "exit_code"
        self.outcomes[reason] += 1
        why = outcome.describe()
        log.warning("exec hook failed", error=why, event_id=event.id, kind=event.kind)
        self.context.record_failure("actions", f"exec hook: {why}")
        if self._failing:
            return
        self._failing = True
        self.context.emit(
            Event(
                source=SOURCE,
                kind=KIND_FAILED,
                severity=Severity.WARNING,
                repair_action=RepairAction.NONE,
                subject=self.settings.command[0],
                message=f"the [actions.exec] hook {self.settings.command[0]} failed for "
                f"event {event.kind} ({event.id}): {why}",
                action="run the hook by hand with an event on its standard input and fix it; "
                "gpuwarden_exec_hook_runs_total counts every failure, this event is raised "
                "once until the hook succeeds again",
                attributes={"reason": reason, "error": why, "event_id": event.id},
            )
        )

    def families(self) -> Sequence[MetricFamily]:
        return (RUNS, DROPPED, RUNNING)

    def samples(self) -> list[Sample]:
        out = [RUNS.sample(n, outcome) for outcome, n in sorted(self.outcomes.items())]
        out += [DROPPED.sample(self.dropped), RUNNING.sample(self.running)]
        return out
