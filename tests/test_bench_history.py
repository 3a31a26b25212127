"""Benchmark records, the history file, baselines, regressions and peers."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from collectors.benchmark.history import (
    BaselinePolicy,
    BenchmarkRecord,
    HistoryFile,
    RecordError,
    baseline_for,
    judge,
    median,
    parse_lines,
    peer_median,
    regressed,
)
from tests.support.bench import record

NOBODY = 65534

T0 = 1_780_000_000.0
HOUR = 3600.0
POLICY = BaselinePolicy(runs=5, min_runs=3, regression_ratio=0.9, regression_runs=2)

# A line as the field guide's script writes it (its exact field set and formats).
GUIDE_LINE = (
    '{"time_utc": "2025-03-01T10:00:00Z", "gpu_index": 0, "gpu_name": "NVIDIA H200", '
    '"torch": "2.11.0+cu130", "torch_cuda": "13.0", "dtype": "float32", '
    '"matmul_precision": "highest", "size": 2048, "iterations": 20, '
    '"median_seconds": 0.00687, "estimated_tflops": 50.01}'
)


def judged(history: list[BenchmarkRecord], new: BenchmarkRecord) -> BenchmarkRecord:
    result = judge(history, new, POLICY)
    history.append(result)
    return result


class TestRecordParsing:
    """Records parse from the guide's script, the child and the history; nothing else does."""

    def test_guide_record_parses_with_defaults(self) -> None:
        parsed = BenchmarkRecord.from_dict(json.loads(GUIDE_LINE))
        assert parsed.profile == "fp32"
        assert parsed.correct is None
        assert parsed.duration_class == "burst"
        assert parsed.gpu_uuid == ""
        assert parsed.time == 1740823200.0

    def test_round_trip(self) -> None:
        original = record(50.0, T0, ratio=0.98)
        assert BenchmarkRecord.from_dict(json.loads(original.to_json())) == original

    @pytest.mark.parametrize(
        ("change", "field"),
        [
            ({"size": "2048"}, "size"),
            ({"size": 0}, "size"),
            ({"size": True}, "size"),
            ({"median_seconds": 0}, "median_seconds"),
            ({"median_seconds": -1}, "median_seconds"),
            ({"estimated_tflops": "fast"}, "estimated_tflops"),
            ({"time_utc": "yesterday"}, "time_utc"),
            ({"gpu_index": -1}, "gpu_index"),
            ({"correct": "yes"}, "correct"),
            ({"sample_seconds": "0.1"}, "sample_seconds"),
        ],
    )
    def test_bad_fields_name_themselves(self, change: dict[str, Any], field: str) -> None:
        data = {**json.loads(GUIDE_LINE), **change}
        with pytest.raises(RecordError, match=field):
            BenchmarkRecord.from_dict(data)

    def test_missing_field_is_an_error(self) -> None:
        data = json.loads(GUIDE_LINE)
        del data["dtype"]
        with pytest.raises(RecordError, match="dtype"):
            BenchmarkRecord.from_dict(data)

    @given(
        st.dictionaries(
            st.sampled_from(
                [
                    "time_utc",
                    "gpu_index",
                    "gpu_name",
                    "torch",
                    "torch_cuda",
                    "dtype",
                    "size",
                    "matmul_precision",
                    "iterations",
                    "median_seconds",
                    "estimated_tflops",
                    "correct",
                    "sample_seconds",
                    "max_error",
                    "gpu_uuid",
                ]
            ),
            st.none()
            | st.booleans()
            | st.integers()
            | st.floats()
            | st.text(max_size=30)
            | st.lists(st.floats(), max_size=3),
        )
    )
    def test_any_object_parses_or_raises_record_error(self, data: dict[str, Any]) -> None:
        merged = {**json.loads(GUIDE_LINE), **data}
        try:
            parsed = BenchmarkRecord.from_dict(merged)
        except RecordError:
            return
        assert BenchmarkRecord.from_dict(json.loads(parsed.to_json())) == parsed

    @given(st.lists(st.text(max_size=200), max_size=10))
    def test_any_lines_give_records_or_bad_lines(self, lines: list[str]) -> None:
        loaded = parse_lines(lines)
        assert len(loaded.records) + len(loaded.bad_lines) <= len(lines)


