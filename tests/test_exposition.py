"""exporters/exposition.py writes the same bytes prometheus_client wrote for the same snapshot:
hostile help texts and label values, every kind of float, duplicates, redeclared families, the
watcher's families in their order, and the process_* series of a real process."""

from __future__ import annotations

import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from agent.contracts.model import MetricFamily, MetricType, Sample
from agent.program.watch import metrics as watch_metrics
from agent.program.watch.fleet import Fleet
from exporters import exposition
from exporters.exposition import PROCESS_FAMILIES, ProcessMetrics
from tests.support import prom_reference
from tests.support.agent_proc import AgentProcess, http_get
from tests.test_watch_metrics import T0, fleet_with_nodes

HOSTILE = [
    "",
    "\\",
    "\n",
    '"',
    '\\"',
    "\\n",
    "a\\\nb",
    '"}\n# HELP x y',
    "\u00e9\u4e2d\U0001f600",
    "\r\t\x00",
]
"""Texts that break a naive writer: each escape alone, an escape already escaped, an injected
line, multi-byte UTF-8, control characters that need no escape."""

texts = st.one_of(st.sampled_from(HOSTILE), st.text(max_size=12))
values = st.one_of(
    st.floats(allow_nan=False),
    st.sampled_from(
        [0.0, -0.0, 1.0, math.inf, -math.inf, 1e6, 999999.0, 1234567.0, 1e16, 1e-300, 5e-324]
    ),
    st.integers(-(2**64), 2**64).map(float),
)
label_names = st.from_regex(r"\A[a-z_][a-z0-9_]{0,5}\Z").filter(lambda n: not n.startswith("__"))


@st.composite
def families(draw: st.DrawFn) -> MetricFamily:
    kind = draw(st.sampled_from(MetricType))
    stem = draw(st.sampled_from(["a", "b", "c_bytes", "d"]))
    name = f"gpuwarden_{stem}" + ("_total" if kind is MetricType.COUNTER else "")
    helps = texts.filter(lambda t: bool(t.strip()))
    labels = draw(st.lists(label_names, max_size=4, unique=True))
    return MetricFamily(name, kind, draw(helps), tuple(labels))


@st.composite
def snapshots(draw: st.DrawFn) -> tuple[list[MetricFamily], list[Sample]]:
    """Families (the same name sometimes declared twice, differently) and their samples,
    label values from a small pool so that duplicate series occur."""
    declared = draw(st.lists(families(), max_size=5))
    undeclared = draw(st.lists(families(), max_size=2))  # samples without a declaration
    pool = draw(st.lists(texts, min_size=1, max_size=4))
    samples: list[Sample] = []
    for family in declared + undeclared:
        for _ in range(draw(st.integers(0, 4))):
            labels = [draw(st.sampled_from(pool)) for _ in family.labels]
            samples.append(family.sample(draw(values), *labels))
    return declared, draw(st.permutations(samples))


def outcome(render: object, *args: object) -> bytes | str:
    """The bytes, or the exception's type: a text UTF-8 cannot encode fails in both."""
    assert callable(render)
    try:
        body = render(*args)
    except UnicodeEncodeError as exc:
        return type(exc).__name__
    assert isinstance(body, bytes)
    return body


class TestSameBytesAsPrometheusClient:
    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(snapshots())
    def test_snapshot(self, snapshot: tuple[list[MetricFamily], list[Sample]]) -> None:
        declared, samples = snapshot
        assert outcome(exposition.render, declared, samples) == outcome(
            prom_reference.snapshot, declared, samples
        )

    @settings(max_examples=100, deadline=None)
    @given(st.lists(st.tuples(families(), st.lists(st.tuples(st.lists(texts), values)))))
    def test_blocks_in_their_order_with_empty_families(
        self, drawn: list[tuple[MetricFamily, list[tuple[list[str], float]]]]
    ) -> None:
        blocks: list[exposition.Block] = []
        for family, rows in drawn:
            seen: dict[tuple[str, ...], Sample] = {}
            for label_values, value in rows:
                padded = (label_values + [""] * len(family.labels))[: len(family.labels)]
                seen.setdefault(tuple(padded), family.sample(value, *padded))
            blocks.append((family, list(seen.values())))
        ours = exposition.blocks_text(blocks).encode()
        assert ours == prom_reference.blocks(blocks)

    @given(st.floats())
    @example(1e6)
    @example(1e21)
    @example(123456789.125)
    @example(-1e22)
    @example(float("nan"))
    def test_values(self, value: float) -> None:
        reference: str = floatToGoString(value)  # type: ignore[no-untyped-call]
        assert exposition.format_value(value) == reference

    def test_a_lone_surrogate_fails_in_both(self) -> None:
        family = MetricFamily("gpuwarden_x", MetricType.GAUGE, "x", ("l",))
        samples = [family.sample(1.0, "\udcff")]
        assert outcome(exposition.render, [family], samples) == "UnicodeEncodeError"
        assert outcome(prom_reference.snapshot, [family], samples) == "UnicodeEncodeError"

    @pytest.mark.parametrize("fleet", [fleet_with_nodes(), Fleet(now=T0)], ids=["nodes", "empty"])
    def test_the_watchers_families(self, fleet: Fleet) -> None:
        snap = watch_metrics.snapshot(fleet, T0 + 20)
        blocks = watch_metrics.families(snap)
        assert watch_metrics.render(snap, 10_000) == prom_reference.blocks(blocks)
        if not fleet.nodes:  # the families of a fleet without nodes are there, empty
            assert any(not samples for _, samples in blocks)


