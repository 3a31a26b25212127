"""A followed kernel-log file's findings carry the time their line says, not the time the
agent read it: a file read after a pause (an agent restarted, a log rotated) holds old lines.

Every stamp shape the parser knows is read: with its zone (ISO 8601 with an offset, RFC 5424,
dmesg --time-format iso, journalctl's short-unix and short-full), and in the host's local time
where the line gives none (syslog's `Nov 29 18:10:02`, dmesg -T and its reltime stamp, in any
locale's month names), each in several zones. A stamp that says no wall time (seconds since
some boot, a delta), or one that cannot be read, gives the time of the read; a stamp after the
reader's clock is not trusted past it."""

from __future__ import annotations

import itertools
import json
import subprocess
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from agent.contracts.collector import MemoryKeyValueStore
from collectors.kernel_log.kmsg import FileLogReader
from collectors.kernel_log.parse import parse_line
from tests.support.locales import compile_locales, environment
from tests.support.zones import ZONES, local_epoch, local_zone

XID = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus."
STAMP = "2026-11-29T18:10:02.123456+00:00"
WHEN = datetime.fromisoformat(STAMP).timestamp()
NOW = WHEN + 6 * 3600.0  # the agent reads the file six hours later
HOST = "gpu-host-17"

# Stamps that carry their zone: the same instant in every local zone.
ZONED = [
    (f"{STAMP} {HOST} kernel: {XID}", WHEN),  # journalctl -o short-iso-precise, rsyslog RFC 3339
    (f"2026-11-29T18:10:02+0000 {HOST} kernel: {XID}", WHEN - 0.123456),  # short-iso
    (f"2026-11-29T20:10:02+02:00 {HOST} kernel: {XID}", WHEN - 0.123456),
    (f"2026-11-29T13:10:02.123456-05:00 {HOST} kernel: {XID}", WHEN),
    (f"2026-11-29T18:10:02Z {HOST} kernel: {XID}", WHEN - 0.123456),
    (f"<4>1 {STAMP} {HOST} kernel - - - {XID}", WHEN),  # RFC 5424 file
    (f"1 2026-11-29T18:10:02.123Z {HOST} kernel - - - {XID}", WHEN - 0.000456),
    (f"kern  :err   : 2026-11-29T18:10:02,123456+00:00 {XID}", WHEN),  # dmesg -x iso
    (f"2026-11-29T18:10:02,123456+00:00 {XID}", WHEN),  # dmesg --time-format iso
    (f"<3>2026-11-29T18:10:02,123456+00:00 {XID}", WHEN),  # dmesg -r --time-format iso
    (f"{WHEN:.6f} {HOST} kernel: {XID}", WHEN),  # journalctl -o short-unix
    (f"{WHEN:.6f} kernel: {XID}", WHEN),  # short-unix --no-hostname
    (f"Sun 2026-11-29 18:10:02 UTC {HOST} kernel: {XID}", WHEN - 0.123456),  # short-full
    (f"Sun 2026-11-29 18:10:02.123456 GMT {HOST} kernel: {XID}", WHEN),
    (f"So 2026-11-29 20:10:02 +0200 {HOST} kernel: {XID}", WHEN - 0.123456),
    (f"日 2026-11-29 18:10:02 UTC {HOST} kernel: {XID}", WHEN - 0.123456),  # zh_CN, ja_JP
    (f"일 2026-11-29 18:10:02.123456 UTC kernel: {XID}", WHEN),  # ko_KR
    (
        json.dumps(
            {
                "MESSAGE": XID,
                "_TRANSPORT": "kernel",
                "SYSLOG_FACILITY": "0",
                "__REALTIME_TIMESTAMP": str(round(WHEN * 1e6)),
                "_SOURCE_MONOTONIC_TIMESTAMP": "5123456789",
            }
        ),
        WHEN,
    ),  # journalctl -o json: its wall time, not the kernel's time since boot
]

