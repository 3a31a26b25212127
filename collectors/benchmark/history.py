"""Benchmark records, their history file and baselines.

A record keeps the field guide's fields (time_utc, gpu_index, gpu_name, torch, torch_cuda, dtype,
matmul_precision, size, iterations, median_seconds, estimated_tflops) plus what makes runs
comparable and judgeable: the GPU UUID, the driver version, the profile, the requested minimum
timed window and the correctness result. The history is `benchmark-history.jsonl` in state_dir,
one record a line; a `gpu_benchmark.jsonl` written by the field guide's script parses as well.

Only comparable runs are compared: same GPU UUID, profile, size, precision and duration class
(the requested minimum window: docs/MEASUREMENTS.md, short bursts read faster than sustained work). A
driver or torch change starts a new baseline segment. The baseline is the median of the last N
good runs of the segment: correct, and not themselves slow against the baseline of their time,
so a GPU that degrades does not drag its own baseline down.
"""

from __future__ import annotations

import datetime as dt
import errno
import json
import math
import os
import stat
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Final

from agent.contracts.errors import GpuwardenError

HISTORY_FILE: Final = "benchmark-history.jsonl"

_PROFILE_BY_TYPE: Final = {
    ("float32", "highest"): "fp32",
    ("float32", "high"): "tf32",
    ("float32", "medium"): "tf32",
    ("bfloat16", "highest"): "bf16",
    ("float16", "highest"): "fp16",
}


class RecordError(GpuwardenError, ValueError):
    """A line or object is not a benchmark record; the message says which field and why."""


def profile_for(dtype: str, matmul_precision: str) -> str:
    """The profile name for a dtype and precision (records written by the field guide's script
    carry no profile). bf16 and fp16 ignore the float32 precision setting."""
    if dtype in ("bfloat16", "float16"):
        return _PROFILE_BY_TYPE[(dtype, "highest")]
    return _PROFILE_BY_TYPE.get((dtype, matmul_precision), f"{dtype}-{matmul_precision}")


def duration_class(min_window_seconds: float) -> str:
    """Runs are comparable only at the same requested window: "burst" when none was asked."""
    if min_window_seconds <= 0:
        return "burst"
    return f"min{round(min_window_seconds * 1000)}ms"


def parse_time_utc(text: str) -> float:
    try:
        parsed = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise RecordError(f"time_utc: not an ISO 8601 time: {text!r}") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=dt.UTC)
    return parsed.timestamp()