class TestTextFormat:
    """The format itself, written out (the reference could be wrong too)."""

    def test_escapes_and_label_order(self) -> None:
        family = MetricFamily("gpuwarden_x_total", MetricType.COUNTER, 'a\\b\n"c"', ("z", "a"))
        body = exposition.render([family], [family.sample(2, 'q"\\\n', "é")]).decode()
        assert body == (
            '# HELP gpuwarden_x_total a\\\\b\\n"c"\n'
            "# TYPE gpuwarden_x_total counter\n"
            'gpuwarden_x_total{a="é",z="q\\"\\\\\\n"} 2.0\n'
        )

    @pytest.mark.parametrize(
        ("value", "text"),
        [
            (1.0, "1.0"),
            (-0.0, "-0.0"),
            (math.inf, "+Inf"),
            (-math.inf, "-Inf"),
            (math.nan, "NaN"),
            (999999.0, "999999.0"),
            (1e6, "1e+06"),
            (1234567.5, "1.2345675e+06"),
            (-1234567.0, "-1234567.0"),
            (1e16, "1e+16"),
            (1.5e-7, "1.5e-07"),
        ],
    )
    def test_values(self, value: float, text: str) -> None:
        assert exposition.format_value(value) == text

    def test_duplicates_dropped_and_families_sorted(self) -> None:
        b = MetricFamily("gpuwarden_b", MetricType.GAUGE, "b", ("l",))
        a = MetricFamily("gpuwarden_a", MetricType.GAUGE, "a")
        empty = MetricFamily("gpuwarden_empty", MetricType.GAUGE, "no samples")
        body = exposition.render([b, empty], [b.sample(1, "x"), a.sample(3), b.sample(2, "x")])
        parsed = list(text_string_to_metric_families(body.decode()))
        assert [f.name for f in parsed] == ["gpuwarden_a", "gpuwarden_b"]
        assert [s.value for s in parsed[1].samples] == [1.0]


CHILD = """
import os, resource, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (1234, 4096))
extra = [os.open("/dev/null", os.O_RDONLY) for _ in range(5)]
while time.process_time() < 0.3:  # CPU time the series must show
    pass
print(len(os.listdir("/proc/self/fd")) - 1, flush=True)  # less listdir's own descriptor
sys.stdin.read()
"""


@pytest.fixture
def child() -> Iterator[tuple[subprocess.Popen[str], int, float]]:
    """A real process with known descriptors, limit and CPU time, then stopped (SIGSTOP) so
    that two readers see the same values: (process, open fds, when it started)."""
    started = time.time()
    process = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        fds = int(process.stdout.readline())
        os.kill(process.pid, signal.SIGSTOP)
        stat = Path(f"/proc/{process.pid}/stat")
        deadline = time.monotonic() + 10
        while stat.read_text().rsplit(")", 1)[1].split()[0] != "T":  # the signal takes effect
            assert time.monotonic() < deadline, "the child did not stop"
            time.sleep(0.01)
        yield process, fds, started
    finally:
        os.kill(process.pid, signal.SIGCONT)
        process.kill()
        process.wait(timeout=10)


def parsed(text: str) -> dict[str, tuple[str, str, float]]:
    out = {}
    for family in text_string_to_metric_families(text):
        (sample,) = family.samples
        out[sample.name] = (family.type, family.documentation, sample.value)
    return out