# Stamps without a zone are the host's local time: (line, local fields, microseconds).
LOCAL = [
    (f"Nov 29 18:10:02 {HOST} kernel: {XID}", (2026, 11, 29, 18, 10, 2), 0),
    (f"Nov 29 18:10:02.123456 {HOST} kernel: {XID}", (2026, 11, 29, 18, 10, 2), 123456),
    (f"Nov 29 18:10:02 kernel: {XID}", (2026, 11, 29, 18, 10, 2), 0),  # --no-hostname
    (f"Nov  9 08:05:07 {HOST} kernel: [ 5123.456789] {XID}", (2026, 11, 9, 8, 5, 7), 0),
    (f"2026-11-29T18:10:02 {HOST} kernel: {XID}", (2026, 11, 29, 18, 10, 2), 0),
    (f"2026-11-29T18:10:02.5 {HOST} kernel: {XID}", (2026, 11, 29, 18, 10, 2), 500000),
    (f"[Sun Nov 29 18:10:02 2026] {XID}", (2026, 11, 29, 18, 10, 2), 0),  # dmesg -T
    (f"[Mon Nov  9 18:10:02 2026] {XID}", (2026, 11, 9, 18, 10, 2), 0),
    (f"[Sun Nov 29 18:10:02 2026 <    0.000012>] {XID}", (2026, 11, 29, 18, 10, 2), 0),  # -T -d
    (f"kern  :err   : [Sun Nov 29 18:10:02 2026] {XID}", (2026, 11, 29, 18, 10, 2), 0),
    (f"[Nov29 18:10] {XID}", (2026, 11, 29, 18, 10, 0), 0),  # dmesg -e's time break
    (f"[Nov 9 18:10] {XID}", (2026, 11, 9, 18, 10, 0), 0),
    # The months in the reader's locale (glibc's names: de_DE, fr_FR, ru_RU, pl_PL, zh_CN,
    # ja_JP, ko_KR).
    (f"[So Nov 29 18:10:02 2026] {XID}", (2026, 11, 29, 18, 10, 2), 0),
    (f"[dim. nov. 29 18:10:02 2026] {XID}", (2026, 11, 29, 18, 10, 2), 0),
    (f"[вс ноя 29 18:10:02 2026] {XID}", (2026, 11, 29, 18, 10, 2), 0),
    (f"[日 11月 29 18:10:02 2026] {XID}", (2026, 11, 29, 18, 10, 2), 0),
    (f"[木  1月  8 18:10:02 2026] {XID}", (2026, 1, 8, 18, 10, 2), 0),
    (f"[일 11월 29 18:10:02 2026] {XID}", (2026, 11, 29, 18, 10, 2), 0),
    (f"[11월29 18:10] {XID}", (2026, 11, 29, 18, 10, 0), 0),
    (f"[févr.28 18:10] {XID}", (2026, 2, 28, 18, 10, 0), 0),
    (f"nov. 29 18:10:02 {HOST} kernel: {XID}", (2026, 11, 29, 18, 10, 2), 0),
    (f"ноя 29 18:10:02 kernel: {XID}", (2026, 11, 29, 18, 10, 2), 0),
    (f"lis 29 18:10:02.123456 {HOST} kernel: {XID}", (2026, 11, 29, 18, 10, 2), 123456),
    (f"Mär 01 18:10:02 {HOST} kernel: {XID}", (2026, 3, 1, 18, 10, 2), 0),
    # journalctl's short stamps in the CJK locales (zh_CN; ja_JP and ko_KR pad the months 1 to
    # 9 with a space, which then starts the line).
    (f"11月 29 18:10:02 {HOST} kernel: {XID}", (2026, 11, 29, 18, 10, 2), 0),
    (f"1月 08 18:10:02 kernel: {XID}", (2026, 1, 8, 18, 10, 2), 0),
    (f" 1月 08 18:10:02 {HOST} kernel: {XID}", (2026, 1, 8, 18, 10, 2), 0),
    (f" 2월 08 18:10:02.123456 kernel: {XID}", (2026, 2, 8, 18, 10, 2), 123456),
    (f"11월 29 18:10:02.123456 {HOST} kernel: {XID}", (2026, 11, 29, 18, 10, 2), 123456),
]

# No wall time in the line, or one that cannot be read: the time of the read.
READ_TIME = [
    f"[   12.345678] {XID}",  # seconds since a boot, which boot not said
    f"[    5.123456 <    0.000012>] {XID}",  # dmesg -d
    f"[  +0.000123] {XID}",  # dmesg -e's delta
    f"<3>[ 5123.456789] {XID}",  # dmesg -r
    f"4,1005,5123456789,-;{XID}",  # raw records saved to a file
    f"[ 5123.456789] {HOST} kernel: {XID}",  # journalctl -o short-monotonic
    f"123456789.123456 {HOST} kernel: {XID}",  # short-monotonic's size, unix-like: 1973
    XID,  # no stamp at all (dmesg -t)
    # Garbage where a stamp goes: the line is read, its time is the read's.
    f"[Sun Foo 29 18:10:02 2026] {XID}",
    f"[Sun Nov 31 18:10:02 2026] {XID}",
    f"[Sun Nov 29 25:10:02 2026] {XID}",
    f"Foo 29 18:10:02 {HOST} kernel: {XID}",
    f"Nov 29 18:61:02 {HOST} kernel: {XID}",
    f"2026-13-45T18:10:02+00:00 {HOST} kernel: {XID}",
    f"2026-11-29T18:10:02+99:00 {HOST} kernel: {XID}",
    f"Sun 2026-11-29 18:10:02 XYZ {HOST} kernel: {XID}",
    f"[Foo29 18:10] {XID}",
    # A stamp after the reader's clock (a skewed sender) is not trusted past now.
    f"2027-11-29T18:10:02+00:00 {HOST} kernel: {XID}",
    f"{NOW + 3600:.6f} {HOST} kernel: {XID}",
]


