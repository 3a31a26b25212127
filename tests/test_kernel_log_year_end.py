"""Year-less stamps (syslog's `Dec 31 23:59:59`, dmesg -e's `Dec31 23:59`) across a year's end:
the line goes in the year it was written in. The rule (collectors/kernel_log/stamps.py): the
year that puts the stamp latest but not more than a day after a reference, which is now for a
followed file, and for `gpuwarden scan` the next line's time, the last line's the file's
modification time, so that a whole file's times never run backwards."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.contracts.collector import MemoryKeyValueStore
from agent.program.cli import main as cli_main
from collectors.kernel_log.kmsg import FileLogReader
from tests.support.zones import ZONES, local_epoch, local_zone


def xid(pid: int) -> str:
    return f"NVRM: Xid (PCI:0000:3b:00): 79, pid={pid}, name=x, GPU has fallen off the bus."


# A year-less stamp in each shape that writes one, from its local fields.
SHAPES = {
    "syslog": lambda m, d, t: f"{m} {d:2d} {t} gpu-host-17 kernel: ",
    "syslog 2-digit day": lambda m, d, t: f"{m} {d:02d} {t} gpu-host-17 kernel: ",
    "journalctl short-precise": lambda m, d, t: f"{m} {d:02d} {t}.250000 kernel: ",
    "kern.log, printk time kept": lambda m, d, t: f"{m} {d:2d} {t} gpu-host-17 kernel: [ 5.1] ",
    "dmesg -e": lambda m, d, t: f"[{m}{d:2d} {t[:5]}] ",
}
MICRO = {"journalctl short-precise": 250000}
NAMES = {  # glibc's abbreviated January and December, and one month more
    "C": ("Jan", "Dec", "Feb", "Nov"),
    "de_DE": ("Jan", "Dez", "Feb", "Nov"),
    "fr_FR": ("janv.", "déc.", "févr.", "nov."),
    "ru_RU": ("янв", "дек", "фев", "ноя"),
    "zh_CN": ("1月", "12月", "2月", "11月"),
    "ja_JP": (" 1月", "12月", " 2月", "11月"),  # ja_JP and ko_KR pad 1 to 9 with a space
    "ko_KR": (" 1월", "12월", " 2월", "11월"),
}


@pytest.fixture(params=sorted(ZONES))
def zone(request: pytest.FixtureRequest) -> Iterator[str]:
    with local_zone(request.param):
        yield request.param


def _line(shape: str, month: str, day: int, clock: str, pid: int) -> str:
    return SHAPES[shape](month, day, clock) + xid(pid)


def _local(zone: str, shape: str, *fields: int) -> float:
    if shape == "dmesg -e":
        fields = (*fields[:5], 0)
    return local_epoch(zone, *fields, micro=MICRO.get(shape, 0))


def _followed(lines: list[str], tmp_path: Path, now: float) -> list[float]:
    path = tmp_path / "kern.log"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    reader = FileLogReader(path, MemoryKeyValueStore(), clock=lambda: now)
    return [reader.record_time(record) for record in reader.read().records]


@pytest.mark.parametrize("names", sorted(NAMES))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_followed_file_read_on_new_year_puts_last_years_line_last_year(
    shape: str, names: str, zone: str, tmp_path: Path
) -> None:
    jan, dec, _, _ = NAMES[names]
    now = local_epoch(zone, 2027, 1, 1, 0, 5, 30)
    lines = [
        _line(shape, dec, 31, "23:59:59", 1),
        _line(shape, jan, 1, "00:00:01", 2),
        _line(shape, dec, 30, "08:00:00", 3),  # a backlog read late, out of order
    ]
    assert _followed(lines, tmp_path, now) == pytest.approx(
        [
            _local(zone, shape, 2026, 12, 31, 23, 59, 59),
            _local(zone, shape, 2027, 1, 1, 0, 0, 1),
            _local(zone, shape, 2026, 12, 30, 8, 0, 0),
        ],
        abs=1e-6,
    )


@pytest.mark.parametrize(
    ("now", "expected"),
    [
        ((2029, 3, 1, 9, 0, 0), (2028, 2, 29, 12, 0, 0)),  # the last leap year's day
        ((2028, 3, 1, 9, 0, 0), (2028, 2, 29, 12, 0, 0)),
        ((2027, 12, 31, 23, 0, 0), (2024, 2, 29, 12, 0, 0)),  # none since 2024
    ],
)
def test_feb_29_goes_in_a_leap_year(
    now: tuple[int, ...], expected: tuple[int, ...], zone: str, tmp_path: Path
) -> None:
    when = _followed([_line("syslog", "Feb", 29, "12:00:00", 1)], tmp_path, local_epoch(zone, *now))
    assert when == [local_epoch(zone, *expected)]


def _scan_times(path: Path, capsys: pytest.CaptureFixture[str]) -> list[float | None]:
    cli_main(["scan", "--json", str(path)])
    return [json.loads(line).get("time") for line in capsys.readouterr().out.splitlines()]


@pytest.mark.parametrize("names", sorted(NAMES))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_scan_of_a_log_across_new_year(
    shape: str, names: str, zone: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A log from Dec 31 to Jan 1, saved (modified) on Jan 1: each line in its year, the
    times in line order."""
    jan, dec, _, _ = NAMES[names]
    path = tmp_path / "kern.log"
    lines = [
        _line(shape, dec, 31, "23:58:00", 1),
        "Dec 31 23:59:00 gpu-host-17 systemd[1]: Starting something...",
        _line(shape, dec, 31, "23:59:59", 2),
        _line(shape, jan, 1, "00:00:02", 3),
        _line(shape, jan, 1, "00:03:00", 4),
    ]
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    saved = local_epoch(zone, 2027, 1, 1, 0, 4, 0)
    os.utime(path, (saved, saved))
    times = _scan_times(path, capsys)
    assert times == pytest.approx(
        [
            _local(zone, shape, 2026, 12, 31, 23, 58, 0),
            _local(zone, shape, 2026, 12, 31, 23, 59, 59),
            _local(zone, shape, 2027, 1, 1, 0, 0, 2),
            _local(zone, shape, 2027, 1, 1, 0, 3, 0),
        ],
        abs=1e-6,
    )