class TestHistoryFile:
    """The JSON-lines file: appends, reloads, skips bad lines, sees other writers."""

    def test_append_and_reload(self, tmp_path: Path) -> None:
        history = HistoryFile.in_state_dir(tmp_path / "state")
        history.append(record(50.0, T0))
        history.append(record(49.0, T0 + HOUR))
        assert (tmp_path / "state" / "benchmark-history.jsonl").read_text().count("\n") == 2
        again = HistoryFile.in_state_dir(tmp_path / "state")
        assert [r.estimated_tflops for r in again.refresh()] == [50.0, 49.0]

    def test_bad_lines_are_skipped_and_counted(self, tmp_path: Path) -> None:
        path = tmp_path / "benchmark-history.jsonl"
        path.write_text(GUIDE_LINE + '\nnot json\n{"size": 1}\n\n' + GUIDE_LINE + "\n")
        history = HistoryFile(path)
        assert len(history.refresh()) == 2
        assert [number for number, _ in history.bad_lines] == [2, 3]

    def test_refresh_sees_lines_written_by_another_process(self, tmp_path: Path) -> None:
        path = tmp_path / "benchmark-history.jsonl"
        mine = HistoryFile(path)
        mine.append(record(50.0, T0))
        with path.open("a") as other:
            other.write(record(48.0, T0 + HOUR).to_json() + "\n")
        assert [r.estimated_tflops for r in mine.refresh()] == [50.0, 48.0]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a file made by root for another user")
class TestOwnerOfTheStateDir:
    """`gpuwarden bench` run by root (sudo, on a packaged host) writes into the service's state
    dir: a history file it creates must belong to the dir's owner, or the agent (its own user)
    could no longer append its runs."""

    def _state_dir(self, tmp_path: Path) -> Path:
        state = tmp_path / "state"
        state.mkdir()
        os.chown(state, NOBODY, NOBODY)
        return state

    def test_a_new_file_takes_the_owner_of_its_directory(self, tmp_path: Path) -> None:
        history = HistoryFile.in_state_dir(self._state_dir(tmp_path))
        history.append(record(50.0, T0))
        owner = history.path.stat()
        assert (owner.st_uid, owner.st_gid) == (NOBODY, NOBODY)

    def test_an_existing_file_keeps_its_owner(self, tmp_path: Path) -> None:
        history = HistoryFile.in_state_dir(self._state_dir(tmp_path))
        history.path.write_text("")
        os.chown(history.path, 0, 0)
        history.append(record(50.0, T0))
        assert history.path.stat().st_uid == 0


class TestBaseline:
    """The baseline: median of the last N good comparable runs of the current segment."""

    def test_no_baseline_until_min_runs(self) -> None:
        history = [record(50.0, T0), record(51.0, T0 + HOUR)]
        assert baseline_for(history, record(40.0, T0 + 2 * HOUR), POLICY) is None
        history.append(record(52.0, T0 + 2 * HOUR))
        assert baseline_for(history, record(40.0, T0 + 3 * HOUR), POLICY) == 51.0

    def test_median_of_the_last_n(self) -> None:
        history = [record(10.0 + i, T0 + i * HOUR) for i in range(10)]
        # the last five are 15..19
        assert baseline_for(history, record(1.0, T0 + 20 * HOUR), POLICY) == 17.0

    def test_only_comparable_runs_count(self) -> None:
        history = [record(50.0, T0 + i) for i in range(3)]
        history += [record(500.0, T0 + 10 + i, uuid="GPU-B") for i in range(3)]
        history += [record(400.0, T0 + 20 + i, size=4096) for i in range(3)]
        history += [record(300.0, T0 + 30 + i, window=0.0) for i in range(3)]
        assert baseline_for(history, record(1.0, T0 + 100), POLICY) == 50.0

    def test_driver_change_starts_a_new_segment(self) -> None:
        history = [record(50.0, T0 + i) for i in range(5)]
        history += [record(40.0, T0 + 10 + i, driver="590.1") for i in range(2)]
        new = record(40.0, T0 + 20, driver="590.1")
        assert baseline_for(history, new, POLICY) is None
        history.append(record(40.0, T0 + 15, driver="590.1"))
        assert baseline_for(history, new, POLICY) == 40.0

    def test_torch_change_starts_a_new_segment(self) -> None:
        history = [record(50.0, T0 + i) for i in range(5)]
        assert baseline_for(history, record(40.0, T0 + 20, torch="2.12.0"), POLICY) is None

    def test_unknown_driver_continues_the_segment(self) -> None:
        history = [record(50.0, T0 + i, driver="") for i in range(3)]
        assert baseline_for(history, record(40.0, T0 + 20), POLICY) == 50.0

    def test_wrong_and_slow_runs_are_not_good(self) -> None:
        history = [record(50.0, T0 + i) for i in range(3)]
        history.append(record(10.0, T0 + 10, correct=False))
        history.append(record(30.0, T0 + 11, ratio=0.6))
        assert baseline_for(history, record(40.0, T0 + 20), POLICY) == 50.0