@pytest.fixture(params=sorted(ZONES))
def zone(request: pytest.FixtureRequest) -> Iterator[str]:
    with local_zone(request.param):
        yield request.param


def _time_of(line: str, tmp_path: Path, now: float = NOW) -> float:
    path = tmp_path / "kern.log"
    path.write_text(line + "\n", encoding="utf-8")
    reader = FileLogReader(path, MemoryKeyValueStore(), clock=lambda: now)
    [record] = reader.read().records
    assert record.message == XID
    return reader.record_time(record)


@pytest.mark.parametrize(("line", "expected"), ZONED)
def test_a_zoned_stamp_is_its_instant(
    line: str, expected: float, zone: str, tmp_path: Path
) -> None:
    assert _time_of(line, tmp_path) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize(("line", "fields", "micro"), LOCAL)
def test_a_stamp_without_zone_is_local_time(
    line: str, fields: tuple[int, ...], micro: int, zone: str, tmp_path: Path
) -> None:
    expected = local_epoch(zone, *fields, micro=micro)
    assert expected < NOW  # else it would be capped: the case would test the cap
    assert _time_of(line, tmp_path) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("line", READ_TIME)
def test_no_wall_time_in_the_line_gives_the_read_time(line: str, zone: str, tmp_path: Path) -> None:
    assert _time_of(line, tmp_path) == NOW


@pytest.mark.parametrize(
    ("line", "after"),
    [
        (f"2026-11-29T18:10:02Z {HOST} kernel: {XID}", 0.6),
        (f"Nov 29 18:10:02 {HOST} kernel: {XID}", 0.6),
        (f"[Nov29 18:10] {XID}", 42.0),
    ],
)
def test_a_read_inside_the_stamps_own_second_or_minute_is_the_finer_time(
    line: str, after: float, tmp_path: Path
) -> None:
    """A stamp names the start of its second (or minute): a line read live, inside it, has
    the read's time, which says more."""
    with local_zone("UTC0"):
        start = local_epoch("UTC0", 2026, 11, 29, 18, 10, 0 if "[Nov29" in line else 2)
        assert _time_of(line, tmp_path, now=start + after) == start + after
        # Past it, the stamp's own time.
        assert _time_of(line, tmp_path, now=start + 3600) == start


# Every month in every locale the month table names, as glibc's strftime writes it (`date`
# calls it as dmesg and journalctl do), compiled here with `localedef` from glibc's sources
# into a directory of the test's own (LOCPATH): the table is checked against the C library.
GLIBC_LOCALES = [
    "C",
    "de_DE",
    "fr_FR",
    "es_ES",
    "it_IT",
    "pt_BR",
    "pt_PT",
    "nl_NL",
    "pl_PL",
    "sv_SE",
    "ru_RU",
    "uk_UA",
    "cs_CZ",
    "tr_TR",
    "zh_CN",
    "ja_JP",
    "ko_KR",
]
GLIBC_SHAPES = {
    "syslog": "%b %d %H:%M:%S gpu-host-17 kernel: ",
    "journalctl short-precise": "%b %d %H:%M:%S.123456 kernel: ",
    "journalctl short-full": "%a %Y-%m-%d %H:%M:%S UTC gpu-host-17 kernel: ",
    "dmesg -T": "[%a %b %e %H:%M:%S %Y] ",
    "dmesg -e": "[%b%e %H:%M] ",
}
YEAR_END = local_epoch("UTC0", 2026, 12, 31, 23, 0, 0)


