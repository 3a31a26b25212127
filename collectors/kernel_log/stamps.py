"""The wall-clock time a saved line's stamp says, in seconds since the epoch.

`parse` finds a line's stamp and keeps it as written (`LogRecord.timestamp`); this module reads
that text, in the shapes `parse` cuts out, into a time:

- with its zone: ISO 8601 / RFC 3339 with an offset or `Z` (journalctl -o short-iso, rsyslog's
  RFC 3339 files, RFC 5424, dmesg --time-format iso, journalctl -o json's wall time),
  journalctl -o short-unix (seconds since the epoch) and -o short-full (`UTC`, `GMT`, a numeric
  offset, or the local zone's own abbreviation);
- in the host's local time, as the tools write it when they give no zone: ISO 8601 without an
  offset, dmesg -T (`Sun Nov 29 18:10:02 2026`), and without a year: syslog's and journalctl's
  `Nov 29 18:10:02[.123456]` and dmesg -e's time break `Nov29 18:10` (to the minute), in the
  month names of the locales in `MONTHS` and the CJK locales' numbered months (`11月`, `11월`).

A year-less stamp takes the year that puts it latest without being more than
`YEAR_SLACK` after a reference time (`year_less_time`): a `Dec 31` line read on Jan 1 is last
year's. What the reference is, the caller says: now, for a file followed as it is written;
for a saved log (`timeline`) the time of the line after it, and for the last line the file's
modification time, so that a whole file's times never run backwards across a year's end.

A stamp that says no wall time (seconds since a boot, dmesg's deltas) or cannot be read (a
month no table knows, a day or hour out of range, an unknown zone) gives None: the caller
keeps its own time.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta, timezone
from typing import Final, NamedTuple

from collectors.kernel_log.parse import LogRecord

YEAR_SLACK: Final = 86400.0
"""How far after the reference a year-less stamp may lie and still be the reference's year
(a writer's clock ahead of the reader's, a line written in another zone's day): beyond it,
the stamp is the year before's."""
EARLIEST_UNIX: Final = 946684800.0
"""2000-01-01: a short-unix stamp before it is a count of seconds since a boot written in the
same digits (journalctl -o short-monotonic after three years up), not a wall time."""
LIVE_SKEW: Final = 600.0
"""Seconds a line read live may be stamped before its read and keep its stamp: a writer that
lagged (rsyslog's queue behind a slow disk) is minutes late at most; a writer whose zone is not
the agent's is at least a quarter of an hour off, and mostly whole hours."""
_YEARS_BACK: Final = 8
"""How many years before the reference a year-less stamp is tried in (Feb 29 needs up to
eight: 2096 to 2104 has no leap day)."""

# glibc's abbreviated month names (localedata `abmon`, as `date +%b` prints them under glibc
# 2.36), lower-cased, a trailing `.` taken off: English, de_DE, fr_FR (with `avr` of older
# releases), es_ES, it_IT, pt_BR and pt_PT, nl_NL, pl_PL, sv_SE, ru_RU (with the nominative
# `май`), uk_UA, cs_CZ, tr_TR. No two of them name different months with the same word.
_MONTH_WORDS: Final = (
    "jan feb mar apr may jun jul aug sep oct nov dec",
    "jan feb mär apr mai jun jul aug sep okt nov dez",
    "janv févr mars avril mai juin juil août sept oct nov déc",
    "janv févr mars avr mai juin juil août sept oct nov déc",
    "ene feb mar abr may jun jul ago sep oct nov dic",
    "gen feb mar apr mag giu lug ago set ott nov dic",
    "jan fev mar abr mai jun jul ago set out nov dez",
    "jan feb mrt apr mei jun jul aug sep okt nov dec",
    "sty lut mar kwi maj cze lip sie wrz paź lis gru",
    "jan feb mar apr maj jun jul aug sep okt nov dec",
    "янв фев мар апр мая июн июл авг сен окт ноя дек",
    "янв фев мар апр май июн июл авг сен окт ноя дек",
    "січ лют бер кві тра чер лип сер вер жов лис гру",
    "led úno bře dub kvě čen čec srp zář říj lis pro",
    "oca şub mar nis may haz tem ağu eyl eki kas ara",
)
MONTHS: Final[dict[str, int]] = {
    word: number for words in _MONTH_WORDS for number, word in enumerate(words.split(), start=1)
}
"""A month's abbreviated name in the locales known -> its number."""

_NUMBERED_MONTH = re.compile(r"(\d{1,2})[^\W\d_]")  # zh_CN, ja_JP, ko_KR: `11月`, `11월`
_TIME = r"(?P<hour>\d\d):(?P<minute>\d\d):(?P<second>\d\d)(?:\.(?P<fraction>\d{1,9}))?"
_SYSLOG = re.compile(rf"(?P<month>\S+) +(?P<day>\d{{1,2}}) {_TIME}")
_CTIME = re.compile(
    rf"\S+ +(?P<month>\S+) +(?P<day>\d{{1,2}}) {_TIME} (?P<year>\d{{4}})(?: <[^>]*>)?"
)
_RELTIME = re.compile(r"(?P<month>.*?\D) ?(?P<day>\d{1,2}) (?P<hour>\d\d):(?P<minute>\d\d)")
_FULL = re.compile(
    rf"\S+ (?P<year>\d{{4}})-(?P<mon>\d\d)-(?P<day>\d\d) {_TIME} (?P<zone>[A-Za-z0-9+-]{{1,8}})"
)
_FRACTION = re.compile(r":\d\d[.,](\d+)")
_UNIX = re.compile(r"\d{9,12}\.\d{6}")
_OFFSET = re.compile(r"([+-])(\d\d):?(\d\d)")
_UTC_NAMES: Final = frozenset({"UTC", "GMT", "UT", "Z"})


class YearLess(NamedTuple):
    """A local time without its year (syslog's `Nov 29 18:10:02`)."""

    month: int
    day: int
    hour: int
    minute: int
    second: int
    micro: int


class Stamp(NamedTuple):
    """What a line's stamp says: a time (`when`), or a local time without its year
    (`year_less`); `precision`, seconds: the stamp names the start of a second or a
    minute (or finer, with a fraction)."""

    when: float | None
    year_less: YearLess | None
    precision: float


def month_number(name: str) -> int | None:
    """A month's abbreviated name in a locale `MONTHS` knows, or a CJK numbered month."""
    name = name.strip()
    numbered = _NUMBERED_MONTH.fullmatch(name)
    if numbered is not None:
        number = int(numbered[1])
        return number if 1 <= number <= 12 else None
    return MONTHS.get(name.lower().rstrip("."))


def _micro(fraction: str | None) -> tuple[int, float]:
    if not fraction:
        return 0, 1.0
    return int(fraction[:6].ljust(6, "0")), 10.0 ** -len(fraction)


def _local(year: int, fields: YearLess) -> float | None:
    """Local time -> seconds since the epoch; None for a date or time that does not exist."""
    try:
        moment = datetime(year, fields.month, fields.day, fields.hour, fields.minute)
    except ValueError:
        return None
    if fields.second > 60:
        return None
    # A leap second (:60) is the next second's start, as mktime reads it.
    return moment.timestamp() + fields.second + fields.micro / 1e6


def _year_less(match: re.Match[str], *, seconds: bool) -> Stamp | None:
    month = month_number(match["month"])
    if month is None:
        return None
    micro, precision = _micro(match["fraction"] if seconds else None)
    fields = YearLess(
        month,
        int(match["day"]),
        int(match["hour"]),
        int(match["minute"]),
        int(match["second"]) if seconds else 0,
        micro,
    )
    if not (1 <= fields.day <= 31 and fields.hour < 24 and fields.minute < 60):
        return None
    if _local(2000, fields) is None:  # a leap year: only a day no year has is refused here
        return None
    return Stamp(None, fields, precision if seconds else 60.0)


def _iso(text: str) -> Stamp | None:
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return None  # a month 13, an hour 25, an offset of 99 hours
    fraction = _FRACTION.search(text)
    precision = 10.0 ** -len(fraction[1]) if fraction is not None else 1.0
    return Stamp(moment.timestamp(), None, precision)  # naive: local time


def _zone(name: str) -> timezone | None:
    """short-full's zone: UTC's names, a numeric offset, or the local zone's abbreviation."""
    if name in _UTC_NAMES:
        return UTC
    offset = _OFFSET.fullmatch(name)
    if offset is not None:
        hours, minutes = int(offset[2]), int(offset[3])
        if hours >= 24 or minutes >= 60:
            return None
        delta = timedelta(hours=hours, minutes=minutes)
        return timezone(-delta if offset[1] == "-" else delta)
    return None


def _full(match: re.Match[str]) -> Stamp | None:
    micro, precision = _micro(match["fraction"])
    try:
        moment = datetime(
            int(match["year"]),
            int(match["mon"]),
            int(match["day"]),
            int(match["hour"]),
            int(match["minute"]),
            int(match["second"]),
            micro,
        )
    except ValueError:
        return None
    zone = _zone(match["zone"])
    if zone is not None:
        return Stamp(moment.replace(tzinfo=zone).timestamp(), None, precision)
    if match["zone"] not in time.tzname:
        return None  # a zone this host cannot place
    return Stamp(moment.timestamp(), None, precision)


def _ctime(match: re.Match[str]) -> Stamp | None:
    stamp = _year_less(match, seconds=True)
    if stamp is None or stamp.year_less is None:
        return None
    when = _local(int(match["year"]), stamp.year_less)
    return None if when is None else Stamp(when, None, 1.0)


def read_stamp(record: LogRecord) -> Stamp | None:
    """What `record`'s stamp says; None when it says no wall time or cannot be read."""
    text = record.timestamp.strip()
    if not text:
        return None
    first = text[0]
    if first.isdigit():
        if "-" in text[:5]:
            return _iso(text)
        if _UNIX.fullmatch(text) is not None and float(text) >= EARLIEST_UNIX:
            return Stamp(float(text), None, 1e-6)
        if _NUMBERED_MONTH.match(text) is None:
            return None  # seconds since a boot (dmesg, raw records, short-monotonic)
    if first in "+<":
        return None  # dmesg's deltas
    if (full := _FULL.fullmatch(text)) is not None:
        return _full(full)
    if (ctime := _CTIME.fullmatch(text)) is not None:
        return _ctime(ctime)
    if (syslog := _SYSLOG.fullmatch(text)) is not None:
        return _year_less(syslog, seconds=True)
    if (reltime := _RELTIME.fullmatch(text)) is not None:
        return _year_less(reltime, seconds=False)
    return None


def year_less_time(fields: YearLess, reference: float) -> float | None:
    """The year-less local time in the year that makes it latest, but at most `YEAR_SLACK`
    after `reference`; None when no year of the last few has that day (Feb 29 with the
    reference years from a leap year is found)."""
    year = time.localtime(reference).tm_year + 1
    for candidate in range(year, year - _YEARS_BACK - 2, -1):
        when = _local(candidate, fields)
        if when is not None and when <= reference + YEAR_SLACK:
            return when
    return None


def stamp_time(stamp: Stamp, reference: float) -> float | None:
    if stamp.year_less is not None:
        return year_less_time(stamp.year_less, reference)
    return stamp.when


def line_time(record: LogRecord, now: float, *, live: bool = False) -> float:
    """The time of a line read at `now` as it was written (a followed file): its stamp's,
    never after `now`; `now` when the stamp says none, or when `now` lies inside the second
    (or minute) the stamp names, which `now` then says more finely. `live`: the line was
    written since the last read (the reader follows the file's end), so a moment ago: a stamp
    more than LIVE_SKEW before `now` is a writer in another time zone or on another clock,
    and `now` is the better time (`stamp_skew` tells how far off)."""
    stamp = read_stamp(record)
    if stamp is None:
        return now
    when = stamp_time(stamp, now)
    if when is None or when <= now < when + stamp.precision:
        return now
    if live and now - when > LIVE_SKEW:
        return now
    return min(when, now)


def stamp_skew(record: LogRecord, now: float) -> float | None:
    """How far the line's stamp lies before `now` (negative: after it); None without one."""
    stamp = read_stamp(record)
    when = None if stamp is None else stamp_time(stamp, now)
    return None if when is None else now - when


def timeline(records: Sequence[LogRecord], reference: float) -> list[float | None]:
    """The times of a saved log's records in line order, None where a record's stamp says
    none. A year-less stamp takes its year from the next record with a time after it (the
    last one's from `reference`, the file's modification time): the times do not run
    backwards across a year's end, however many the log spans, as long as no year passes
    between two records."""
    times: list[float | None] = [None] * len(records)
    after = reference
    for index in range(len(records) - 1, -1, -1):
        stamp = read_stamp(records[index])
        when = None if stamp is None else stamp_time(stamp, after)
        times[index] = when
        if when is not None:
            after = when
    return times
