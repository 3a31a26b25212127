"""scan's human output: a summary when the findings fill more than a screen (`--all` for every
one), wrapped to the terminal's width at word boundaries, colour only on a terminal and never
with NO_COLOR, and the malformed and ignored line counts always said."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest

from agent.program.cli import main as cli_main
from tests.support.kmsg import FIXTURES

ROOT = Path(__file__).resolve().parent.parent
XID13 = "[{t:>12.6f}] NVRM: Xid (PCI:0000:86:00): 13, pid=4411, name=train.py, Graphics SM Warp Exception on (GPC 1, TPC 0, SM 1): Out Of Range Address\n"
NOISE = "[{t:>12.6f}] usb 1-1: new high-speed USB device number {n} using xhci_hcd\n"


@pytest.fixture(scope="module")
def big_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """200,000 lines, 50,000 of them the same Xid 13, the rest noise."""
    path = tmp_path_factory.mktemp("scan") / "big.log"
    with path.open("w") as out:
        for n in range(200_000):
            template = XID13 if n % 4 == 1 else NOISE
            out.write(template.format(t=n / 100, n=n))
    return path


def scan(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *args: str
) -> tuple[int, str, str]:
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.delenv("LINES", raising=False)
    code = cli_main(["scan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_many_findings_print_a_short_summary(
    big_log: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, err = scan(capsys, monkeypatch, str(big_log))
    assert code == 1
    lines = out.splitlines()
    assert len(lines) < 25, out
    assert max(len(line) for line in [*lines, *err.splitlines()]) <= 100
    assert "50000 times" in out
    assert "0000:86:00.0" in out and "xid 13" in out
    assert "first line 2" in out and "last line 199998" in out
    assert "--all" in out
    assert out.count("action:") == 1  # meaning and action once per group
    assert "50000 finding(s) in 200000 line(s)" in err


def test_all_lists_every_finding(
    big_log: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, out, _ = scan(capsys, monkeypatch, "--all", str(big_log))
    assert out.count("action:") == 50_000


@pytest.mark.parametrize("columns", ["60", "100", "120"])
@pytest.mark.parametrize("extra", [(), ("--all",)])
def test_wrapped_to_the_width_at_word_boundaries(
    columns: str,
    extra: tuple[str, ...],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every line fits; joining a finding's wrapped lines gives back its meaning word for
    word (nothing cut mid-word)."""
    path = str(FIXTURES / "dmesg.txt")
    _, out, _ = scan(capsys, monkeypatch, "--json", path)
    findings = [json.loads(line) for line in out.splitlines()]
    monkeypatch.setenv("COLUMNS", columns)
    cli_main(["scan", *extra, path])
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= int(columns), out
    flat = " ".join(out.split())
    for finding in findings:
        meaning = finding["meaning"]
        text = f"{finding['name']}: {meaning}" if finding.get("name") else meaning
        assert " ".join(text.split()) in flat, text
        assert " ".join(f"action: {finding['action']}".split()) in flat


def test_counts_always_said(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Malformed and ignored lines are counted even when there are none."""
    _, _, err = scan(capsys, monkeypatch, str(FIXTURES / "dmesg.txt"))
    assert "malformed" in err and "ignored" in err
    _, _, err = scan(capsys, monkeypatch, str(FIXTURES / "h200-kmsg-records.txt"))
    assert "0 malformed line(s)" in err and "0 user-space line(s) ignored" in err


def _on_a_terminal(env: dict[str, str]) -> str:
    """scan's stdout when it is a terminal (a pseudo-terminal of our own)."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent", "scan", str(FIXTURES / "dmesg.txt")],
        cwd=ROOT,
        stdout=follower,
        stderr=subprocess.DEVNULL,
        env={
            **{k: v for k, v in os.environ.items() if k != "NO_COLOR"},
            "COLUMNS": "100",
            "LINES": "200",
            "TERM": "xterm",
            **env,
        },
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(60)
    os.close(leader)
    return b"".join(chunks).decode(errors="replace")


def test_colour_on_a_terminal_unless_no_color() -> None:
    assert "\x1b[" in _on_a_terminal({})
    assert "\x1b[" not in _on_a_terminal({"NO_COLOR": "1"})


def test_no_colour_in_a_pipe(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, out, _ = scan(capsys, monkeypatch, str(FIXTURES / "dmesg.txt"))
    assert "\x1b[" not in out
