"""check's output as a reader and a program meet it: a versioned JSON with stable check ids (data
apart from the id), an action fit for each failure mode, a summary led by the worst status."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from agent import __version__
from agent.program.commands.check import render_table, summary_line
from agent.program.diagnose import probes
from agent.program.diagnose.check import CheckOptions, CheckReport, run_check
from agent.program.diagnose.findings import Finding, Status, valid_id
from collectors.io_probe import MIB, ProbeRefused, run_write_probe
from tests.support.diag import load, make_proc_tree, write_config

ROOT = Path(__file__).resolve().parent.parent
NO_GPU = ("--no-torch", "--expect-gpus", "0")


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A small tmpfs of our own (we are root): a full disk and a read-only one for real."""
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


class TestJson:
    def test_versioned_and_timed(self, tmp_path: Path) -> None:
        cfg = write_config(tmp_path, proc_root=make_proc_tree(tmp_path / "proc"))
        done = subprocess.run(
            [sys.executable, "-m", "agent", "check", "--config", str(cfg), "--json", *NO_GPU],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd=ROOT,
        )
        data = json.loads(done.stdout)
        assert data["schema_version"] == 2
        assert data["version"] == __version__
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", data["time"])
        when = datetime.strptime(data["time"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
        assert abs((datetime.now(UTC) - when).total_seconds()) < 300
        for finding in data["findings"]:
            assert {"id", "subject", "name", "status", "action"} <= finding.keys()

    async def test_ids_are_stable_and_hold_no_data(self, tmp_path: Path) -> None:
        """Every line's id is a word id; lines about different subjects of one check share
        it; the subject (a path, an address) is in its own field and not in the id."""
        state = tmp_path / "state-dir"
        cfg = load(
            write_config(
                tmp_path,
                proc_root=make_proc_tree(tmp_path / "proc"),
                extra='[mqtt]\nenabled = true\nurl = "mqtt://127.0.0.1:1"\n',
            )
        )
        options = CheckOptions(
            torch=False, expect_gpus=0, process_gap=0.05, io_test_dir=tmp_path / "absent"
        )
        report = await run_check(cfg, options)
        report.findings.append(probes.check_state_dir(state))
        ids = {f.id: f for f in report.findings}
        documented = (ROOT / "docs" / "commands.md").read_text()
        for finding in report.findings:
            assert valid_id(finding.id), finding
            assert f"`{finding.id}`" in documented, finding.id
            if finding.subject:
                assert finding.subject not in finding.id
        assert ids["mqtt_broker"].subject == "127.0.0.1:1"
        assert ids["write_probe"].subject == str(tmp_path / "absent")
        assert ids["state_dir"].subject == str(state)
        assert ids["prometheus_listen"].subject.startswith("127.0.0.1:")

    def test_two_subjects_one_id(self) -> None:
        one, two = probes.check_state_dir(Path("/a")), probes.check_state_dir(Path("/b"))
        assert one.id == two.id == "state_dir"
        assert (one.subject, two.subject) == ("/a", "/b")


class TestActionsFitTheFailure:
    """Each failure mode of a check has its own action, and it names what to do about that
    mode: a missing directory is not told to free space, a missing interpreter is not told to
    be run by hand."""

    async def _io_line(self, tmp_path: Path, directory: Path) -> Finding:
        cfg = load(write_config(tmp_path / "cfg", proc_root=make_proc_tree(tmp_path / "proc")))
        options = CheckOptions(torch=False, expect_gpus=0, process_gap=0.05, io_test_dir=directory)
        report = await run_check(cfg, options)
        (line,) = [f for f in report.findings if f.id == "write_probe"]
        return line

    async def test_write_probe_modes(self, tmp_path: Path, tmpfs: Path) -> None:
        a_file = tmp_path / "a-file"
        a_file.write_text("x")
        readonly = tmp_path / "ro"
        readonly.mkdir()
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=8g", "tmpfs", str(readonly)], check=True
        )
        try:
            lines = {
                "missing": await self._io_line(tmp_path, tmp_path / "absent"),
                "file": await self._io_line(tmp_path, a_file),
                "full": await self._io_line(tmp_path, tmpfs),
                "read-only": await self._io_line(tmp_path, readonly),
            }
        finally:
            subprocess.run(["umount", "-l", str(readonly)], check=False)
        expected = {
            "missing": "create",
            "file": "a directory",
            "full": "free space",
            "read-only": "read-only",
        }
        for mode, line in lines.items():
            assert line.status is Status.WARN, (mode, line)
            assert expected[mode] in line.action, (mode, line.action)
        assert "free space" not in lines["missing"].action
        assert len({line.action for line in lines.values()}) == len(lines)

    def test_every_refusal_names_its_own_action(self, tmp_path: Path) -> None:
        (tmp_path / "f").write_text("")
        cases: dict[str, Callable[[], object]] = {
            "none": lambda: run_write_probe(None, 1),
            "missing": lambda: run_write_probe(tmp_path / "absent", 1),
            "file": lambda: run_write_probe(tmp_path / "f", 1),
            "size": lambda: run_write_probe(tmp_path, 0),
            "space": lambda: run_write_probe(tmp_path, 1, free_margin_bytes=2**62),
        }
        actions = {}
        for mode, call in cases.items():
            with pytest.raises(ProbeRefused) as caught:
                call()
            assert caught.value.action, mode
            actions[mode] = caught.value.action
        assert len(set(actions.values())) == len(actions), actions
        assert "size_mib" in actions["size"]
        assert MIB  # the size unit the refusal speaks in

    async def test_torch_modes(self, tmp_path: Path) -> None:
        crashing = tmp_path / "crashing-python"
        crashing.write_text("#!/bin/sh\necho 'ImportError: libcudart.so.12' >&2\nexit 1\n")
        crashing.chmod(0o755)
        hanging = tmp_path / "hanging-python"
        hanging.write_text("#!/bin/sh\nexec sleep 30\n")
        hanging.chmod(0o755)
        missing = str(tmp_path / "no-such-python")
        probe_missing = await probes.run_torch_probe(missing)
        probe_crash = await probes.run_torch_probe(str(crashing))
        probe_hang = await probes.run_torch_probe(str(hanging), timeout=0.3)
        lines = {
            "missing": probes.classify_torch(probe_missing, True, missing),
            "crash": probes.classify_torch(probe_crash, True, str(crashing)),
            "hang": probes.classify_torch(probe_hang, True, str(hanging)),
        }
        assert lines["missing"].status is Status.FAIL
        assert "--python" in lines["missing"].action
        assert "by hand" not in lines["missing"].action
        assert "by hand" in lines["crash"].action
        assert "run check again" in lines["hang"].action
        assert len({line.action for line in lines.values()}) == len(lines)


class TestTorchInterpreter:
    """The torch line checks the interpreter the benchmark child will run under: --python
    when given, else `[collectors.benchmark] python`, else gpuwarden's own. A packaged host
    keeps torch in a training venv named in the configuration; checking gpuwarden's own
    interpreter there says "torch missing" of a host that has it."""

    async def _torch_line(self, tmp_path: Path, configured: str, given: str | None) -> Finding:
        extra = f'[collectors.benchmark]\npython = "{configured}"\n' if configured else ""
        cfg = load(
            write_config(tmp_path / "cfg", proc_root=make_proc_tree(tmp_path / "proc"), extra=extra)
        )
        options = CheckOptions(expect_gpus=0, process_gap=0.05, python=given)
        report = await run_check(cfg, options)
        (line,) = [f for f in report.findings if f.id == "torch"]
        return line

    def _python(self, tmp_path: Path, name: str, version: str) -> Path:
        """An interpreter whose torch answers `version` (the probe's JSON line)."""
        script = tmp_path / name
        answer = json.dumps({"version": version, "cuda_build": None, "cuda_available": False})
        script.write_text(f"#!/bin/sh\necho '{answer}'\n")
        script.chmod(0o755)
        return script

    async def test_the_configured_interpreter_by_default(self, tmp_path: Path) -> None:
        venv = self._python(tmp_path, "training-python", "9.8.7")
        line = await self._torch_line(tmp_path, str(venv), None)
        assert "9.8.7" in line.detail, line

    async def test_the_command_line_wins(self, tmp_path: Path) -> None:
        venv = self._python(tmp_path, "training-python", "9.8.7")
        other = self._python(tmp_path, "other-python", "1.2.3")
        line = await self._torch_line(tmp_path, str(venv), str(other))
        assert "1.2.3" in line.detail, line

    async def test_a_configured_interpreter_that_is_missing_names_the_key(
        self, tmp_path: Path
    ) -> None:
        missing = str(tmp_path / "no-such-python")
        line = await self._torch_line(tmp_path, missing, None)
        assert line.status is Status.FAIL
        assert "[collectors.benchmark] python" in line.action, line
        assert missing in line.action


class TestTable:
    def _report(self, *statuses: Status) -> CheckReport:
        report = CheckReport("node-a")
        report.findings = [
            Finding("host", f"line {i}", s, "detail " * 40, "do this " * 30)
            for i, s in enumerate(statuses)
        ]
        return report

    @pytest.mark.parametrize(
        ("statuses", "lead"),
        [
            ((Status.OK, Status.FAIL, Status.WARN), "FAIL: 1 FAIL, 1 WARN, 1 OK"),
            ((Status.OK, Status.WARN, Status.SKIP), "WARN: 1 WARN, 1 OK, 1 SKIP"),
            ((Status.OK, Status.NA), "OK: 1 OK, 1 N/A"),
        ],
    )
    def test_summary_leads_with_the_worst(self, statuses: tuple[Status, ...], lead: str) -> None:
        line = summary_line(self._report(*statuses), colour=False)
        assert line.startswith(lead), line

    @pytest.mark.parametrize("columns", [60, 100, 120])
    def test_fits_the_width_at_word_boundaries(self, columns: int) -> None:
        text = render_table(self._report(Status.FAIL, Status.OK), colour=False, width=columns)
        lines = text.splitlines()
        assert max(len(line) for line in lines) <= columns
        body = lines[lines.index("") + 1 : -2]
        words = {"detail", "do", "this", "->", "FAIL", "OK", "line", "0", "1"}
        assert {w for line in body for w in line.split()} == words  # no word cut in two

    def test_colour_only_when_asked(self) -> None:
        report = self._report(Status.FAIL)
        assert "\x1b[" not in render_table(report, colour=False)
        assert "\x1b[31;1mFAIL" in render_table(report, colour=True)