class TestRegression:
    """A regression needs K consecutive correct runs under the ratio; it clears on recovery."""

    def test_two_slow_runs_in_a_row(self) -> None:
        history = [record(50.0, T0 + i) for i in range(3)]
        first = judged(history, record(40.0, T0 + 10))
        assert first.baseline_ratio == pytest.approx(0.8)
        assert not regressed(history, first, POLICY)
        second = judged(history, record(41.0, T0 + 11))
        assert regressed(history, second, POLICY)
        # the slow runs did not become the baseline: a third one still compares with 50
        third = judged(history, record(42.0, T0 + 12))
        assert third.baseline_ratio == pytest.approx(0.84)
        assert regressed(history, third, POLICY)
        recovered = judged(history, record(49.5, T0 + 13))
        assert not regressed(history, recovered, POLICY)

    def test_slow_then_normal_is_no_regression(self) -> None:
        history = [record(50.0, T0 + i) for i in range(3)]
        judged(history, record(40.0, T0 + 10))
        normal = judged(history, record(50.0, T0 + 11))
        assert not regressed(history, normal, POLICY)

    def test_no_baseline_no_regression(self) -> None:
        history: list[BenchmarkRecord] = []
        for i in range(3):
            latest = judged(history, record(10.0, T0 + i))
        assert latest.baseline_ratio is None
        assert not regressed(history, latest, POLICY)


class TestPeers:
    """A GPU is compared with the median of the latest runs of its same-model peers."""

    def test_peer_median_and_ratio(self) -> None:
        history = [
            record(50.0, T0, uuid="GPU-B"),
            record(52.0, T0 + 1, uuid="GPU-C"),
            record(51.0, T0 + 2, uuid="GPU-D"),
            record(10.0, T0 - 10, uuid="GPU-D"),
        ]
        mine = record(40.0, T0 + 3, uuid="GPU-A")
        assert peer_median(history, mine, POLICY) == 51.0
        assert judge(history, mine, POLICY).peer_ratio == pytest.approx(40 / 51)

    def test_other_models_old_runs_and_wrong_runs_are_not_peers(self) -> None:
        history = [
            record(500.0, T0, uuid="GPU-B", name="NVIDIA B200"),
            record(50.0, T0 - 10 * 86400, uuid="GPU-C"),
            record(5.0, T0, uuid="GPU-D", correct=False),
            record(50.0, T0, uuid="GPU-E", torch="2.10.0"),
        ]
        assert peer_median(history, record(40.0, T0 + 3, uuid="GPU-A"), POLICY) is None


@given(st.lists(st.floats(min_value=0.0, max_value=1e4, allow_nan=False), min_size=1))
def test_median_is_the_standard_librarys(values: list[float]) -> None:
    """The daemon's own median (statistics stays out of it) gives statistics.median's value,
    to the bit, for odd and even counts."""
    assert median(iter(values)) == statistics.median(values)


def test_median_of_nothing_is_an_error() -> None:
    with pytest.raises(ValueError, match="no values"):
        median([])