def format_time_utc(seconds: float) -> str:
    return dt.datetime.fromtimestamp(seconds, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _str(data: Mapping[str, Any], key: str, default: str | None = None) -> str:
    value = data.get(key, default)
    if value is None and default is not None:
        return default
    if not isinstance(value, str):
        raise RecordError(f"{key}: expected a string, got {value!r}")
    return value


def _opt_str(data: Mapping[str, Any], key: str) -> str | None:
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise RecordError(f"{key}: expected a string or null, got {value!r}")
    return value


def _int(data: Mapping[str, Any], key: str, minimum: int) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise RecordError(f"{key}: expected an integer >= {minimum}, got {value!r}")
    return value


def _float(
    data: Mapping[str, Any], key: str, *, positive: bool = False, default: float | None = None
) -> float:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RecordError(f"{key}: expected a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number) or number < 0 or (positive and number == 0):
        raise RecordError(
            f"{key}: expected a finite number {'> 0' if positive else '>= 0'}, got {value!r}"
        )
    return number


def _opt_float(data: Mapping[str, Any], key: str) -> float | None:
    return None if data.get(key) is None else _float(data, key)


def _opt_bool(data: Mapping[str, Any], key: str) -> bool | None:
    value = data.get(key)
    if value is not None and not isinstance(value, bool):
        raise RecordError(f"{key}: expected true, false or null, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class BenchmarkRecord:
    time_utc: str
    gpu_index: int | None
    gpu_name: str
    torch: str
    torch_cuda: str | None
    dtype: str
    matmul_precision: str
    size: int
    iterations: int
    median_seconds: float
    """The median timed window: `iterations` products, in seconds."""
    estimated_tflops: float
    gpu_uuid: str = ""
    driver_version: str = ""
    profile: str = ""
    min_window_seconds: float = 0.0
    correct: bool | None = None
    """None: not checked (records imported from the field guide's script)."""
    max_error: float | None = None
    tolerance: float | None = None
    sample_seconds: tuple[float, ...] = ()
    baseline_ratio: float | None = None
    peer_ratio: float | None = None
    source: str = "agent"
    """agent (the daemon), cli (`gpuwarden bench`) or import."""
    time: float = field(default=0.0, compare=False)
    """time_utc as seconds since the epoch; derived."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "time", parse_time_utc(self.time_utc))
        if not self.profile:
            object.__setattr__(self, "profile", profile_for(self.dtype, self.matmul_precision))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BenchmarkRecord:
        """Parse a record from the history, the child or the field guide's script."""
        if not isinstance(data, Mapping):
            raise RecordError(f"expected a JSON object, got {type(data).__name__}")
        index = data.get("gpu_index")
        if index is not None and (
            isinstance(index, bool) or not isinstance(index, int) or index < 0
        ):
            raise RecordError(f"gpu_index: expected an integer >= 0 or null, got {index!r}")
        samples = data.get("sample_seconds") or []
        if not isinstance(samples, list):
            raise RecordError("sample_seconds: expected an array")
        sample_values = tuple(_float({"s": s}, "s") for s in samples)
        return cls(
            time_utc=_str(data, "time_utc"),
            gpu_index=index,
            gpu_name=_str(data, "gpu_name"),
            torch=_str(data, "torch"),
            torch_cuda=_opt_str(data, "torch_cuda"),
            dtype=_str(data, "dtype"),
            matmul_precision=_str(data, "matmul_precision"),
            size=_int(data, "size", 1),
            iterations=_int(data, "iterations", 1),
            median_seconds=_float(data, "median_seconds", positive=True),
            estimated_tflops=_float(data, "estimated_tflops"),
            gpu_uuid=_str(data, "gpu_uuid", ""),
            driver_version=_str(data, "driver_version", ""),
            profile=_str(data, "profile", ""),
            min_window_seconds=_float(data, "min_window_seconds", default=0.0),
            correct=_opt_bool(data, "correct"),
            max_error=_opt_float(data, "max_error"),
            tolerance=_opt_float(data, "tolerance"),
            sample_seconds=sample_values,
            baseline_ratio=_opt_float(data, "baseline_ratio"),
            peer_ratio=_opt_float(data, "peer_ratio"),
            source=_str(data, "source", "agent"),
        )

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["time"]
        out["sample_seconds"] = list(self.sample_seconds)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, allow_nan=False)

    def with_changes(self, **changes: Any) -> BenchmarkRecord:
        return replace(self, **changes)

    @property
    def duration_class(self) -> str:
        return duration_class(self.min_window_seconds)

    def comparable_key(self) -> tuple[str, str, int, str, str]:
        """Runs with equal keys measure the same thing on the same GPU."""
        return (self.gpu_uuid, self.profile, self.size, self.matmul_precision, self.duration_class)

    def setup_key(self) -> tuple[str, str, int, str, str]:
        """Like comparable_key, but by model instead of UUID: for comparing peer GPUs."""
        return (self.gpu_name, self.profile, self.size, self.matmul_precision, self.duration_class)


@dataclass
class HistoryLoad:
    records: list[BenchmarkRecord]
    bad_lines: list[tuple[int, str]]
    """(line number, reason) of lines that are not records."""


def parse_lines(lines: Iterable[str]) -> HistoryLoad:
    records: list[BenchmarkRecord] = []
    bad: list[tuple[int, str]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(BenchmarkRecord.from_dict(json.loads(line)))
        except (json.JSONDecodeError, RecordError, RecursionError) as exc:
            bad.append((number, str(exc)[:200]))
    return HistoryLoad(records, bad)


class HistoryFile:
    """The JSON-lines history. Appends are single writes of one line, so a `gpuwarden bench`
    and the daemon appending at once do not interleave; `refresh` picks up the other's lines.

    A record the file does not take (a full disk, a read-only or failing state dir) is kept:
    it is in `records` at once and in `unsaved` until a later `save` writes it. A line the
    disk cut short (a short write at its last free byte, a crash mid-write) stays a line of
    its own: the next write starts with a newline, so the part is one bad line, counted and
    skipped, and no other record is spoilt. `save` may run in a worker thread while the
    event loop keeps records (`keep`) and reads them: the lists change under a lock."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[BenchmarkRecord] = []
        self.bad_lines: list[tuple[int, str]] = []
        self.unsaved: list[BenchmarkRecord] = []
        """Records kept in memory that the file has not taken yet, oldest first."""
        self._size = -1
        self._lock = threading.Lock()
        self._saving = threading.Lock()
        """Held by the one `save` writing: another (a call given up on while this one hangs,
        then asked again) writes nothing twice and does not hang a second thread."""

    @classmethod
    def in_state_dir(cls, state_dir: Path) -> HistoryFile:
        return cls(state_dir / HISTORY_FILE)

    def refresh(self) -> list[BenchmarkRecord]:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            size = 0
        if size != self._size:
            text = self.path.read_text(encoding="utf-8", errors="replace") if size else ""
            loaded = parse_lines(text.splitlines())
            with self._lock:
                self.records = sorted([*loaded.records, *self.unsaved], key=lambda r: r.time)
                self.bad_lines = loaded.bad_lines
                self._size = size
        return self.records

    def keep(self, record: BenchmarkRecord) -> None:
        """`record` in the history now, and waiting for `save` to write it."""
        with self._lock:
            self.unsaved.append(record)
            self.records = sorted([*self.records, record], key=lambda r: r.time)

    def append(self, record: BenchmarkRecord) -> None:
        """Keep `record` and write what waits; an OSError says the file did not take it (it
        waits, in `records` and `unsaved`)."""
        self.keep(record)
        self.save()

    def sync(self) -> int:
        """Write what waits, then read the lines others wrote; the records written."""
        written = self.save()
        self.refresh()
        return written

    def save(self) -> int:
        """Write the records that wait, one line each; how many were written. OSError when
        the file takes no more (ENOSPC for a short write): the rest wait. 0 at once while
        another save is under way (it writes them)."""
        if not self._saving.acquire(blocking=False):
            return 0
        try:
            return self._save()
        finally:
            self._saving.release()

    def _save(self) -> int:
        with self._lock:
            waiting = list(self.unsaved)
        if not waiting:
            return 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        except FileNotFoundError:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            _give_to_directory_owner(fd, self.path.parent)
        written = 0
        try:
            start = os.fstat(fd).st_size
            for record in waiting:
                data = (record.to_json() + "\n").encode("utf-8")
                if not self._ends_a_line(fd):
                    data = b"\n" + data  # after a part line: a line of its own
                done = os.write(fd, data)
                if done != len(data):
                    raise OSError(
                        errno.ENOSPC,
                        f"No space left: {done} of {len(data)} bytes of a record written",
                        str(self.path),
                    )
                written += 1
                with self._lock:
                    self.unsaved.remove(record)
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        with self._lock:
            if self._size == start:  # nobody else wrote since our last read: nothing new
                self._size = size  # to read (our own lines are in `records` already)
        return written

    def _ends_a_line(self, fd: int) -> bool:
        """Whether the file open (write-only) on `fd` is empty or ends with a newline."""
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or not info.st_size:
            return True
        with self.path.open("rb") as reader:
            reader.seek(info.st_size - 1)
            return reader.read(1) == b"\n"


def _give_to_directory_owner(fd: int, directory: Path) -> None:
    """A file root creates in another user's directory (`sudo gpuwarden bench` on a host
    where the agent runs as its own user) is that user's: else the agent cannot append its
    own runs to it. Root only: nobody else can give a file away."""
    if os.geteuid() != 0:
        return
    owner = directory.stat()
    if owner.st_uid != 0:
        os.fchown(fd, owner.st_uid, owner.st_gid)


@dataclass(frozen=True)
class BaselinePolicy:
    runs: int = 5
    """Baseline = median of this many last good runs."""
    min_runs: int = 3
    """No baseline (and no ratio) until the segment has this many good runs."""
    regression_ratio: float = 0.90
    regression_runs: int = 2
    peer_ratio: float = 0.90
    peer_max_age_seconds: float = 3 * 86400.0
    """A peer's last run older than this (relative to the run judged) is not compared."""


def _comparable(
    history: Sequence[BenchmarkRecord], record: BenchmarkRecord
) -> list[BenchmarkRecord]:
    key = record.comparable_key()
    return sorted(
        (r for r in history if r.comparable_key() == key and r is not record), key=lambda r: r.time
    )


def current_segment(
    history: Sequence[BenchmarkRecord], record: BenchmarkRecord
) -> list[BenchmarkRecord]:
    """Comparable runs before `record` in the same driver and torch segment as `record`.

    A change of a known driver or torch version starts a new segment; an unknown value (an
    imported record has no driver version) continues the segment it is in.
    """
    segment: list[BenchmarkRecord] = []
    driver, torch = "", ""
    for item in [*(r for r in _comparable(history, record) if r.time <= record.time), record]:
        changed = (item.driver_version and driver and item.driver_version != driver) or (
            item.torch and torch and item.torch != torch
        )
        if changed:
            segment = []
        segment.append(item)
        driver = item.driver_version or driver
        torch = item.torch or torch
    return segment[:-1]


def is_good(record: BenchmarkRecord, policy: BaselinePolicy) -> bool:
    return record.correct is not False and (
        record.baseline_ratio is None or record.baseline_ratio >= policy.regression_ratio
    )


def median(values: Iterable[float]) -> float:
    """The middle value, or the mean of the two middle ones: `statistics.median`'s result, by
    the same arithmetic. Not that module: it brings fractions and decimal (a 1.7 MB shared
    object), resident in the daemon from its first benchmark on for two medians (issue 14)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("median of no values")
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


def baseline_for(
    history: Sequence[BenchmarkRecord], record: BenchmarkRecord, policy: BaselinePolicy
) -> float | None:
    """Median TFLOP/s of the last `runs` good runs before `record`, or None if too few."""
    good = [r for r in current_segment(history, record) if is_good(r, policy)]
    if len(good) < policy.min_runs:
        return None
    return median(r.estimated_tflops for r in good[-policy.runs :])


def _is_peer_run(r: BenchmarkRecord, record: BenchmarkRecord, policy: BaselinePolicy) -> bool:
    """A correct, recent run of another GPU of the same model with the same setup and versions."""
    return bool(
        r.gpu_uuid
        and r.gpu_uuid != record.gpu_uuid
        and r.setup_key() == record.setup_key()
        and r.correct is not False
        and abs(record.time - r.time) <= policy.peer_max_age_seconds
        and (
            not r.driver_version
            or not record.driver_version
            or r.driver_version == record.driver_version
        )
        and r.torch == record.torch
    )


def peer_median(
    history: Sequence[BenchmarkRecord], record: BenchmarkRecord, policy: BaselinePolicy
) -> float | None:
    """Median TFLOP/s of the latest comparable run of each other GPU of the same model."""
    latest: dict[str, BenchmarkRecord] = {}
    for r in history:
        if _is_peer_run(r, record, policy) and (
            r.gpu_uuid not in latest or r.time > latest[r.gpu_uuid].time
        ):
            latest[r.gpu_uuid] = r
    if not latest:
        return None
    return median(r.estimated_tflops for r in latest.values())


def judge(
    history: Sequence[BenchmarkRecord], record: BenchmarkRecord, policy: BaselinePolicy
) -> BenchmarkRecord:
    """`record` with its baseline and peer ratios filled in (None where there is nothing to
    compare with). Wrong answers get ratios too, for the record, but never count as good."""
    baseline = baseline_for(history, record, policy)
    peers = peer_median(history, record, policy)
    return record.with_changes(
        baseline_ratio=None if not baseline else record.estimated_tflops / baseline,
        peer_ratio=None if not peers else record.estimated_tflops / peers,
    )


def regressed(
    history: Sequence[BenchmarkRecord], record: BenchmarkRecord, policy: BaselinePolicy
) -> bool:
    """True when `record` and the runs just before it, `regression_runs` correct runs in all,
    all stayed under `regression_ratio` of their baseline."""
    correct = [r for r in [*current_segment(history, record), record] if r.correct is not False]
    last = correct[-policy.regression_runs :]
    return len(last) == policy.regression_runs and all(
        r.baseline_ratio is not None and r.baseline_ratio < policy.regression_ratio for r in last
    )
