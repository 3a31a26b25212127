"""glibc locales compiled for a test from glibc's own sources (`localedef`), into a directory
of the test's (LOCPATH), so that `date`, `journalctl` and the like write their stamps as on a
host in that locale without the host having the locale installed.

The sources are Debian's `locales` package (/usr/share/i18n/locales), which `make test`
installs (Makefile DEBS)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

import pytest

SOURCES = Path("/usr/share/i18n/locales")


def compile_locales(names: Iterable[str], where: Path) -> Path:
    """Each locale `name` (`ja_JP`) compiled as `name.UTF-8` under `where`: the LOCPATH."""
    if shutil.which("localedef") is None or not SOURCES.is_dir():
        pytest.fail("needs localedef and glibc's locale sources: `make test` installs locales")
    for name in names:
        subprocess.run(
            ["localedef", "-i", name, "-f", "UTF-8", str(where / f"{name}.UTF-8")],
            check=True,
            capture_output=True,
        )
    return where


def environment(locale: str, locpath: Path) -> dict[str, str]:
    """What a program run in `locale` (`C`, or a name compiled under `locpath`) needs."""
    return {"LOCPATH": str(locpath), "LC_ALL": "C" if locale == "C" else f"{locale}.UTF-8"}
