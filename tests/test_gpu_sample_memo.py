"""The GPU collector reuses last round's Sample where a value did not change
(collectors/gpu/metrics.py SampleMemo). A reused sample must never be stale: over any sequence
of readings and label changes, the memo's samples are exactly what a fresh build gives."""

from __future__ import annotations

import math
from dataclasses import fields

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.contracts.errors import ModelError
from agent.contracts.model import GPU_LABELS, Sample
from collectors._nvml import GpuReading
from collectors.gpu import metrics as m
from tests.support.nvml import GpuRig, value
from tests.support.nvml_fake import FakeGpu, FakeNvml

LABELS = (
    dict(zip(GPU_LABELS, ("0", "GPU-a", "NVIDIA H200", "0000:18:00.0"), strict=True)),
    dict(zip(GPU_LABELS, ("0", "GPU-b", "NVIDIA H200", "0000:18:00.0"), strict=True)),
)

# Few distinct values, so that successive readings often repeat one (the memo's case), with
# the zeros whose sign prints apart.
numbers = st.one_of(
    st.none(), st.sampled_from([0.0, -0.0, 1.0, 2.5, 1e21, float("inf")]), st.floats(0, 1e6)
)
whole = st.one_of(st.none(), st.integers(0, 3))
flags = st.one_of(st.none(), st.booleans())


@st.composite
def readings(draw: st.DrawFn) -> GpuReading:
    values: dict[str, object] = {}
    for f in fields(GpuReading):
        if f.name in ("errors", "processes"):
            continue
        if f.name == "clock_event_reasons":
            values[f.name] = draw(st.one_of(st.none(), st.integers(0, 0x1FF)))
        elif f.name in ("remap_pending", "remap_failure"):
            values[f.name] = draw(flags)
        elif f.type in ("int | None",):
            values[f.name] = draw(whole)
        else:
            values[f.name] = draw(numbers)
    return GpuReading(**values)  # type: ignore[arg-type]


def exact(samples: list[Sample]) -> list[tuple[str, tuple[str, ...], str]]:
    """What the exposition prints of each sample: repr tells -0.0 from 0.0."""
    return [(s.family.name, s.label_values, repr(s.value)) for s in samples]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from([0, 1]), readings(), numbers, st.sampled_from([None, "lost"])),
        min_size=1,
        max_size=8,
    )
)
def test_memo_samples_equal_fresh_ones_round_after_round(
    rounds: list[tuple[int, GpuReading, float | None, str | None]],
) -> None:
    memo = m.SampleMemo()
    for which, reading, energy, state in rounds:
        labels = LABELS[which]
        assert exact(m.reading_samples(labels, reading, energy, memo)) == exact(
            m.reading_samples(labels, reading, energy)
        )
        assert exact(m.state_samples(labels, state, memo)) == exact(m.state_samples(labels, state))
        assert all(s.label_values[: len(GPU_LABELS)] == tuple(labels.values()) for s in
                   memo.series.values())  # fmt: skip


def test_a_nan_is_refused_with_the_memo_too() -> None:
    memo = m.SampleMemo()
    m.reading_samples(LABELS[0], GpuReading(power_draw_watts=300.0), memo=memo)
    for _ in range(2):  # also when the memo saw NaN last time
        with pytest.raises(ModelError, match="NaN"):
            m.reading_samples(LABELS[0], GpuReading(power_draw_watts=math.nan), memo=memo)


def test_the_memo_holds_one_round_of_series_after_labels_change() -> None:
    memo = m.SampleMemo()
    full = GpuReading(temperature_gpu_celsius=40.0, clock_event_reasons=1, memory_used_bytes=1.0)
    m.reading_samples(LABELS[0], full, memo=memo)
    m.reading_samples(LABELS[1], GpuReading(temperature_gpu_celsius=41.0), memo=memo)
    assert {s.label_values[1] for s in memo.series.values()} == {"GPU-b"}
    assert len(memo.series) == 1


async def test_the_collector_exports_each_changed_value() -> None:
    """Real rounds of the collector: every fast reading that changes between two rounds
    shows its new value, the unchanged ones keep theirs."""
    fake = FakeNvml([FakeGpu.h200(0)])
    rig = GpuRig(fake)
    try:
        first = await rig.collect()
        gpu = fake.gpus[0]
        before_power = value(first, "gpuwarden_gpu_power_watts")
        before_temperature = value(first, "gpuwarden_gpu_temperature_celsius", sensor="gpu")
        before_total = value(first, "gpuwarden_gpu_memory_total_bytes")
        assert None not in (before_power, before_temperature, before_total)
        assert gpu.temperature is not None and gpu.power_mw is not None
        gpu.temperature += 7
        gpu.power_mw += 12_000
        gpu.clock_event_reasons = 0x4
        second = await rig.collect()
        assert value(second, "gpuwarden_gpu_temperature_celsius", sensor="gpu") == (
            (before_temperature or 0) + 7
        )
        assert value(second, "gpuwarden_gpu_power_watts") == (before_power or 0) + 12
        assert value(second, "gpuwarden_gpu_clock_event_active", reason="sw_power_cap") == 1
        assert value(second, "gpuwarden_gpu_clock_event_active", reason="gpu_idle") == 0
        assert value(second, "gpuwarden_gpu_memory_total_bytes") == before_total
    finally:
        await rig.close()
