"""gpuwarden scan: the same findings from every saved shape, JSON lines, documented exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.program.cli import main as cli_main
from agent.program.commands.scan import exit_code, scan_lines, scan_stream
from collectors._xid_catalog import catalog_version
from collectors.kernel_log.matchers import MatcherSet
from collectors.kernel_log.parse import ParseStats
from tests.support.kmsg import FIXTURES, H200_CAPTURE

SHAPES = ("kmsg.txt", "dmesg.txt", "dmesg-T.txt", "dmesg-decode-iso.txt", "journalctl-k.txt")
ROOT = Path(__file__).resolve().parent.parent

# (kind, xid, pci_bus_id, device, process, pid, severity): what every fixture holds.
EXPECTED = [
    ("xid", 79, "0000:3b:00.0", None, "python3", 2314, "critical"),
    ("xid", 13, "0000:86:00.0", None, "train.py", 4411, "warning"),
    ("xid", 94, "0000:86:00.0", None, None, None, "warning"),
    ("xid", 999, "0000:c1:00.0", None, "sim", 77, "warning"),
    ("sxid", 20034, "0000:07:00.0", "nvidia-nvswitch2", None, None, "critical"),
    ("sxid", 12028, "0000:05:00.0", "nvidia-nvswitch0", None, None, "warning"),
    ("gpu_fallen_off_bus", None, "0000:18:00.0", None, None, None, "critical"),
    ("io_error", None, None, "sdb", None, None, "critical"),
    ("fs_error", None, None, "sdb1", None, None, "critical"),
    ("fs_error", None, None, "nvme1n1p1", None, None, "critical"),
    ("nvme_error", None, None, "nvme1", None, None, "warning"),
    ("oom_kill", None, None, None, "python3", 9876, "warning"),
    ("hung_task", None, None, None, "kworker/u64:2", 812, "warning"),
]


def run_scan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli_main(["scan", *args])
    out, err = capsys.readouterr()
    return code, out, err


class TestFormats:
    """Every saved shape of the same log gives the same findings."""

    @pytest.mark.parametrize("name", SHAPES)
    def test_json_findings(self, name: str, capsys: pytest.CaptureFixture[str]) -> None:
        """Kinds, codes, normalised PCI ids, devices, processes, severities; line numbers point
        at the line that says it; a critical finding exits 2."""
        path = FIXTURES / name
        code, out, err = run_scan(capsys, "--json", str(path))
        findings = [json.loads(line) for line in out.splitlines()]
        got = [
            (
                f["kind"],
                f.get("xid"),
                f.get("pci_bus_id"),
                f.get("device"),
                f.get("process"),
                f.get("pid"),
                f["severity"],
            )
            for f in findings
        ]
        assert got == EXPECTED
        lines = path.read_text(errors="replace").splitlines()
        for finding in findings:
            assert finding["meaning"]
            assert finding["action"]
            assert finding["message"] in lines[finding["line"] - 1]
        assert code == 2
        # Every line is counted; the fixture's one malformed line holds none of the words a
        # finding needs, so scan does not parse it (tests/test_kernel_log_records.py: a
        # malformed line that holds one is parsed and counted).
        assert f"13 finding(s) in {len(lines)} line(s)" in err

    def test_forged_lines_are_reported_as_ignored(self, capsys: pytest.CaptureFixture[str]) -> None:
        """Shapes that carry the facility drop the user-space Xid and say so."""
        for name in ("kmsg.txt", "dmesg-decode-iso.txt", "journalctl-k.txt"):
            _, out, err = run_scan(capsys, "--json", str(FIXTURES / name))
            assert "forged" not in out
            assert "name=fake" not in out
            assert "1 finding(s) from user-space lines ignored" in err

    def test_human_table(self, capsys: pytest.CaptureFixture[str]) -> None:
        """The table names the finding, where it is, what it means and what to do."""
        code, out, _ = run_scan(capsys, str(FIXTURES / "dmesg.txt"))
        assert code == 2
        assert out.splitlines()[0].split()[:4] == ["LINE", "SEVERITY", "KIND", "WHERE"]
        assert "xid 79" in out
        assert "0000:3b:00.0" in out
        assert "GPU has fallen off the bus" in out
        assert "action: drain the node and restart the machine" in out
        assert "kworker/u64:2[812]" in out


class TestExitCodes:
    """0 nothing found, 1 warnings at most, 2 critical or unreadable."""

    def test_clean_log(self, capsys: pytest.CaptureFixture[str]) -> None:
        """The H200 capture holds no findings: no output, exit 0."""
        code, out, err = run_scan(capsys, "--json", str(H200_CAPTURE))
        assert (code, out) == (0, "")
        assert "0 finding(s)" in err

    def test_warnings_only(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """An application Xid and an OOM kill are warnings: exit 1."""
        log = tmp_path / "warn.log"
        log.write_text(
            "[  1.0] NVRM: Xid (PCI:0000:3b:00): 13, Graphics Exception\n"
            "[  2.0] Out of memory: Killed process 1 (x) total-vm:1kB\n"
        )
        code, out, _ = run_scan(capsys, "--json", str(log))
        assert code == 1
        assert len(out.splitlines()) == 2

    @pytest.mark.parametrize("target", ["absent.log", "."])
    def test_unreadable(
        self, target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """A missing file or a directory: exit 2 with the path in the message."""
        path = tmp_path / target
        code, out, err = run_scan(capsys, str(path))
        assert (code, out) == (2, "")
        assert f"cannot read {path}" in err

    def test_real_process_and_help(self, tmp_path: Path) -> None:
        """The installed entry point: stdin as `-`, exit codes documented in --help."""
        proc = subprocess.run(
            [sys.executable, "-m", "agent", "scan", "--json", "-"],
            cwd=ROOT,
            text=True,
            input="[  5.0] INFO: task python3:55012 blocked for more than 245 seconds.\n",
            capture_output=True,
            timeout=60,
            check=False,
        )
        assert proc.returncode == 1
        assert json.loads(proc.stdout)["kind"] == "hung_task"
        helptext = subprocess.run(
            [sys.executable, "-m", "agent", "scan", "--help"],
            cwd=ROOT,
            text=True,
            capture_output=True,
            timeout=60,
            check=True,
        ).stdout
        assert (
            "Exit codes: 0 no findings (info findings alone, such as all-clears, are clean); 1 "
            "findings, none worse than warning, or a kernel record journalctl did not print "
            "(saved without --all); 2 a critical (or fatal) finding, or the file could not be "
            "read to its end." in " ".join(helptext.split())
        )

    def test_help_names_the_catalog_version(self, capsys: pytest.CaptureFixture[str]) -> None:
        """`scan --help` says which Xid/SXid catalog (version and sources) judges the log."""
        with pytest.raises(SystemExit):
            cli_main(["scan", "--help"])
        helptext = " ".join(capsys.readouterr().out.split())
        assert f"Xid catalog {catalog_version()}" in helptext
        assert "595.45.04" in helptext


class TestReading:
    """The file is read as bytes, cut at \\n only, in bounded pieces."""

    def test_only_newline_ends_a_line(self, tmp_path: Path) -> None:
        """\\r and the other characters splitlines() breaks at, inside a line, are text: the
        Xid after them is on the line the file says (standard input and a file alike)."""
        inner = "\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
        text = "".join(f"[   {i}.0] noise {i}{inner}more\n" for i in range(1, 8))
        text += "[   9.0] NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus.\r\n"
        path = tmp_path / "kern.log"
        path.write_bytes(text.encode())
        for args in (["--json", str(path)], ["--json", "-"]):
            proc = subprocess.run(
                [sys.executable, "-m", "agent", "scan", *args],
                cwd=ROOT,
                input=text.encode(),
                capture_output=True,
                timeout=60,
                check=False,
            )
            [finding] = [json.loads(line) for line in proc.stdout.decode().splitlines()]
            assert (finding["line"], finding["xid"]) == (8, 79)
            assert "(0 malformed line(s) skipped" in proc.stderr.decode()
            assert "in 8 line(s)" in proc.stderr.decode()

    def test_line_longer_than_a_chunk(self, tmp_path: Path) -> None:
        """A line of 3 MiB without a newline is one malformed line; what follows is read."""
        path = tmp_path / "kern.log"
        with path.open("wb") as handle:
            handle.write(b"[   1.0] start\n" + b"y" * (3 * 1024 * 1024) + b"\n")
            handle.write(b"[   2.0] INFO: task python3:55012 blocked for more than 245 seconds.\n")
        stats = ParseStats()
        with path.open("rb") as handle:
            findings = scan_stream(handle, stats)
        assert [(f.line, f.kind) for f in findings] == [(3, "hung_task")]
        # `start` holds no trigger word: counted as a line, never parsed (scan's prefilter).
        assert (stats.lines, stats.records, stats.malformed) == (3, 1, 1)


class TestPrefilterKeepsTrust:
    """scan parses only the lines holding a trigger word; an indented line that does still
    belongs to the record above it, trigger word or not (class 9 of issue 12)."""

    @pytest.mark.parametrize(
        "head",
        [
            "<14>[   13.000000] hello from a job",
            "user  :info  : [   13.000000] hello from a job",
            "Nov 29 18:10:02 gpu-host-17 python3[42]: hello from a job",
        ],
    )
    def test_forged_second_line_is_not_trusted(self, head: str) -> None:
        forged = " " * 19 + "NVRM: Xid (PCI:0000:86:00): 79, pid=1, name=fake, its second line"
        lines = ["[    1.000000] usb 1-1: new device", head, forged, "[    2.0] tail"]
        stats, matchers = ParseStats(), MatcherSet()
        assert scan_lines(lines, stats, matchers) == []
        assert matchers.ignored["xid"] == 1
        assert stats.lines == 4

    def test_kernel_second_line_is_still_the_kernels(self) -> None:
        """A kernel message's second line under a first line the prefilter skips is still
        the kernel's."""
        lines = [
            "[   12.345678] somedrv 0000:01:00.0: the first line of two",
            "               NVRM: Xid (PCI:0000:86:00): 79, pid=1, name=x, its second line",
        ]
        assert [(f.line, f.kind) for f in scan_lines(lines)] == [(2, "xid")]


class TestProperties:
    """No file content crashes scan."""

    @given(st.lists(st.text(max_size=150), max_size=40))
    def test_any_lines(self, lines: list[str]) -> None:
        """Any lines give findings with line numbers inside the file, and an exit code."""
        stats = ParseStats()
        findings = scan_lines(lines, stats)
        assert all(1 <= f.line <= len(lines) for f in findings)
        assert exit_code(findings) in (0, 1, 2)
        assert stats.lines == len(lines)
