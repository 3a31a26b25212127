"""The local time zone a test runs in: POSIX TZ rules (no tz database needed), set in the
process's environment and read again by the C library (`time.tzset`), then put back.

Each zone's UTC offset from November to March (northern winter, New Zealand's summer) is
written out, so a test computes the time a local stamp means without asking the C library
the code under test asks."""

from __future__ import annotations

import calendar
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

ZONES: dict[str, float] = {
    "UTC0": 0.0,
    "EST5EDT,M3.2.0,M11.1.0": -5 * 3600.0,
    "IST-5:30": 5.5 * 3600.0,
    "NZST-12NZDT,M9.5.0,M4.1.0/3": 13 * 3600.0,
}
"""TZ value -> its offset east of UTC, seconds, from November to March."""


@contextmanager
def local_zone(tz: str) -> Iterator[None]:
    before = os.environ.get("TZ")
    os.environ["TZ"] = tz
    time.tzset()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TZ", None)
        else:
            os.environ["TZ"] = before
        time.tzset()


def local_epoch(tz: str, *fields: int, micro: int = 0) -> float:
    """Seconds since the epoch of local time `fields` (year, month, day, hour, minute,
    second) in `tz`, from November to March."""
    return calendar.timegm((*fields, 0, 0, 0)) + micro / 1e6 - ZONES[tz]