@pytest.fixture(scope="module")
def locpath(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_locales(GLIBC_LOCALES[1:], tmp_path_factory.mktemp("locales"))


@pytest.mark.parametrize(
    ("locale", "shape"), list(itertools.product(GLIBC_LOCALES, sorted(GLIBC_SHAPES)))
)
def test_every_month_in_every_locale_known(
    locale: str, shape: str, locpath: Path, tmp_path: Path
) -> None:
    env = environment(locale, locpath)
    with local_zone("UTC0"):
        for month in range(1, 13):
            day = 3 if month % 2 else 28
            prefix = subprocess.run(
                [
                    "date",
                    "-u",
                    "-d",
                    f"2026-{month:02d}-{day:02d} 18:10:02",
                    "+" + GLIBC_SHAPES[shape],
                ],
                env={**env, "TZ": "UTC"},
                capture_output=True,
                text=True,
                check=True,
            ).stdout.rstrip("\n")
            seconds = 0 if shape == "dmesg -e" else 2
            micro = 123456 if "precise" in shape else 0
            expected = local_epoch("UTC0", 2026, month, day, 18, 10, seconds, micro=micro)
            got = _time_of(prefix + XID, tmp_path, now=YEAR_END)
            assert got == pytest.approx(expected, abs=1e-6), prefix
            if "kernel: " in prefix:  # the same stamp on a program's line: not the kernel's
                program = parse_line(prefix.replace("kernel: ", "python3[42]: ") + XID)
                assert program is not None
                assert (program.message, program.from_kernel) == (XID, False), prefix


def test_a_month_padded_with_a_space_is_a_record_of_its_own(tmp_path: Path) -> None:
    """ja_JP and ko_KR pad the months 1 to 9 with a space (` 1月`), as journalctl writes a
    message's further lines indented: a followed file's line in that form is a record with
    its own trust and time, not a further line of the record before it."""
    lines = [
        f"12月 31 23:59:58 {HOST} python3[42]: hello",
        f" 1月 01 00:00:01 {HOST} kernel: {XID}",
        f" 1월 01 00:00:02 {HOST} python3[42]: {XID}",
        f" 1月 01 00:00:03 kernel: {XID}",
    ]
    path = tmp_path / "kern.log"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    with local_zone("UTC0"):
        now = local_epoch("UTC0", 2027, 1, 1, 0, 5, 0)
        reader = FileLogReader(path, MemoryKeyValueStore(), clock=lambda: now)
        records = reader.read().records
        assert [(r.message, r.from_kernel) for r in records] == [
            ("hello", False),
            (XID, True),
            (XID, False),
            (XID, True),
        ]
        assert [reader.record_time(r) for r in records] == [
            local_epoch("UTC0", 2026, 12, 31, 23, 59, 58),
            local_epoch("UTC0", 2027, 1, 1, 0, 0, 1),
            local_epoch("UTC0", 2027, 1, 1, 0, 0, 2),
            local_epoch("UTC0", 2027, 1, 1, 0, 0, 3),
        ]


# A line read live (the reader past its backlog) was written a moment ago, whatever its stamp
# says: a writer in another time zone than the agent's (a container on UTC following the host's
# file in local time, a remote host's lines) writes local stamps hours off, and the finding's
# time would then miss the NVML twin's 5 s window (collectors/_xid.py), raising the Xid twice.
LIVE_LINES = [
    f"Nov 29 {{hour:02d}}:10:02 {HOST} kernel: {XID}",  # syslog, local time
    f"[Sun Nov 29 {{hour:02d}}:10:02 2026] {XID}",  # dmesg -T, local time
    f"2026-11-29T{{hour:02d}}:10:02 {HOST} kernel: {XID}",  # ISO without an offset
    f"2026-11-29T{{hour:02d}}:10:02+00:00 {HOST} kernel: {XID}",  # zoned: the writer's clock
]


def _live_time(line: str, tmp_path: Path, now: float, skewed: int | None = None) -> float:
    """The time of `line` read live at `now`; `skewed`: how many such lines the reader
    should have counted as stamped far before their read."""
    path = tmp_path / "kern.log"
    path.write_text("", encoding="utf-8")
    reader = FileLogReader(path, MemoryKeyValueStore(), clock=lambda: now)
    reader.commit(reader.read())  # the (empty) backlog read to its end: following now
    with path.open("a", encoding="utf-8") as handle:
        handle.write(line + "\n")
    [record] = reader.read().records
    assert record.message == XID
    when = reader.record_time(record)
    if skewed is not None:
        assert reader.skewed_stamps == skewed
    return when


@pytest.mark.parametrize("line", LIVE_LINES)
@pytest.mark.parametrize("hours_off", [-5, -1, 2, 13])
def test_a_live_line_far_from_the_read_is_the_reads_time(
    line: str, hours_off: int, tmp_path: Path
) -> None:
    with local_zone("UTC0"):
        now = local_epoch("UTC0", 2026, 11, 29, 14, 10, 32)
        text = line.format(hour=14 + hours_off)
        assert _live_time(text, tmp_path, now, skewed=int(hours_off < 0)) == now
        # Read as the backlog (a restart, the file's old lines), the same line keeps its stamp
        # where that is not after the read.
        if hours_off < 0:
            assert _time_of(text, tmp_path, now=now) == now + hours_off * 3600 - 30


@pytest.mark.parametrize("line", LIVE_LINES)
def test_a_live_line_keeps_its_stamp_when_it_is_a_moment_old(line: str, tmp_path: Path) -> None:
    """Written a few seconds (or a delayed writer's minutes) before the read: the stamp."""
    with local_zone("UTC0"):
        now = local_epoch("UTC0", 2026, 11, 29, 14, 15, 2)
        assert _live_time(line.format(hour=14), tmp_path, now, skewed=0) == now - 300
