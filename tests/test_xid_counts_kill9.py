"""An Xid that only NVML saw, in the seconds before a kill -9, still counts after the restart.

The Xid counters (`gpuwarden_xid_errors_total`, from the shared Xid correlator) and the event
counter (`gpuwarden_events_total`) come back after an unclean death with what the state store
holds of this boot. Before the fix the Xid counts were stored only with the kernel_log
collector's round (its cursor snapshot): an Xid the NVML event thread raised between two of
those rounds was in the stored events and not in the stored count, and a repeat that raised no
event (inside the correlation window, or held back by the holdoff) was in neither; the event
counter started again at zero in each process.

The agent runs as a real process on the fake NVML (tests/support/fake_nvml_agent.py), which
turns a file the test drops into an NVML Xid event. The kernel_log collector follows an empty
file on a long interval, so no round of it stores anything between the Xid and the kill: the
gap is the one a busy host has for up to an interval. The test kills with SIGKILL at several
points (as soon as the fake delivered the Xid; once its event is stored; rounds later; after
repeats that raised no event), restarts the agent on the same state dir (the same boot), and
scrapes once.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agent.contracts.model import Event
from agent.program import registry
from agent.runtime.state import StateStore
from collectors._xid import XidCorrelator, XidObservation, parse_snapshot
from tests.support.agent_proc import AgentProcess, http_get
from tests.support.fake_nvml_agent import inject_xid, injected
from tests.support.kmsg import kmsg_record
from tests.support.waiting import wait_until

PCI = "0000:18:00.0"
"""The fake GPU 0's address."""
XID = "gpuwarden_xid_errors_total"
EVENTS = "gpuwarden_events_total"


def series(text: str, name: str, **labels: str) -> float | None:
    """The value of the one series of `name` whose labels include `labels`; None if none."""
    found: list[float] = []
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name + "{"):
            continue
        head, _, value = line.rpartition(" ")
        body = head[len(name) + 1 : -1]
        have = dict(part.split("=", 1) for part in body.split(",") if part)
        if all(have.get(k) == f'"{v}"' for k, v in labels.items()):
            found.append(float(value))
    assert len(found) <= 1, f"{name} {labels}: {found}"
    return found[0] if found else None


def stored_xids(state_dir: Path) -> list[Event]:
    store = StateStore.open(state_dir)
    try:
        return [e for e in store.recent_events(10_000) if e.source == "gpu" and e.kind == "xid"]
    finally:
        store.close()


@dataclass
class Host:
    agent: AgentProcess
    devices: Path
    injected: list[int] = field(default_factory=list)

    @property
    def state_dir(self) -> Path:
        return self.agent.workdir / "state"

    def xid(self, code: int) -> None:
        """NVML reports Xid `code` on GPU 0; returns once the fake has delivered it."""
        request = inject_xid(self.devices, 0, code)
        wait_until(lambda: injected(request), 10.0, f"the fake to deliver Xid {code}")
        self.injected.append(code)

    def stored(self, code: int, count: int = 1) -> None:
        wait_until(
            lambda: (
                sum(e.attributes.get("xid") == code for e in stored_xids(self.state_dir)) >= count
            ),
            15.0,
            f"Xid {code}'s event in the state store",
        )

    def kill_and_restart(self) -> str:
        self.agent.signal(signal.SIGKILL)
        assert self.agent.process is not None
        self.agent.process.wait(10)
        self.agent.process = None
        self.agent.start(timeout=30.0)
        wait_until(lambda: _runs(self.agent, "kernel_log") >= 1, 20.0, "a kernel_log round")
        wait_until(lambda: _runs(self.agent, "gpu") >= 1, 20.0, "a gpu round")
        status, text = http_get(self.agent.metrics_url)
        assert status == 200
        return text


def _runs(agent: AgentProcess, collector: str) -> float:
    _, text = http_get(agent.metrics_url)
    return series(text, "gpuwarden_collector_runs_total", collector=collector) or 0.0


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    devices = tmp_path / "dev"
    devices.mkdir()
    log = tmp_path / "kmsg-records"
    log.write_bytes(kmsg_record(1, "Linux version 6.8.0 (boot)"))
    others = "".join(
        f"[collectors.{name}]\nenabled = false\n"
        for name in registry.COLLECTORS
        if name not in ("gpu", "kernel_log")
    )
    agent = AgentProcess(
        tmp_path / "agent",
        entry=["-m", "tests.support.fake_nvml_agent", str(devices), "1"],
        config_text=(
            "[collectors.gpu]\ninterval = 0.5\nevent_wait_ms = 100\n"
            'sysfs_root = "/nonexistent"\n'
            # Its rounds (which stored the Xid counts before the fix) far apart: none falls
            # between an Xid and the kill.
            f'[collectors.kernel_log]\npath = "{log}"\ninterval = 60\n{others}'
        ),
    )
    agent.start(timeout=30.0)
    wait_until(lambda: _runs(agent, "gpu") >= 2, 20.0, "the gpu collector's rounds")
    time.sleep(0.5)  # the NVML event thread registered (it starts with the first round)
    yield Host(agent, devices)
    agent.stop()


