"""Wall-clock stamps whose ages do not step.

The wall clock steps: NTP or timesyncd correcting a large offset, `date -s`, a virtual machine
resumed. A stamp reports the wall-clock time it was made at (what a person and a payload
read), and measures its age on the monotonic clock, which does not step: a step forward is no
staleness, and a step back hides none. Ages asked "as of" a wall-clock time (`age(now)`,
tests) count from the monotonic reading of that time, taken when asked.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


def steady_of(wall: float) -> float:
    """The monotonic reading of the moment the wall-clock time `wall` names, as of now."""
    return time.monotonic() - (time.time() - wall)


@dataclass(frozen=True, slots=True)
class Stamp:
    wall: float
    """time.time() when it was made: what is reported."""
    steady: float
    """time.monotonic() at the same moment: what ages are measured from."""

    @classmethod
    def now(cls) -> Stamp:
        return cls(time.time(), time.monotonic())

    @classmethod
    def at(cls, wall: float) -> Stamp:
        """A stamp for the wall-clock time `wall` (now, or moments ago)."""
        return cls(wall, steady_of(wall))

    def age(self, now: float | None = None) -> float:
        """Seconds since the stamp, at `now` (a wall-clock time; None: now)."""
        return (time.monotonic() if now is None else steady_of(now)) - self.steady


STEP_SECONDS = 1.0
"""A change of the wall clock against the monotonic one this large is a step. NTP's and
timesyncd's slewing moves both clocks alike (CLOCK_MONOTONIC is slewed too), so only a
step, a `date -s` or a resume from suspend parts them."""


class StepWatch:
    """Tells how far the wall clock stepped since it last did (0.0: it did not)."""

    def __init__(self, threshold: float = STEP_SECONDS) -> None:
        self.threshold = threshold
        self._skew = time.time() - time.monotonic()

    def pending(self) -> float:
        """The step not yet confirmed (0.0: none); asking does not confirm it."""
        delta = (time.time() - time.monotonic()) - self._skew
        return delta if abs(delta) >= self.threshold else 0.0

    def confirm(self, delta: float) -> None:
        """The caller has dealt with a step of `delta` seconds (from `pending`)."""
        self._skew += delta

    def step(self) -> float:
        """The step since the last one, confirmed at once (0.0: none)."""
        delta = self.pending()
        self.confirm(delta)
        return delta
