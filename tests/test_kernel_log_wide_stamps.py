"""The real `dmesg` in locales whose month and day names are wide characters (glibc's zh_CN,
ja_JP, ko_KR: `四`, `12月`, ja_JP's and ko_KR's ` 1月` padded with a space), and given more
than one `--time-format`: the Xid is found and its stamp read or marked unreadable.

The locales are compiled here with `localedef` from glibc's sources (/usr/share/i18n/locales)
into a directory of the test's own (LOCPATH), so nothing of the system's changes.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from collectors.kernel_log.matchers import MatcherSet
from collectors.kernel_log.parse import parse_line
from tests.support.kmsg import write_device

LOCALES = ("zh_CN", "ja_JP", "ko_KR")
DECODE = re.compile(r"[a-z0-9]+ *:[a-z]+ *: ")
SOURCES = Path("/usr/share/i18n/locales")


def _usable() -> bool:
    return (
        os.geteuid() == 0
        and os.access("/dev/kmsg", os.W_OK)
        and shutil.which("dmesg") is not None
        and shutil.which("localedef") is not None
        and all((SOURCES / name).exists() for name in LOCALES)
    )


pytestmark = pytest.mark.skipif(not _usable(), reason="needs root, dmesg and glibc's locales")


@pytest.fixture(scope="module")
def locpath(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("locales")
    for name in LOCALES:
        subprocess.run(
            ["localedef", "-i", name, "-f", "UTF-8", str(where / f"{name}.UTF-8")],
            check=True,
            capture_output=True,
        )
    return where


@pytest.fixture(scope="module")
def tag() -> str:
    name = "wide" + uuid.uuid4().hex[:10]
    write_device(
        f"<3>NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name={name}, GPU has fallen off the bus.\n"
    )
    return name


def _dmesg(tag: str, args: list[str], env: dict[str, str] | None = None) -> str:
    out = subprocess.run(
        ["dmesg", *args], capture_output=True, text=True, check=True, env=env
    ).stdout
    [line] = [line for line in out.splitlines() if f"name={tag}," in line]
    return line


def _check(line: str) -> None:
    """The message whole, the stamp kept (read, or marked unreadable) where the line has one,
    the facility dmesg printed kept (the record is a process's write: user with -x and -r),
    and the Xid found in the message as it would be in the kernel's record."""
    record = parse_line(line, 1)
    assert record is not None
    assert record.message.startswith("NVRM: Xid (PCI:0000:3b:00): 79,"), (line, record)
    stamped = not DECODE.sub("", line).startswith("NVRM: ")
    assert bool(record.timestamp or record.unreadable_timestamp) == stamped, (line, record)
    if DECODE.match(line) or line.startswith("<"):
        assert not record.from_kernel, (line, record)
    findings = list(MatcherSet().scan([record._replace(facility=0)]))
    assert [finding.kind for finding in findings] == ["xid"], (line, findings)


@pytest.mark.parametrize("args", [["-T"], ["-T", "-x"], ["-e"], ["-e", "-x"]])
@pytest.mark.parametrize("locale", LOCALES)
def test_wide_names(locale: str, args: list[str], locpath: Path, tag: str) -> None:
    env = {**os.environ, "LOCPATH": str(locpath), "LC_ALL": f"{locale}.UTF-8"}
    line = _dmesg(tag, args, env)
    if "-T" in args:
        assert not line.isascii(), line  # the locale was in effect: its names are in the stamp
    _check(line)


# dmesg's stamps as glibc's strftime writes them in the locale (`date` calls it as dmesg does):
# -T's `%a %b %e %H:%M:%S %Y` and -e's time break `%b%e %H:%M`, on a day of every month (the
# months 1 to 9 are where ja_JP and ko_KR pad the name with a space) and on one-digit days.
STAMPS = {"dmesg-T": "[%a %b %e %H:%M:%S %Y] ", "dmesg-e": "[%b%e %H:%M] "}
DAYS = [f"2026-{month:02d}-{day:02d} 18:10:02" for month in range(1, 13) for day in (1, 28)]


@pytest.mark.parametrize("stamp", sorted(STAMPS))
@pytest.mark.parametrize("locale", LOCALES)
def test_wide_names_every_month(locale: str, stamp: str, locpath: Path) -> None:
    env = {**os.environ, "LOCPATH": str(locpath), "LC_ALL": f"{locale}.UTF-8", "TZ": "UTC"}
    message = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus."
    for day in DAYS:
        prefix = subprocess.run(
            ["date", "-d", day, "+" + STAMPS[stamp]],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.rstrip("\n")
        assert not prefix.isascii(), prefix
        _check(prefix + message)


@pytest.mark.parametrize(
    "formats",
    [
        ("iso", "reltime"),
        ("ctime", "iso"),
        ("reltime", "iso"),
        ("delta", "ctime"),
        ("notime", "iso"),
        ("iso", "notime"),
        ("ctime", "delta", "iso"),
    ],
)
@pytest.mark.parametrize("decode", [False, True])
def test_time_format_given_more_than_once(formats: tuple[str, ...], decode: bool, tag: str) -> None:
    """util-linux 2.38 keeps the last `--time-format`; later versions may print several."""
    args = [arg for name in formats for arg in ("--time-format", name)]
    _check(_dmesg(tag, args + (["-x"] if decode else [])))
