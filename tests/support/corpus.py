"""The kernel-log corpus (tests/fixtures/kernel_log/corpus/): one saved log per class of issue
12 with the results expected of it, and the comparison every test of it uses.

A case is `NN-name.log` (bytes, lines ended by `\\n`) and `NN-name.json`:

- `parse`: ParseStats the parser must report (lines, records, malformed, bad_timestamps,
  holes);
- `records` (optional): records that must be among the parsed ones, by line: the message and
  whether it is from the kernel;
- `findings`: every finding, in order; each entry's keys must equal the finding's `to_dict()`
  values (`line` and `kind` always given; other keys only where the class is about them);
- `ignored`: MatcherSet.ignored, the user-space look-alikes counted by kind (a kind absent
  is 0).
See the corpus README.md for the format and SOURCES.md for where each line's format comes from.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collectors.kernel_log.lines import iter_lines
from collectors.kernel_log.matchers import Finding, MatcherSet
from collectors.kernel_log.parse import LogRecord, ParseStats, parse_lines
from tests.support.kmsg import FIXTURES

CORPUS = FIXTURES / "corpus"
STATS = ("lines", "records", "malformed", "bad_timestamps", "holes")


@dataclass(frozen=True)
class Case:
    name: str
    log: Path
    expected: dict[str, Any]

    @property
    def issue_class(self) -> int:
        return int(self.expected["class"])

    @property
    def owner(self) -> str:
        return str(self.expected["owner"])


def cases() -> list[Case]:
    return [
        Case(log.stem, log, json.loads(log.with_suffix(".json").read_text(encoding="utf-8")))
        for log in sorted(CORPUS.glob("*.log"))
    ]


@dataclass
class Outcome:
    records: list[LogRecord] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    stats: ParseStats = field(default_factory=ParseStats)
    ignored: Counter[str] = field(default_factory=Counter)


def scan(case: Case) -> Outcome:
    """The case's log through the real line reader, parser and matchers, as `scan` reads it."""
    outcome = Outcome()
    matchers = MatcherSet()
    with case.log.open("rb") as handle:
        outcome.records = list(parse_lines(iter_lines(handle), outcome.stats))
    outcome.findings = list(matchers.scan(outcome.records))
    outcome.ignored = matchers.ignored
    return outcome


def parse_mismatches(case: Case, outcome: Outcome) -> list[str]:
    """What the parser got wrong for this case ([] when nothing)."""
    got = {name: getattr(outcome.stats, name) for name in STATS}
    want = {name: case.expected["parse"][name] for name in STATS}
    problems = [f"parse stats: got {got}, expected {want}"] if got != want else []
    by_line: dict[int, list[LogRecord]] = {}
    for record in outcome.records:
        by_line.setdefault(record.line, []).append(record)
    for expected in case.expected.get("records", []):
        found = [
            (r.message, r.from_kernel)
            for r in by_line.get(expected["line"], [])
            if (r.message, r.from_kernel) == (expected["message"], expected["from_kernel"])
        ]
        if not found:
            on_line = [(r.message, r.from_kernel) for r in by_line.get(expected["line"], [])]
            problems.append(f"line {expected['line']}: expected {expected}, records {on_line}")
    return problems


def finding_mismatches(case: Case, findings: Iterable[Finding], ignored: Counter[str]) -> list[str]:
    """What the matchers got wrong for this case ([] when nothing)."""
    got = [f.to_dict() for f in findings]
    want: list[dict[str, Any]] = case.expected["findings"]
    problems = []
    got_keys = [(g["line"], g["kind"]) for g in got]
    want_keys = [(w["line"], w["kind"]) for w in want]
    if got_keys != want_keys:
        problems.append(f"findings (line, kind): got {got_keys}, expected {want_keys}")
    else:
        for g, w in zip(got, want, strict=True):
            wrong = {k: (g.get(k, "<absent>"), v) for k, v in w.items() if g.get(k) != v}
            if wrong:
                problems.append(f"line {w['line']} {w['kind']}: (got, expected) {wrong}")
    got_ignored = {k: v for k, v in ignored.items() if v}
    if got_ignored != case.expected["ignored"]:
        problems.append(f"ignored: got {got_ignored}, expected {case.expected['ignored']}")
    return problems
