"""Releasing the GPUs on request: the pause every GPU user of the agent honours.

An operator who resets a GPU (`nvidia-smi -r`) or changes its MIG mode needs every process off
the device files. `gpuwarden pause` asks the running agent to let go: the runtime asks each
`PausableCollector` to release what it holds (the gpu collector shuts NVML down and joins its
event thread; the benchmark starts no child), and until the pause ends those collectors' rounds
make no driver call and give no GPU series. A pause always has a deadline: a forgotten one
must not blind the node for good (agent/runtime/pause.py ends it and says so).

The reset logs what otherwise means a broken GPU (Xids): `PauseHistory` says which pause a
record's time lies in, and `logged_during_pause` is the one policy for a finding found there.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, Protocol, runtime_checkable

from agent.contracts.collector import Collector
from agent.contracts.errors import ConfigError
from agent.contracts.model import AttributeValue, Event, RepairAction, Severity
from agent.contracts.settings import setting


@dataclass(frozen=True)
class PauseState:
    """A pause in force: when it began, when it ends by itself, who asked and why."""

    since: float
    until: float
    reason: str = ""
    by: str = ""
    """Who asked: the peer's user name as the control socket saw it."""

    def to_dict(self) -> dict[str, str | float]:
        return {
            "since_ts": round(self.since, 3),
            "until_ts": round(self.until, 3),
            "reason": self.reason,
            "by": self.by,
        }


@dataclass(frozen=True)
class Released:
    """What one collector did when asked to pause."""

    component: str
    released: bool
    """True when the collector holds nothing of the GPUs any more."""
    detail: str
    """One line for the operator: what was let go, or what could not be and why."""


@runtime_checkable
class PausableCollector(Collector, Protocol):
    """A collector that uses the GPUs and can let go of them.

    `pause` returns once the collector holds nothing of the GPU driver (no thread in it, no
    library initialised, no child process on a GPU), or says what it could not release. From
    then until `resume`, its rounds make no driver call; they return no GPU series (the
    runtime's `gpuwarden_gpu_paused` says why). `resume` only lifts the gate: the next round
    starts afresh (initialises the library, re-reads everything, restarts its threads) and
    reports a GPU that did not come back. Both may be called while a round runs: the
    collector orders them with its own rounds."""

    async def pause(self) -> Released: ...

    async def resume(self) -> None: ...


@dataclass(frozen=True)
class PauseSettings:
    """`[pause]`: how long `gpuwarden pause` lets go of the GPUs."""

    default_duration: float = setting(
        1800.0,
        minimum=1.0,
        maximum=86400.0,
        help="seconds a pause lasts when `gpuwarden pause` names no --for; then the agent "
        "resumes by itself",
    )
    max_duration: float = setting(
        14400.0,
        minimum=1.0,
        maximum=604800.0,
        help="the longest pause the agent accepts (a longer --for is refused)",
    )

    def __post_init__(self) -> None:
        if self.default_duration > self.max_duration:
            raise ConfigError(
                "pause.default_duration",
                f"expected at most max_duration ({self.max_duration:g} s), "
                f"got {self.default_duration:g} s",
            )


DURING_PAUSE: Final = "during_pause"
"""The attribute that marks an event found in a record logged while the GPUs were paused."""


@dataclass(frozen=True)
class PauseWindow:
    """One pause, from its start to its end; `ended` None while it is in force."""

    since: float
    ended: float | None = None
    reason: str = ""
    by: str = ""

    def covers(self, when: float) -> bool:
        """`when` (seconds since the epoch) lies in the pause: from its start, up to (not
        including) its end: a record logged at the moment of the resume is the GPUs' own."""
        return self.since <= when and (self.ended is None or when < self.ended)


class PauseHistory:
    """The pauses of the last while, the one in force included: what a collector judges a
    record by, by when the record was logged, not when it was read. A kernel-log record of
    the reset that a round reads after the resume (or an agent restarted after it reads
    when it catches up) is still the pause's.

    The runtime keeps it (agent/runtime/pause.py) and shares it (`SharedServices`); where no
    runtime runs (`scan`, `check`, tests of one collector) it is empty and judges nothing
    paused. Thread-safe: the runtime replaces it on the loop, any thread may read it."""

    def __init__(self, windows: Iterable[PauseWindow] = ()) -> None:
        self._lock = threading.Lock()
        self._windows: tuple[PauseWindow, ...] = tuple(windows)

    def replace(self, windows: Iterable[PauseWindow]) -> None:
        with self._lock:
            self._windows = tuple(windows)

    def windows(self) -> tuple[PauseWindow, ...]:
        with self._lock:
            return self._windows

    def covering(self, when: float) -> PauseWindow | None:
        """The pause `when` lies in, or None."""
        return next((w for w in self.windows() if w.covers(when)), None)


def logged_during_pause(event: Event, window: PauseWindow) -> Event:
    """`event` as it goes out when its record was logged during `window`: stored and sent (it
    is a fact, and nothing is lost), but it asks for nothing and pages nobody. Its severity
    is info and its repair action none, so no repair is held (agent/runtime/repairs.py), no
    action drains or runs a hook, no alert counts it; what it would have said outside a pause
    is in its attributes (`severity_if_not_paused`, `repair_action_if_not_paused`), its
    advice stays in `action`. Its `clears` still apply: a driver that says after the reset
    that the GPU needs no recovery any more is right about that too.

    Why not the finding itself: a GPU reset or MIG change logs the very lines that mean a
    broken GPU (Xid 79 during `nvidia-smi -r`). The first round after the resume reads every
    GPU afresh and reports one that did not come back; a record logged after the resume is
    judged as usual."""
    reason = f" ({window.reason})" if window.reason else ""
    attributes: dict[str, AttributeValue] = {
        **event.attributes,
        DURING_PAUSE: True,
        "pause_since_ts": round(window.since, 3),
        "pause_reason": window.reason,
        "severity_if_not_paused": event.severity.label,
        "repair_action_if_not_paused": event.repair_action.value,
    }
    advice = f"; outside a pause: {event.action}" if event.action else ""
    return dataclasses.replace(
        event,
        severity=Severity.INFO,
        repair_action=RepairAction.NONE,
        message=f"{event.message} [logged while the GPUs were paused{reason}: not acted on]",
        action="none while the GPUs are paused for a reset or MIG change, which logs such "
        "lines; the first round after gpuwarden resume reports a GPU that did not come back"
        + advice,
        attributes=attributes,
    )
