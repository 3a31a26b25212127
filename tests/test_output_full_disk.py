"""A command whose output the disk does not take says so, with an exit code of its own.

`gpuwarden scan log --json > findings.json` on a full disk: the file holds part of the
findings or none. Before, print() raised OSError: a traceback and exit 1, which `scan`
and `check` document as "warnings found" (a script reading the code took the cut file for
a result). What must hold, for every command that prints a result and wherever the disk
gives out (no room at all, or room for part of the output): exit code 74 (EX_IOERR,
docs/commands.md), a line on stderr that says the output was not written and why, and no
traceback. The disks are real: /dev/full and a small tmpfs, full or nearly full.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from collectors.benchmark.history import HISTORY_FILE
from tests.support.agent_proc import REPO, pythonpath
from tests.support.bench import record
from tests.support.disk import SmallDisk

EX_IOERR = 74
XID = "[  {n}.0] NVRM: Xid (PCI:0000:3b:00): 13, pid={n}, Graphics Exception: ESR 0x{n:x}\n"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A config whose state dir has a benchmark history, and a kernel log of many findings
    (more output than one page of the disk)."""
    where = tmp_path_factory.mktemp("inputs")
    state = where / "state"
    state.mkdir()
    (state / HISTORY_FILE).write_text(
        "".join(record(50.0 + n, 1_780_000_000.0 + 60 * n).to_json() + "\n" for n in range(200))
    )
    (where / "gpuwarden.toml").write_text(f'state_dir = "{state}"\n')
    (where / "kern.log").write_text("".join(XID.format(n=n) for n in range(1, 400)))
    return where


COMMANDS = {
    "config-show": ["config", "show"],
    "config-show-json": ["config", "show", "--json"],
    "config-check": ["config", "check"],
    "scan": ["scan", "{log}"],
    "scan-json": ["scan", "{log}", "--json"],
    "bench-history": ["bench", "--history"],
}


def command(name: str, inputs: Path) -> list[str]:
    words = [w.format(log=inputs / "kern.log") for w in COMMANDS[name]]
    return [*words, "--config", str(inputs / "gpuwarden.toml")]


@dataclass(frozen=True)
class Destination:
    path: Path
    room: int
    """Bytes it takes before it is full."""


@pytest.fixture(params=["dev-full", "disk-full", "disk-nearly-full"])
def destination(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Destination]:
    if request.param == "dev-full":
        yield Destination(Path("/dev/full"), 0)
        return
    with SmallDisk(tmp_path / "out", size=1 << 20) as disk:
        disk.fill()
        room = os.sysconf("SC_PAGE_SIZE") if request.param == "disk-nearly-full" else 0
        if room:  # room for a page of the output: all of a small one, part of a large one
            filler = disk.path / ".filler"
            os.truncate(filler, filler.stat().st_size - room)
        yield Destination(disk.path / "output", room)


def run_to(words: list[str], destination: Path) -> subprocess.CompletedProcess[str]:
    with destination.open("w") as out:
        return subprocess.run(
            [sys.executable, "-m", "agent.program.cli", *words],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": pythonpath(), "COLUMNS": "100"},
            stdout=out,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=False,
        )


@pytest.fixture(scope="module")
def whole(inputs: Path) -> dict[str, subprocess.CompletedProcess[str]]:
    """Each command where its output fits (a pipe), run once."""
    runs = {}
    for name in COMMANDS:
        with open(os.devnull, "w") as sink:
            runs[name] = subprocess.run(
                [sys.executable, "-m", "agent.program.cli", *command(name, inputs)],
                cwd=REPO,
                env={**os.environ, "PYTHONPATH": pythonpath(), "COLUMNS": "100"},
                stdout=subprocess.PIPE,
                stderr=sink,
                text=True,
                timeout=120,
                check=False,
            )
    return runs


@pytest.mark.parametrize("name", list(COMMANDS))
def test_output_the_disk_refuses_is_said_with_its_own_exit_code(
    name: str,
    inputs: Path,
    destination: Destination,
    whole: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    words = command(name, inputs)
    fits = whole[name]
    assert fits.returncode != EX_IOERR
    done = run_to(words, destination.path)
    assert "Traceback" not in done.stderr, done.stderr
    if len(fits.stdout.encode()) <= destination.room:  # it fits: whole, and no false alarm
        assert done.returncode == fits.returncode, done.stderr
        assert destination.path.read_text() == fits.stdout
        return
    assert done.returncode == EX_IOERR, (done.returncode, done.stderr)
    assert "output not written" in done.stderr, done.stderr
    assert "No space left on device" in done.stderr, done.stderr
    assert str(destination.path) in done.stderr, "the message names where the output went"
