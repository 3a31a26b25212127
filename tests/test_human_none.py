"""No human output says `None`: every command's human renderer, run on data whose every
optional field is missing (None where the type allows it, empty otherwise), prints words
where a value is unknown ("CUDA None" and "index None" were printed by bench)."""

from __future__ import annotations

import dataclasses
import io
import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import pytest

from agent.contracts.model import Severity
from agent.program.commands import bench, check, scan
from agent.program.diagnose.bench_findings import judge
from agent.program.diagnose.check import CheckReport
from collectors._nvml import GpuIdentity
from collectors.benchmark.collector import BenchmarkSettings, RunResult
from collectors.benchmark.history import BenchmarkRecord, HistoryFile
from collectors.benchmark.runner import ChildOutcome
from collectors.kernel_log.finding import Finding as LogFinding
from collectors.kernel_log.parse import LogRecord

T = TypeVar("T")
BARE_NONE = re.compile(r"\bNone\b")
REQUIRED = {str: "", int: 0, float: 0.0, bool: False}
"""A required field's emptiest value of its type."""


def _allows_none(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in (
        typing.get_args(hint)
    )


def bare(cls: type[T], **given: Any) -> T:
    """`cls` with every field it can leave unknown set to None, every other one left at its
    default or its type's emptiest value; `given` where a real value is needed to build it."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for spec in dataclasses.fields(cls):  # type: ignore[arg-type]
        if not spec.init or spec.name in given:
            continue
        hint = hints[spec.name]
        if _allows_none(hint):
            values[spec.name] = None
        elif spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
            values[spec.name] = REQUIRED.get(hint, hint() if callable(hint) else None)
    return cls(**values, **given)


def record(correct: bool | None = None) -> BenchmarkRecord:
    """Unknown everything; `correct` also False and True: each verdict has its own words."""
    return bare(
        BenchmarkRecord, time_utc="2026-12-01T10:00:00Z", estimated_tflops=1.5, correct=correct
    )


VERDICTS = [None, False, True]


def gpu() -> GpuIdentity:
    return bare(GpuIdentity)


def outcome() -> ChildOutcome:
    return bare(ChildOutcome, failure="crash")


def assert_no_none(text: str) -> None:
    assert text.strip(), "the renderer printed nothing"
    assert not BARE_NONE.search(text), text


class TestBench:
    @pytest.mark.parametrize("correct", VERDICTS)
    def test_a_result(self, correct: bool | None) -> None:
        result = RunResult(gpu(), record(correct), outcome(), [])
        assert_no_none(bench.result_text(result, BenchmarkSettings(), []))

    def test_a_failure(self) -> None:
        result = RunResult(gpu(), None, outcome(), [])
        assert_no_none(bench.result_text(result, BenchmarkSettings(), []))

    def test_what_it_tests(self) -> None:
        assert_no_none(bench.describe_target(gpu(), BenchmarkSettings()))

    def test_history(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        history = HistoryFile.in_state_dir(tmp_path)
        history.append(record())
        bench.show_history(history, as_json=False)
        assert_no_none(capsys.readouterr().out)


class TestCheck:
    @pytest.mark.parametrize("with_record", [*VERDICTS, "no record"])
    def test_benchmark_lines(self, with_record: bool | str | None) -> None:
        report = CheckReport("node")
        made = None if with_record == "no record" else record(with_record)  # type: ignore[arg-type]
        result = RunResult(gpu(), made, outcome(), [])
        report.findings.append(judge(result))
        assert_no_none(check.render_table(report, colour=False))


class TestScan:
    def _finding(self, line: int) -> LogFinding:
        return bare(
            LogFinding,
            kind="xid",
            severity=Severity.WARNING,
            meaning="m",
            action="a",
            record=LogRecord("message", line=line),
        )

    def test_table_and_summary(self) -> None:
        findings = [self._finding(n) for n in (1, 2, 3)]
        assert_no_none("\n".join(scan.table_lines(findings, 100, colour=False)))
        assert_no_none("\n".join(scan.summary_lines(findings, 100, colour=False)))

    def test_the_counts(self) -> None:
        from collectors.kernel_log.matchers import MatcherSet
        from collectors.kernel_log.parse import ParseStats

        out = io.StringIO()
        out.write(scan.summary_text([self._finding(1)], ParseStats(), MatcherSet()))
        assert_no_none(out.getvalue())


class TestCheckpoint:
    @pytest.mark.parametrize("status", ["complete", "corrupt", "partial"])
    def test_verify_table(self, status: str) -> None:
        from agent.program.commands import checkpoint
        from collectors.checkpoints.judge import RoundOutcome, Verdict

        verdict = bare(Verdict, path=Path("/ckpt/step"), status=status, checksum="unchecked")
        text = checkpoint.render({"/ckpt": RoundOutcome([verdict])})
        assert_no_none(text)
