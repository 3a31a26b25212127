"""The repeat holdoff holds back repeats, never news: within `repeat_holdoff` of an event for
a device, a finding of the same kind is raised when it is worse than that event, or a different
fault, and only a repeat of the same fault is counted and held back.

Each case is a pair of real kernel lines of one kind about one subject: the first raises an
event and opens the holdoff, the second must raise its own (a corrected machine check, then an
uncorrected one; an NVMe timeout, then the controller down; ...). Read in one round or in two.
"""

from __future__ import annotations

import concurrent.futures
import gc
import time
from pathlib import Path
from typing import NamedTuple

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.contracts.model import Event, Severity
from collectors.kernel_log.collector import _Holdoff, _Holdoffs
from collectors.kernel_log.matchers import MatcherSet
from collectors.kernel_log.parse import LogRecord
from tests.support.kmsg import FakeKmsg
from tests.test_kmsg_collector import Harness, executor, value

__all__ = ["executor"]  # the fixture, used by name


class Pair(NamedTuple):
    case: str
    kind: str
    first: list[str]
    second: list[str]
    severity: Severity
    """The second's."""


PAIRS = [
    Pair(
        "machine check corrected, then uncorrected",
        "machine_check",
        ["mce: [Hardware Error]: Machine check events logged"],
        [
            "mce: [Hardware Error]: CPU 3: Machine Check Exception: 5 Bank 7: be00000000800400",
            "mce: [Hardware Error]: TSC 0 ADDR 12345000 MISC 1234 ",
        ],
        Severity.CRITICAL,
    ),
    Pair(
        "NVMe timeout, then the controller down",
        "nvme_error",
        ["nvme nvme0: I/O 123 QID 4 timeout, aborting"],
        ["nvme nvme0: controller is down; will reset: CSTS=0xffffffff, PCI_STATUS=0x10"],
        Severity.CRITICAL,
    ),
    Pair(
        "firmware error corrected, then fatal",
        "hardware_error",
        [
            "{1}[Hardware Error]: Hardware error from APEI Generic Hardware Error Source: 0",
            "{1}[Hardware Error]: event severity: corrected",
        ],
        [
            "{2}[Hardware Error]: Hardware error from APEI Generic Hardware Error Source: 0",
            "{2}[Hardware Error]: event severity: fatal",
        ],
        Severity.CRITICAL,
    ),
    Pair(
        "SXid non-fatal, then fatal on the same switch",
        "sxid",
        ["nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 20034, Non-fatal, Link 30 LTSSM Fault Up"],
        [
            "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Fatal, Link 32 egress non-posted "
            "PRIV error"
        ],
        Severity.CRITICAL,
    ),
    Pair(
        "file-system error, then the read-only remount it causes",
        "fs_error",
        ["EXT4-fs error (device sda3): ext4_find_entry:1455: inode #2: comm ls: reading dir"],
        ["EXT4-fs (sda3): Remounting filesystem read-only"],
        Severity.CRITICAL,
    ),
]


def _write(device: FakeKmsg, line: str) -> None:
    """A record logged now: the holdoff is judged by when a record was logged (its stamp is
    the time since boot, which the reader turns into wall-clock time)."""
    device.write(line, level=3, usec=int(time.monotonic() * 1e6))


def _of(events: list[Event], kind: str) -> list[Event]:
    return [e for e in events if e.kind == kind]


@pytest.mark.parametrize("rounds", [1, 2], ids=["one round", "two rounds"])
@pytest.mark.parametrize("pair", PAIRS, ids=[p.case for p in PAIRS])
async def test_news_within_the_holdoff_is_raised(
    tmp_path: Path, executor: concurrent.futures.Executor, pair: Pair, rounds: int
) -> None:
    case, kind, first, second, severity = pair
    device = FakeKmsg.with_records([])
    h = Harness(tmp_path, device, executor)
    await h.collect()
    for line in first:
        _write(device, line)
    events: list[Event] = []
    if rounds == 2:
        events += (await h.collect())[0]
        assert len(_of(events, kind)) == 1, case
    for line in second:
        _write(device, line)
    found, samples = await h.collect()
    events += found
    raised = _of(events, kind)
    assert len(raised) == 2, f"{case}: {[e.message for e in raised]}"
    assert raised[0].subject == raised[1].subject  # the same device: the holdoff's key
    assert raised[1].severity is severity
    assert value(samples, "gpuwarden_kernel_log_suppressed_events_total", kind=kind) in (0, None)


