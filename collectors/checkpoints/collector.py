"""Checkpoints you can restart from: freshness, integrity and the off-node copy.

Each round, per watched location: list and stat the candidates (detect.py), judge each
complete or not (judge.py: stable, not temporary, structure reads, sidecar checksum matches),
and compare the newest complete one with the round before (shrunk, overwritten in place) and
with the off-node copy (offnode.py). Every file-system call goes through `ctx.call` keyed by
the location, so a hung network file system stalls one location, not the collector.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from agent.contracts.collector import (
    CollectContext,
    CollectorDeps,
    KeyValueStore,
)
from agent.contracts.errors import CallStillHung, CallTimedOut, StateStoreError
from agent.contracts.model import (
    Collection,
    Event,
    MetricFamily,
    MetricType,
    RepairAction,
    Sample,
    Severity,
)
from collectors.checkpoints.detect import Observed, scan_location
from collectors.checkpoints.judge import STATUSES, Judge, JudgeSettings, RoundOutcome, Verdict
from collectors.checkpoints.offnode import Comparison, OffnodeCopy, make_copy
from collectors.checkpoints.settings import CheckpointSettings, LocationSettings

log = structlog.get_logger(component="checkpoints")

G = MetricType.GAUGE
SOURCE = "checkpoints"
LOC = ("location",)
OFF = ("location", "target")
MIB = 2**20

NEWEST_AGE = MetricFamily(
    "gpuwarden_checkpoint_newest_age_seconds",
    G,
    "Age of the newest complete checkpoint (its newest file's modification time)",
    LOC,
    "seconds",
)
NEWEST_STEP = MetricFamily(
    "gpuwarden_checkpoint_newest_step",
    G,
    "Training step of the newest complete checkpoint (absent where the format does not say)",
    LOC,
)
NEWEST_SIZE = MetricFamily(
    "gpuwarden_checkpoint_newest_size_bytes",
    G,
    "Size of the newest complete checkpoint",
    LOC,
    "bytes",
)
MAX_AGE = MetricFamily(
    "gpuwarden_checkpoint_max_age_seconds",
    G,
    "The configured max_age: the work the location can afford to lose",
    LOC,
    "seconds",
)
COUNT = MetricFamily(
    "gpuwarden_checkpoints",
    G,
    "Checkpoints in the location by status (complete, incomplete, corrupt, verifying)",
    ("location", "status"),
)
LATEST_CORRUPT = MetricFamily(
    "gpuwarden_checkpoint_latest_corrupt",
    G,
    "1 while a corrupt checkpoint is newer than the newest complete one (the last save failed)",
    LOC,
)
VERIFY_SECONDS = MetricFamily(
    "gpuwarden_checkpoint_verify_seconds",
    G,
    "Time the last round spent listing, reading structures and hashing the location",
    LOC,
    "seconds",
)
LOCATION_ERROR = MetricFamily(
    "gpuwarden_checkpoint_location_error",
    G,
    "1 if the location could not be listed (missing, unreadable, or hung)",
    LOC,
)
OFFNODE_STEP = MetricFamily(
    "gpuwarden_checkpoint_offnode_newest_step",
    G,
    "Step of the newest complete local checkpoint that the off-node copy holds",
    OFF,
)
OFFNODE_LAG = MetricFamily(
    "gpuwarden_checkpoint_offnode_lag_seconds",
    G,
    "How much older the newest checkpoint held off node is than the newest complete local one",
    OFF,
    "seconds",
)
OFFNODE_OK = MetricFamily(
    "gpuwarden_checkpoint_offnode_ok",
    G,
    "1 when the off-node copy holds a matching checkpoint within offnode_max_lag of the newest",
    OFF,
)
OFFNODE_ERROR = MetricFamily(
    "gpuwarden_checkpoint_offnode_error",
    G,
    "1 if the off-node copy could not be listed",
    OFF,
)


@dataclass
class _LocationState:
    settings: LocationSettings
    judge: Judge
    copy: OffnodeCopy | None
    stale: bool | None = None
    error: str = ""
    offnode_problem: str = ""
    offnode_error: str = ""
    last_good: dict[str, object] | None = None
    saved_good: dict[str, object] | None = None


_GOOD_NAMESPACE = "checkpoints.last_good"


class CheckpointCollector:
    name = "checkpoints"

    def __init__(self, settings: CheckpointSettings, deps: CollectorDeps) -> None:
        self.settings = settings
        self.deps = deps
        self._state_failing = False
        self.comparisons: dict[str, Comparison] = {}
        """The last off-node comparison per location: which checks were possible."""
        stored = deps.state.items(_GOOD_NAMESPACE)
        judge_settings = judge_settings_for(settings)
        self._locations: list[_LocationState] = []
        for loc in settings.locations:
            good = stored.get(loc.label)
            kept = good if isinstance(good, dict) else None
            self._locations.append(
                _LocationState(
                    loc,
                    Judge(judge_settings, f"local:{loc.label}"),
                    make_copy(loc, settings, judge_settings),
                    last_good=kept,
                    saved_good=kept,
                )
            )

    def families(self) -> Sequence[MetricFamily]:
        return (
            NEWEST_AGE,
            NEWEST_STEP,
            NEWEST_SIZE,
            MAX_AGE,
            COUNT,
            LATEST_CORRUPT,
            VERIFY_SECONDS,
            LOCATION_ERROR,
            OFFNODE_STEP,
            OFFNODE_LAG,
            OFFNODE_OK,
            OFFNODE_ERROR,
        )

    async def collect(self, ctx: CollectContext) -> Collection:
        samples: list[Sample] = []
        events: list[Event] = []
        for state in self._locations:
            await self._location(ctx, state, samples, events)
        await self._save(ctx)
        return Collection(samples=samples, events=events)

    def hash_seconds(self) -> float:
        """Hashing may take half the interval: the round stays well inside its bound."""
        return max(self.settings.interval * 0.5, 0.05)

    async def _location(
        self, ctx: CollectContext, state: _LocationState, samples: list[Sample], events: list[Event]
    ) -> None:
        loc = state.settings
        label = loc.label
        started = time.monotonic()
        samples.append(MAX_AGE.sample(loc.max_age, label))
        try:
            observed: list[Observed] = await ctx.call(
                f"scan:{label}",
                scan_location,
                loc.path,
                loc.pattern,
                self.settings.temp_patterns,
                self.settings.max_checkpoints,
            )
        except (OSError, CallTimedOut, CallStillHung) as exc:
            samples.append(LOCATION_ERROR.sample(1, label))
            self._location_failed(state, _describe(exc), events)
            return
        samples.append(LOCATION_ERROR.sample(0, label))
        if state.error:
            events.append(
                _event(
                    "checkpoint_location_ok",
                    Severity.INFO,
                    label,
                    f"checkpoint location {label} can be listed again",
                )
            )
            state.error = ""
        outcome = await state.judge.round(ctx, observed, ctx.now, self.hash_seconds())
        samples.append(VERIFY_SECONDS.sample(time.monotonic() - started, label))
        self._report(state, outcome, ctx.now, samples, events)
        if state.copy is not None:
            comparison = await state.copy.compare(ctx, outcome, state.judge, ctx.now)
            self.comparisons[label] = comparison
            self._report_copy(state, comparison, samples, events)

    def _location_failed(self, state: _LocationState, error: str, events: list[Event]) -> None:
        label = state.settings.label
        if state.error != error:
            events.append(
                _event(
                    "checkpoint_location_error",
                    Severity.WARNING,
                    label,
                    f"checkpoint location {state.settings.path} cannot be listed: {error}",
                    action=f"check that {state.settings.path} exists, is mounted and readable "
                    "by the agent",
                )
            )
        state.error = error

    def _report(
        self,
        state: _LocationState,
        outcome: RoundOutcome,
        now: float,
        samples: list[Sample],
        events: list[Event],
    ) -> None:
        loc = state.settings
        label = loc.label
        for status, count in outcome.counts().items():
            samples.append(COUNT.sample(count, label, status))
        newest = outcome.newest_complete()
        newer_corrupt = next(
            (v for v in outcome.verdicts if v.status == "corrupt"),
            None,
        )
        latest_corrupt = newer_corrupt is not None and (
            newest is None or newer_corrupt.mtime > newest.mtime
        )
        samples.append(LATEST_CORRUPT.sample(int(latest_corrupt), label))
        for verdict in outcome.new_corrupt:
            events.append(_corrupt_event(label, verdict))
        for change in outcome.overwritten:
            events.append(
                _overwritten_event(
                    state, change.name, change.before_size, change.after_size, change.same_inode
                )
            )
        if newest is not None:
            samples.append(NEWEST_AGE.sample(max(now - newest.mtime, 0.0), label))
            samples.append(NEWEST_SIZE.sample(newest.size_bytes, label))
            if newest.step is not None:
                samples.append(NEWEST_STEP.sample(newest.step, label))
            self._check_shrunk(state, newest, events)
        self._check_stale(state, newest, now, events)

    def _check_shrunk(self, state: _LocationState, newest: Verdict, events: list[Event]) -> None:
        good = state.last_good
        state.last_good = {"name": newest.name, "size": newest.size_bytes, "step": newest.step}
        if good is None or good.get("name") == newest.name:
            return
        before = good.get("size")
        if isinstance(before, int) and newest.size_bytes < before * self.settings.shrink_ratio:
            events.append(
                _event(
                    "checkpoint_shrunk",
                    Severity.WARNING,
                    state.settings.label,
                    f"{newest.name} ({_mib(newest.size_bytes)}) is much smaller than "
                    f"{good.get('name')} before it ({_mib(before)}): a part may be missing "
                    "(optimizer state, a shard)",
                    action=f"compare the files of {newest.name} with {good.get('name')}; keep "
                    f"{good.get('name')} until the new one is known to restore",
                    attributes={
                        "before_bytes": before,
                        "after_bytes": newest.size_bytes,
                        "before": str(good.get("name")),
                    },
                )
            )

    def _check_stale(
        self, state: _LocationState, newest: Verdict | None, now: float, events: list[Event]
    ) -> None:
        loc = state.settings
        age = None if newest is None else now - newest.mtime
        stale = age is None or age > loc.max_age
        if stale and state.stale is not True:
            if newest is None:
                message = f"{loc.path} holds no complete checkpoint: nothing to restart from"
                severity = Severity.CRITICAL
            else:
                message = (
                    f"the newest complete checkpoint in {loc.path}, {newest.name}, is "
                    f"{_hours(age or 0)} old; max_age is {_hours(loc.max_age)}"
                )
                severity = Severity.WARNING
            events.append(
                _event(
                    "checkpoint_stale",
                    severity,
                    loc.label,
                    message,
                    action="check that the job is still saving (its log, the save interval) "
                    "and that its saves complete: `gpuwarden checkpoint verify "
                    f"{loc.path}/*`",
                    attributes={"max_age": loc.max_age, "age": -1.0 if age is None else age},
                )
            )
        elif not stale and state.stale is True:
            events.append(
                _event(
                    "checkpoint_fresh",
                    Severity.INFO,
                    loc.label,
                    f"{loc.path} has a complete checkpoint within max_age again",
                )
            )
        state.stale = stale

    def _report_copy(
        self,
        state: _LocationState,
        comparison: Comparison,
        samples: list[Sample],
        events: list[Event],
    ) -> None:
        loc = state.settings
        labels = (loc.label, loc.target)
        if comparison.error:
            samples.append(OFFNODE_ERROR.sample(1, *labels))
            samples.append(OFFNODE_OK.sample(0, *labels))
            if state.offnode_error != comparison.error:
                events.append(
                    _event(
                        "checkpoint_offnode_error",
                        Severity.WARNING,
                        loc.label,
                        f"the off-node copy {loc.target} cannot be listed: {comparison.error}",
                        action="check the bucket or volume, its credentials and the network",
                    )
                )
            state.offnode_error = comparison.error
            return
        state.offnode_error = ""
        samples.append(OFFNODE_ERROR.sample(0, *labels))
        samples.append(OFFNODE_OK.sample(int(comparison.ok), *labels))
        if comparison.held_step is not None:
            samples.append(OFFNODE_STEP.sample(comparison.held_step, *labels))
        if comparison.lag_seconds is not None:
            samples.append(OFFNODE_LAG.sample(comparison.lag_seconds, *labels))
        problem = comparison.problem
        if problem and problem != state.offnode_problem:
            events.append(
                _event(
                    comparison.kind,
                    Severity.CRITICAL
                    if comparison.kind == "checkpoint_offnode_mismatch"
                    else Severity.WARNING,
                    loc.label,
                    problem,
                    action=comparison.action,
                    attributes={"target": loc.target, "checksum_check": comparison.checksum_check},
                )
            )
        state.offnode_problem = problem

    async def _save(self, ctx: CollectContext) -> None:
        changes = {
            s.settings.label: s.last_good for s in self._locations if s.last_good != s.saved_good
        }
        if not changes:
            return
        try:
            await ctx.call("checkpoints:state", _write, self.deps.state, changes)
        except (StateStoreError, CallTimedOut, CallStillHung) as exc:
            if not self._state_failing:
                log.warning("last good checkpoints not saved; retrying", error=str(exc))
            self._state_failing = True
            return
        self._state_failing = False
        for state in self._locations:
            state.saved_good = state.last_good

    async def close(self) -> None:
        return None


def judge_settings_for(settings: CheckpointSettings) -> JudgeSettings:
    rate = settings.hash_bandwidth_mib_s * MIB
    return JudgeSettings(
        settle_seconds=settings.settle_seconds,
        hash_newest=settings.hash_newest,
        hash_bytes_per_second=rate,
        # Half the call timeout's worth at the rate: one hash call never times out on a
        # disk that keeps up with the limit.
        hash_call_bytes=max(int(rate * settings.timeout * 0.5), MIB),
        md5=any(loc.s3_bucket for loc in settings.locations),
    )


def _write(state: KeyValueStore, changes: dict[str, dict[str, object] | None]) -> None:
    for key, value in changes.items():
        if value is None:
            state.delete(_GOOD_NAMESPACE, key)
        else:
            state.put(_GOOD_NAMESPACE, key, value)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        return f"{exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else "")
    return str(exc)


def _mib(size: object) -> str:
    return f"{float(size) / MIB:.1f} MiB" if isinstance(size, (int, float)) else "?"


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def _event(
    kind: str,
    severity: Severity,
    location: str,
    message: str,
    *,
    action: str = "",
    attributes: dict[str, str | int | float | bool] | None = None,
) -> Event:
    return Event(
        source=SOURCE,
        kind=kind,
        severity=severity,
        # A checkpoint is the job's: what to do is in `action`, the node needs nothing.
        repair_action=RepairAction.NONE,
        subject=location,
        message=message,
        action=action,
        attributes=attributes or {},
    )


def _corrupt_event(location: str, verdict: Verdict) -> Event:
    what = "checksum" if verdict.checksum == "mismatch" else "structure"
    return _event(
        "checkpoint_corrupt",
        Severity.CRITICAL,
        location,
        f"checkpoint {verdict.name} is not restartable ({what}): {verdict.problem}",
        action=f"do not restart from {verdict.name}; save again, or restart from an older "
        "complete checkpoint (`gpuwarden checkpoint verify` lists them)",
        attributes={"checkpoint": verdict.name, "check": what, "size_bytes": verdict.size_bytes},
    )


def _overwritten_event(
    state: _LocationState, name: str, before: int, after: int, same_inode: bool
) -> Event:
    good = state.last_good is not None and state.last_good.get("name") == name
    how = "in place (same inode)" if same_inode else "by a new file under the same name"
    return _event(
        "checkpoint_overwritten",
        Severity.CRITICAL if good else Severity.WARNING,
        state.settings.label,
        f"{'the last good checkpoint ' if good else 'complete checkpoint '}{name} is being "
        f"overwritten {how}: {_mib(before)} before, {_mib(after)} now; until the new save "
        "completes there may be nothing to restart from",
        action="save each checkpoint under its own name (a step number) and delete old ones "
        "only after the new one is complete and copied off the node",
        attributes={
            "checkpoint": name,
            "before_bytes": before,
            "after_bytes": after,
            "same_inode": same_inode,
        },
    )


__all__ = ["STATUSES", "CheckpointCollector", "CheckpointSettings"]
