"""The Prometheus text format (0.0.4), written from our own model: `MetricFamily` and `Sample`.

The agent's /metrics (exporters/prometheus.py) and the watcher's (agent/program/watch/metrics.py)
both render here. prometheus_client did it before; importing it cost the daemon about 1 MB
resident and 33 modules (http.server, wsgiref, email, ... which we never used:
docs/MEASUREMENTS.md) for a few dozen lines of string formatting. The output is the same bytes as prometheus_client
0.26's `generate_latest` gave for the same families (tests/test_exposition.py holds the two
side by side), so no dashboard, rule or promtool check sees a change:

- `# HELP` (backslash and newline escaped), `# TYPE`, then one line per series;
- labels in the order of their names (not as declared), values escaped for backslash,
  newline and double quote;
- values as Go prints them: `1.0`, `+Inf`, `-Inf`, `NaN`, and an exponent from 1e6 up.

The process_* series that prometheus_client's ProcessCollector gave are here too
(`ProcessMetrics`), read from /proc/<pid> at each scrape.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.contracts.model import MetricFamily, Sample

Block = tuple[MetricFamily, Sequence[Sample]]
"""A family and its samples, written in the order given (a family without samples is still
written: its HELP and TYPE lines say the series exist and have none right now)."""

Row = tuple[Sequence[str], float]
"""One series of a family: its label values (in the family's label order) and its value."""

_POSITIONAL_DIGITS = 7
"""prometheus_client (after Go's strconv 'g') writes a positive value whose repr has this many
digits or more before the point with an exponent: 1234567.0 is `1.234567e+06`."""


def format_value(value: float) -> str:
    """A sample value as prometheus_client writes it (Python's shortest repr, Go's names for
    the specials, an exponent for large positive values)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    text = repr(value)
    whole, point, fraction = text.partition(".")
    if value > 0 and point and len(whole) >= _POSITIONAL_DIGITS:
        # Only positive values (the le/quantile case prometheus_client cared for) switch.
        digits = (whole + fraction).rstrip("0")
        mantissa = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
        return f"{mantissa}e+{len(whole) - 1:02d}"
    return text


def escape_help(text: str) -> str:
    """HELP text: a backslash and a newline escaped (a quote needs none there)."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def escape_label_value(text: str) -> str:
    """A label value: backslash first (the other escapes add backslashes), newline, quote."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def write_family(
    out: list[str],
    name: str,
    kind: str,
    *,
    help_text: str,
    labels: Sequence[str],
    rows: Iterable[Row],
) -> None:
    """Append one family's lines to `out`. The first of several series with the same label
    values is kept: a repeated series makes the whole exposition invalid for Prometheus."""
    out.append(f"# HELP {name} {escape_help(help_text)}\n# TYPE {name} {kind}\n")
    # Label values are given in declared order, written in name order: one permutation for
    # the whole family instead of a sort per series.
    order = sorted(range(len(labels)), key=labels.__getitem__)
    names = [labels[i] for i in order]
    seen: set[tuple[str, ...]] = set()
    for values, value in rows:
        key = tuple(values)
        if key in seen:
            continue
        seen.add(key)
        out.append(f"{name}{_label_text(names, order, key)} {format_value(value)}\n")


def _label_text(names: Sequence[str], order: Sequence[int], values: tuple[str, ...]) -> str:
    # A value without a name (more values than labels) is left out, a name without a value
    # too, as prometheus_client's dict(zip(...)) did; Sample refuses both, so only a family
    # redeclared with other labels could show it.
    pairs = [
        f'{label}="{escape_label_value(values[i])}"'
        for label, i in zip(names, order, strict=True)
        if i < len(values)
    ]
    return "{" + ",".join(pairs) + "}" if pairs else ""


def _block(out: list[str], family: MetricFamily, samples: Iterable[Sample]) -> None:
    rows = ((sample.label_values, sample.value) for sample in samples)
    write_family(
        out, family.name, family.type.value, help_text=family.help, labels=family.labels, rows=rows
    )


def blocks_text(blocks: Iterable[Block]) -> str:
    """Families in the order given, each with its samples (the watcher's /metrics)."""
    out: list[str] = []
    for family, samples in blocks:
        _block(out, family, samples)
    return "".join(out)


def snapshot_text(families: Iterable[MetricFamily], samples: Iterable[Sample]) -> str:
    """The agent's snapshot: the families that have samples, sorted by name. A family is the
    first one declared under its name (a sample of an undeclared family declares it)."""
    declared: dict[str, MetricFamily] = {}
    for family in families:
        declared.setdefault(family.name, family)
    grouped: dict[str, list[Sample]] = {}
    for sample in samples:
        declared.setdefault(sample.family.name, sample.family)
        grouped.setdefault(sample.family.name, []).append(sample)
    out: list[str] = []
    for name in sorted(grouped):
        _block(out, declared[name], grouped[name])
    return "".join(out)


def render(families: Iterable[MetricFamily], samples: Iterable[Sample]) -> bytes:
    """`snapshot_text`, encoded: the body of a /metrics answer without the process_* series."""
    return snapshot_text(families, samples).encode("utf-8")


@dataclass(frozen=True)
class ProcessFamily:
    """A process_* family: the names, help texts and types prometheus_client's
    ProcessCollector used (dashboards of every Python exporter query them)."""

    name: str
    kind: str
    help: str


VIRTUAL_MEMORY = ProcessFamily(
    "process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes."
)
RESIDENT_MEMORY = ProcessFamily(
    "process_resident_memory_bytes", "gauge", "Resident memory size in bytes."
)
START_TIME = ProcessFamily(
    "process_start_time_seconds", "gauge", "Start time of the process since unix epoch in seconds."
)
CPU_SECONDS = ProcessFamily(
    "process_cpu_seconds_total", "counter", "Total user and system CPU time spent in seconds."
)
OPEN_FDS = ProcessFamily("process_open_fds", "gauge", "Number of open file descriptors.")
MAX_FDS = ProcessFamily("process_max_fds", "gauge", "Maximum number of open file descriptors.")
PROCESS_FAMILIES = (VIRTUAL_MEMORY, RESIDENT_MEMORY, START_TIME, CPU_SECONDS, OPEN_FDS, MAX_FDS)
"""In the order they are written."""

# Fields of /proc/<pid>/stat counted after the command's closing parenthesis (proc(5) numbers
# them from 1 with pid and comm first: utime is field 14, i.e. index 11 here).
_UTIME, _STIME, _STARTTIME, _VSIZE, _RSS = 11, 12, 19, 20, 21


class ProcessMetrics:
    """The process_* series of one process (this one by default), from /proc at each call.

    A file that cannot be read leaves its series out (absent, never 0): the stat file gives
    memory, start time and CPU; limits and fd/ give the descriptors."""

    def __init__(self, pid: int | str = "self", proc: Path = Path("/proc")) -> None:
        self.dir = proc / str(pid)
        self.ticks = float(os.sysconf("SC_CLK_TCK"))
        self.page_size = os.sysconf("SC_PAGE_SIZE")
        self.boot_time = _boot_time(proc / "stat")

    def values(self) -> dict[ProcessFamily, float]:
        """What can be read now, by family."""
        out: dict[ProcessFamily, float] = {}
        if self.boot_time is None:  # no /proc: nothing here is readable
            return out
        try:
            fields = (self.dir / "stat").read_bytes().rsplit(b")", 1)[-1].split()
        except OSError:
            pass
        else:
            out[VIRTUAL_MEMORY] = float(fields[_VSIZE])
            out[RESIDENT_MEMORY] = float(fields[_RSS]) * self.page_size
            out[START_TIME] = float(fields[_STARTTIME]) / self.ticks + self.boot_time
            # Each part in seconds, then the sum: the float prometheus_client gave (0.06 can
            # read 0.060000000000000005, and a counter's bytes must not change with the renderer).
            out[CPU_SECONDS] = (
                float(fields[_UTIME]) / self.ticks + float(fields[_STIME]) / self.ticks
            )
        try:
            max_fds = _max_open_files(self.dir / "limits")
            out[OPEN_FDS] = float(len(os.listdir(self.dir / "fd")))
        except OSError:
            return out
        if max_fds is not None:
            out[MAX_FDS] = max_fds
        return out

    def text(self) -> str:
        out: list[str] = []
        values = self.values()
        for family in PROCESS_FAMILIES:
            if family in values:
                row = ((), values[family])
                write_family(
                    out, family.name, family.kind, help_text=family.help, labels=(), rows=[row]
                )
        return "".join(out)


def _boot_time(stat: Path) -> float | None:
    try:
        with stat.open("rb") as lines:
            for line in lines:
                if line.startswith(b"btime "):
                    return float(line.split()[1])
    except OSError:
        return None
    return None


def _max_open_files(limits: Path) -> float | None:
    """The soft limit on open files ("Max open files  <soft>  <hard>  files")."""
    with limits.open("rb") as lines:
        for line in lines:
            if line.startswith(b"Max open files"):
                return float(line.split()[3])
    return None
