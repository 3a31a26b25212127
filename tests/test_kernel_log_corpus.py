"""The kernel-log corpus, one saved log per class of issue 12 (tests/fixtures/kernel_log/corpus/,
format in its README.md, the origin of every line's format in SOURCES.md): every file parses as
expected, gives exactly the expected findings, and reads the same through the followed-file
reader in small batches as through `scan`."""

from __future__ import annotations

import pytest

from agent.contracts.collector import MemoryKeyValueStore
from collectors.kernel_log.kmsg import FileLogReader
from tests.support.corpus import Case, cases, finding_mismatches, parse_mismatches, scan

CASES = cases()

# Classes whose matchers are still being written, class -> why: their expected findings are
# the target (a strict xfail: the day one passes, its entry must go). None now.
PENDING: dict[int, str] = {}


def _id(case: Case) -> str:
    return case.name


def test_every_class_has_a_file() -> None:
    """Classes 1 to 13 each have a saved log and its expected results."""
    assert {c.issue_class for c in CASES} == set(range(1, 14))


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_parse(case: Case) -> None:
    """Line, record, malformed, unreadable-stamp and hole counts, and the records named."""
    assert parse_mismatches(case, scan(case)) == []


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=pytest.mark.xfail(reason=PENDING[c.issue_class]))
        if c.issue_class in PENDING
        else c
        for c in CASES
    ],
    ids=_id,
)
def test_findings(case: Case) -> None:
    """Exactly the expected findings, in order, and the user-space look-alikes counted."""
    outcome = scan(case)
    assert finding_mismatches(case, outcome.findings, outcome.ignored) == []


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_followed_file_reads_what_scan_reads(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """The collector's file reader, in reads of 512 bytes (every batch boundary falls inside
    some line), gives the records scan's reader gives: same lines, messages, trust, fields."""
    monkeypatch.setattr("collectors.kernel_log.kmsg.FILE_READ_BYTES", 512)
    reader = FileLogReader(case.log, MemoryKeyValueStore())
    records = []
    while True:
        batch = reader.read()
        reader.commit(batch)
        records += batch.records
        if not batch.more:
            break
    assert records == scan(case).records
