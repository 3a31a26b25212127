"""Threshold levels with hysteresis for "how full is it": space and inodes of a file system.

A level is raised as soon as a threshold is crossed and lowered only once the reading is back
past the threshold by a margin (the hysteresis), so a disk hovering at 90 % used does not send an
event every round. Both kinds of threshold apply at once: percent used, and an absolute amount
left (bytes or inodes); either one crossing raises the level.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Level(enum.IntEnum):
    OK = 0
    WARNING = 1
    CRITICAL = 2


@dataclass(frozen=True, slots=True)
class Limits:
    """Thresholds for one resource. A threshold of 0 is off."""

    warning_percent: float
    critical_percent: float
    warning_left: float
    critical_left: float
    hysteresis_percent: float

    def _reached(self, level: Level, used_percent: float, left: float, margin: float) -> bool:
        percent = self.warning_percent if level is Level.WARNING else self.critical_percent
        absolute = self.warning_left if level is Level.WARNING else self.critical_left
        by_percent = percent > 0 and used_percent >= percent - margin
        # For the absolute threshold the margin is a share of the threshold itself.
        by_absolute = absolute > 0 and left <= absolute * (1 + margin / 100)
        return by_percent or by_absolute

    def next_level(self, current: Level, used_percent: float, left: float) -> Level:
        """The level after this reading, given the level before it."""
        raised = Level.OK
        for level in (Level.CRITICAL, Level.WARNING):
            if self._reached(level, used_percent, left, 0.0):
                raised = level
                break
        if raised >= current:
            return raised
        for level in (Level.CRITICAL, Level.WARNING):
            if level <= current and self._reached(
                level, used_percent, left, self.hysteresis_percent
            ):
                return level
        return Level.OK


def used_percent(used: float, available: float) -> float:
    """Percent used the way df counts it: of what users can have (reserved blocks left out)."""
    total = used + available
    return 100.0 * used / total if total > 0 else 0.0