def test_scan_of_a_log_over_several_year_ends(
    zone: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nov 2025 to Jan 2027 in one file (rotated logs joined with cat): every line in its
    year, monotone; the year a line is in comes from the lines after it, not from the file's
    date alone (which would put the Nov 2025 line in 2026)."""
    path = tmp_path / "kern.log"
    stamps = [("Nov", 20, 2025), ("Feb", 3, 2026), ("Jun", 3, 2026), ("Nov", 3, 2026)]
    stamps += [("Dec", 31, 2026), ("Jan", 1, 2027)]
    # Zones' offsets hold from November to March: June's line has its own.
    path.write_text(
        "".join(
            _line("syslog", month, day, "12:00:00", pid) + "\n"
            for pid, (month, day, _) in enumerate(stamps, 1)
        ),
        encoding="utf-8",
    )
    saved = local_epoch(zone, 2027, 1, 2, 0, 0, 0)
    os.utime(path, (saved, saved))
    times = _scan_times(path, capsys)
    assert all(isinstance(t, float) for t in times)
    years = [_year(t) for t in times if t is not None]
    assert years == [year for _, _, year in stamps]
    assert times == sorted(times, key=lambda t: t or 0.0)


def _year(when: float) -> int:
    import time

    return time.localtime(when).tm_year


def test_scan_time_of_a_zoned_stamp_is_its_instant(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "kern.log"
    path.write_text(
        f"2026-12-31T23:59:59.5+01:00 gpu-host-17 kernel: {xid(1)}\n[   12.345678] {xid(2)}\n",
        encoding="utf-8",
    )
    assert _scan_times(path, capsys) == [local_epoch("UTC0", 2026, 12, 31, 22, 59, 59) + 0.5, None]