class TestProcessSeries:
    def test_same_bytes_as_process_collector(
        self, child: tuple[subprocess.Popen[str], int, float]
    ) -> None:
        process, _, _ = child
        ours = ProcessMetrics(process.pid).text().encode()
        assert ours == prom_reference.process(process.pid)

    def test_values_from_proc(self, child: tuple[subprocess.Popen[str], int, float]) -> None:
        process, fds, started = child
        series = parsed(ProcessMetrics(process.pid).text())
        assert [f.name for f in PROCESS_FAMILIES] == list(series)
        assert series["process_open_fds"][2] == fds
        assert series["process_max_fds"][2] == 1234
        assert series["process_cpu_seconds_total"][2] >= 0.29  # clock ticks: 10 ms
        # Gross bounds: /proc's start time is in clock ticks since boot.
        assert started - 2 <= series["process_start_time_seconds"][2] <= time.time()
        # statm: sizes in pages, another file than the stat the series come from.
        size, resident = Path(f"/proc/{process.pid}/statm").read_text().split()[:2]
        page = os.sysconf("SC_PAGE_SIZE")
        # The kernel's resident counters are per-CPU and read approximately: stat and statm
        # may differ by a few dozen pages (seen: 14) for the same stopped process.
        assert abs(series["process_resident_memory_bytes"][2] - int(resident) * page) <= 2**20
        assert series["process_virtual_memory_bytes"][2] == int(size) * page
        assert (
            series["process_virtual_memory_bytes"][2] >= series["process_resident_memory_bytes"][2]
        )

    def test_names_help_and_types_as_process_collector(self) -> None:
        ours = parsed(ProcessMetrics().text())
        theirs = parsed(prom_reference.process().decode())
        assert {n: s[:2] for n, s in ours.items()} == {n: s[:2] for n, s in theirs.items()}
        assert "counter" in {s[0] for s in ours.values()}

    def test_documented(self) -> None:
        doc = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
        missing = [f.name for f in PROCESS_FAMILIES if f"`{f.name}`" not in doc]
        assert not missing, f"docs/metrics.md does not name {missing}"

    def test_no_proc_no_series(self, tmp_path: Path) -> None:
        assert ProcessMetrics(proc=tmp_path).text() == ""

    def test_a_gone_process_has_no_series(self, tmp_path: Path) -> None:
        process = subprocess.Popen(["true"])
        process.wait(timeout=10)
        assert ProcessMetrics(process.pid).text() == ""


def test_the_sink_serves_the_snapshot_then_its_process(tmp_path: Path) -> None:
    """The agent's /metrics body: the snapshot as prometheus_client gave it, then this
    process's series (values move between two reads; names and order do not)."""
    from exporters.prometheus import PrometheusSettings, PrometheusSink
    from tests.support.collectors import scripted_runtime

    runtime, _ = scripted_runtime({"a": "ok"})
    sink = PrometheusSink(PrometheusSettings(listen="127.0.0.1:1"), runtime)
    body = sink.metrics_body().decode()
    snapshot, _, rest = body.partition("# HELP process_virtual_memory_bytes")
    assert snapshot.encode() == prom_reference.snapshot(runtime.families(), runtime.samples())
    assert "gpuwarden_" in snapshot
    assert list(parsed("# HELP process_virtual_memory_bytes" + rest)) == [
        f.name for f in PROCESS_FAMILIES
    ]


@pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool (Debian package prometheus) missing"
)
def test_the_real_agents_body_is_promtool_clean(agent_process: AgentProcess) -> None:
    """The whole /metrics of a real `gpuwarden run` on the embedded defaults (no GPU here:
    the GPU collector's failure is series too), process_* of the agent's own pid included."""
    agent_process.start()
    assert agent_process.process is not None
    pid = agent_process.process.pid
    status, body = http_get(agent_process.metrics_url)
    assert status == 200
    lint = subprocess.run(
        ["promtool", "check", "metrics"], input=body, text=True, capture_output=True, check=False
    )
    assert (lint.returncode, lint.stdout + lint.stderr) == (0, "")
    process = {
        s.name: s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
        if s.name.startswith("process_")
    }
    assert list(process) == [f.name for f in PROCESS_FAMILIES]
    assert process["process_max_fds"] == resource.prlimit(pid, resource.RLIMIT_NOFILE)[0]
    assert 0 < process["process_resident_memory_bytes"] < 2**30