def at_once(host: Host) -> dict[int, int] | None:
    """Killed as soon as NVML delivered it: whatever is stored, the count says the same."""
    host.xid(79)
    return None


def stored(host: Host) -> dict[int, int]:
    host.xid(79)
    host.stored(79)
    return {79: 1}


def rounds_later(host: Host) -> dict[int, int]:
    host.xid(79)
    host.stored(79)
    time.sleep(1.5)  # gpu rounds, a heartbeat of the store writer; no kernel_log round
    return {79: 1}


def repeat_in_window(host: Host) -> dict[int, int]:
    """The second Xid 79 within 5 s of the first is a repeat: counted, no event. Xid 13 after
    it, from the same thread, is stored after it: its event stored, the repeat is too."""
    host.xid(79)
    host.stored(79)
    host.xid(79)
    host.xid(13)
    host.stored(13)
    return {79: 2, 13: 1}


def held_by_holdoff(host: Host) -> dict[int, int]:
    """Past the window but within the holdoff: a new incident that raises no event."""
    host.xid(79)
    host.stored(79)
    time.sleep(5.5)
    host.xid(79)
    host.xid(13)
    host.stored(13)
    return {79: 2, 13: 1}


KILL_POINTS = {
    "at once": at_once,
    "stored": stored,
    "rounds later": rounds_later,
    "repeat in window": repeat_in_window,
    "held by holdoff": held_by_holdoff,
}


@pytest.mark.slow
@pytest.mark.parametrize("point", KILL_POINTS)
def test_nvml_xid_counts_survive_kill_9(host: Host, point: str) -> None:
    expected = KILL_POINTS[point](host)
    text = host.kill_and_restart()
    events = stored_xids(host.state_dir)
    if expected is None:  # as much as the store kept: its event and its count, or neither
        expected = {79: sum(e.attributes.get("xid") == 79 for e in events)}
    got = {code: series(text, XID, pci_bus_id=PCI, xid=str(code)) or 0 for code in expected}
    assert got == expected, host.agent.log()[-3000:]
    # The event counter the alert rules read says what the stored events say.
    for severity in {e.severity.label for e in events}:
        want = sum(e.severity.label == severity for e in events)
        have = series(text, EVENTS, source="gpu", kind="xid", severity=severity)
        assert have == want, (severity, host.agent.log()[-3000:])


# -- the carry: two snapshots of one correlator, each stored at its own time ------------------

OLD = {(PCI, 79): 1}
NEW = {(PCI, 79): 3, (PCI, 13): 1}


@pytest.mark.parametrize(
    ("kernel_log", "nvml"),
    [(OLD, NEW), (NEW, OLD), (NEW, NEW), ({}, NEW), (NEW, {})],
    ids=["nvml newer", "kernel_log newer", "the same", "nvml alone", "kernel_log alone"],
)
def test_the_carry_is_the_newer_snapshot_per_gpu_and_code(
    kernel_log: dict[tuple[str, int], int], nvml: dict[tuple[str, int], int]
) -> None:
    correlator = XidCorrelator()
    correlator.observe(XidObservation("nvml", PCI, 48, time.time()))  # this life's own
    assert correlator.carry_counts(kernel_log, {}, origin="kernel_log")
    assert correlator.carry_counts(nvml, nvml, origin="nvml")
    want = {key: max(kernel_log.get(key, 0), nvml.get(key, 0)) for key in {*kernel_log, *nvml}}
    assert correlator.counts == {**want, (PCI, 48): 1}
    assert correlator.confirmations == nvml
    # A collector rebuilt by a reload reads its own snapshot again (this life's, now): no
    # second carry.
    assert not correlator.carry_counts({(PCI, 79): 9}, {}, origin="kernel_log")
    assert correlator.counts == {**want, (PCI, 48): 1}


def test_a_snapshot_round_trips_and_malformed_rows_are_skipped() -> None:
    correlator = XidCorrelator()
    for code in (79, 79, 13):
        correlator.observe(XidObservation("nvml", PCI, code, time.time()))
    counts, confirmed = parse_snapshot(json.loads(json.dumps(correlator.snapshot())))
    assert counts == correlator.counts
    assert confirmed == correlator.confirmations
    bad = {"xids": [[PCI, "13", 1], [PCI, 13, -1], [PCI, True, 2], [7, 13, 1], [PCI, 13]]}
    assert parse_snapshot(bad) == ({}, {})
    assert parse_snapshot("not a table") == ({}, {})