@pytest.mark.parametrize("pair", PAIRS, ids=[p.case for p in PAIRS])
async def test_repeats_of_each_are_still_held_back(
    tmp_path: Path, executor: concurrent.futures.Executor, pair: Pair
) -> None:
    """Both faults three times over: one event each, every other finding a counted repeat
    (a machine check's `events logged` line after a dump is part of that dump's finding)."""
    case, kind, first, second, severity = pair
    device = FakeKmsg.with_records([])
    h = Harness(tmp_path, device, executor)
    await h.collect()
    events: list[Event] = []
    for lines in (first, second, first, second, first, second):
        for line in lines:
            _write(device, line)
        found, samples = await h.collect()
        events += found
    raised = _of(events, kind)
    assert [e.severity for e in raised] == [raised[0].severity, severity], case
    findings = value(samples, "gpuwarden_kernel_log_findings_total", kind=kind)
    assert findings is not None and findings >= 4
    assert value(samples, "gpuwarden_kernel_log_suppressed_events_total", kind=kind) == findings - 2


async def test_a_lesser_finding_after_a_worse_one_is_held_back(
    tmp_path: Path, executor: concurrent.futures.Executor
) -> None:
    """An uncorrected firmware error, then corrected ones of the same source: no news."""
    device = FakeKmsg.with_records([])
    h = Harness(tmp_path, device, executor)
    await h.collect()
    for n, severity in ((1, "fatal"), (2, "corrected"), (3, "corrected")):
        _write(
            device,
            f"{{{n}}}[Hardware Error]: Hardware error from APEI Generic Hardware Error Source: 0",
        )
        _write(device, f"{{{n}}}[Hardware Error]: event severity: {severity}")
    events, samples = await h.collect()
    assert [e.severity for e in _of(events, "hardware_error")] == [Severity.CRITICAL]
    assert (
        value(samples, "gpuwarden_kernel_log_suppressed_events_total", kind="hardware_error") == 2
    )


def test_a_flood_of_subjects_costs_in_proportion_to_its_size(tmp_path: Path) -> None:
    """A read holds up to 50,000 records: a flood of findings about as many subjects (hung
    tasks, each its own pid) must cost each finding a look at its own subject's holdoff, not
    at every subject's. Time grows with the count, never with its square: four times the
    findings take about four times as long (sixteen if each looked at every other)."""
    executor = concurrent.futures.ThreadPoolExecutor(1)
    try:
        collector = Harness(tmp_path, FakeKmsg.with_records([]), executor).collector
    finally:
        executor.shutdown()
    records = [
        LogRecord(
            message=f"INFO: task python3:{1000 + i} blocked for more than 120 seconds.", line=i
        )
        for i in range(20_000)
    ]
    findings = list(MatcherSet().scan(records))
    assert len(findings) == len(records)

    def handled(count: int) -> float:
        """Best of three, the garbage collector off while timed (a full collection of a late
        suite's heap takes a few tenths of a second, and lands anywhere)."""
        best = float("inf")
        for attempt in range(3):
            collector._holdoff.clear()
            gc.collect()
            gc.disable()
            try:
                now = time.time()
                start = time.thread_time()
                for i, finding in enumerate(findings[:count]):
                    collector._handle(finding, now, False, ("flood", str(attempt), str(i)))
                best = min(best, time.thread_time() - start)
            finally:
                gc.enable()
        return best

    small, large = handled(5_000), handled(20_000)
    assert large / small < 8, f"5,000 in {small:.3f} s, 20,000 in {large:.3f} s"


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["fault", "clear", "other", "prune"]),
            st.sampled_from(["s1", "s2"]),
            st.floats(0, 1000),
        ),
        max_size=40,
    )
)
def test_the_index_of_subjects_stays_whole(steps: list[tuple[str, str, float]]) -> None:
    """Whatever opens and prunes come, each open holdoff is found under its subject: an
    all-clear and its fault always see each other."""
    holdoffs = _Holdoffs()
    for what, subject, when in steps:
        if what == "prune":
            holdoffs.prune(when)
            continue
        kind = "other_kind" if what == "other" else "k"
        clears = ("k",) if what == "clear" else ()
        holdoffs.open((kind, subject, what, "None"), _Holdoff(when, Severity.WARNING, clears))
        fault, clear = (("k", subject, n, "None") for n in ("fault", "clear"))
        assert holdoffs.get(fault) is None or holdoffs.get(clear) is None
    indexed = {key for keys in holdoffs._keys.values() for key in keys}
    assert indexed == set(holdoffs._held)
    assert all(keys for keys in holdoffs._keys.values())
