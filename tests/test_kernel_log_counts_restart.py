"""A finding's count survives kill -9: the kernel-log counters the alert rules read come back
after an unclean restart with the count they had (this boot's), so an Xid stored and then
killed before Prometheus scraped it still shows to Prometheus.

The agent runs as a real child process (tests/support/agent_proc.py) following a file of raw
/dev/kmsg records (tests/support/kmsg.py's `kmsg_record`: this machine's /dev/kmsg files what
a test writes under the user facility, never trusted). A finding is appended, the test waits
until its event is in the state store (the cursor with it, one transaction), kills the agent
with SIGKILL before any scrape, restarts it and scrapes once. Before the fix the counters
started again at zero (the Xid series absent): the Xid never reached Prometheus.
"""

from __future__ import annotations

import concurrent.futures
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.contracts.collector import JSONValue
from agent.contracts.model import Sample
from agent.program import registry
from agent.runtime.state import StateStore
from collectors.kernel_log.collector import COUNTS_KEY
from collectors.kernel_log.kmsg import STATE_NAMESPACE
from tests.support.agent_proc import AgentProcess, http_get
from tests.support.kmsg import FakeKmsg, capture_records, kmsg_record, write_boot_id
from tests.support.waiting import wait_until
from tests.support.watch import metric_value
from tests.test_kmsg_collector import Harness, value


@pytest.fixture
def executor() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    pool = concurrent.futures.ThreadPoolExecutor(2)
    yield pool
    pool.shutdown(wait=True)


XID13 = "NVRM: Xid (PCI:0000:3b:00): 13, pid=4242, name=python3, Graphics Exception"
XID79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=2314, name=python3, GPU has fallen off the bus."
SXID = "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Fatal, Link 32 egress non-posted"
IO = "I/O error, dev sdb, sector 2048 op 0x1:(WRITE) flags 0x800 phys_seg 1 prio class 2"
FS = "EXT4-fs error (device sda3): ext4_find_entry:1455: inode #2: comm ls: reading dir"
OOM = "Out of memory: Killed process 4321 (python3) total-vm:20000kB, anon-rss:1000kB"

XID = "gpuwarden_xid_errors_total"
SXIDS = "gpuwarden_sxid_errors_total"
FINDINGS = "gpuwarden_kernel_log_findings_total"
_GPU = {"gpu": "", "uuid": "", "model": "", "pci_bus_id": "0000:3b:00.0"}
_SWITCH = {"pci_bus_id": "0000:05:00.0", "device": "nvidia-nvswitch0"}

Series = tuple[str, dict[str, str]]

CASES: list[tuple[str, list[str], list[tuple[Series, float]]]] = [
    ("one xid", [XID13], [((XID, {**_GPU, "xid": "13"}), 1), ((FINDINGS, {"kind": "xid"}), 1)]),
    ("xid 79", [XID79], [((XID, {**_GPU, "xid": "79"}), 1)]),
    # A second Xid of the same GPU and code within the holdoff raises no event: counted only.
    ("held repeats", [XID13] * 3, [((XID, {**_GPU, "xid": "13"}), 3)]),
    (
        "sxid",
        [SXID],
        [((SXIDS, {**_SWITCH, "sxid": "12028"}), 1), ((FINDINGS, {"kind": "sxid"}), 1)],
    ),
    # A storm of the same I/O error is one event per repeat_holdoff; the counter counts all.
    ("io storm", [IO] * 5, [((FINDINGS, {"kind": "io_error"}), 5)]),
    ("fs error", [FS], [((FINDINGS, {"kind": "fs_error"}), 1)]),
    ("oom kill", [OOM], [((FINDINGS, {"kind": "oom_kill"}), 1)]),
    (
        "mixed",
        [XID13, SXID, IO, FS, OOM, XID79],
        [
            ((XID, {**_GPU, "xid": "13"}), 1),
            ((XID, {**_GPU, "xid": "79"}), 1),
            ((SXIDS, {**_SWITCH, "sxid": "12028"}), 1),
            ((FINDINGS, {"kind": "io_error"}), 1),
            ((FINDINGS, {"kind": "xid"}), 2),
        ],
    ),
]


def config(log: Path) -> str:
    others = "".join(
        f"[collectors.{name}]\nenabled = false\n"
        for name in registry.COLLECTORS
        if name != "kernel_log"
    )
    return f'[collectors.kernel_log]\npath = "{log}"\ninterval = 0.5\n{others}'


def stored_count(state_dir: Path) -> int:
    store = StateStore.open(state_dir)
    try:
        return len(store.recent_events(10_000))
    finally:
        store.close()


def _rounds(agent: AgentProcess) -> float:
    runs = metric_value(scrape(agent), "gpuwarden_collector_runs_total", collector="kernel_log")
    return runs or 0.0


def scrape(agent: AgentProcess) -> str:
    status, text = http_get(agent.metrics_url)
    assert status == 200
    return text


@pytest.mark.parametrize(("lines", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_counts_come_back_after_kill_9(
    tmp_path: Path, lines: list[str], expected: list[tuple[Series, float]]
) -> None:
    log = tmp_path / "kmsg-records"
    log.write_bytes(kmsg_record(1, "Linux version 6.8.0 (boot)"))
    agent = AgentProcess(tmp_path / "agent", config(log)).start()
    try:
        scrape(agent)  # up, its first round (the backlog) done or under way
        time.sleep(1.0)
        before = stored_count(agent.workdir / "state")
        usec = int(time.monotonic() * 1e6)
        with log.open("ab") as handle:
            for n, line in enumerate(lines):
                handle.write(kmsg_record(2 + n, line, level=3, usec=usec + n))
        # The round that read the lines is stored (events and cursor, one transaction); no
        # scrape comes between it and the kill.
        wait_until(
            lambda: stored_count(agent.workdir / "state") > before, 10.0, "the findings stored"
        )
        time.sleep(1.5)  # rounds that read nothing more, so no round is cut by the kill
        agent.signal(signal.SIGKILL)
        assert agent.process is not None
        agent.process.wait(10)
        agent.process = None
        agent.start()
        wait_until(lambda: _rounds(agent) >= 2, 10.0, "two kernel_log rounds of the new life")
        text = scrape(agent)
        got = {
            (name, tuple(sorted(labels.items()))): metric_value(text, name, **labels)
            for (name, labels), _ in expected
        }
        want = {(name, tuple(sorted(labels.items()))): value for (name, labels), value in expected}
        assert got == want, agent.log()[-3000:]
    finally:
        agent.stop()


# -- the same on the collector as the runtime builds it (tests/test_kmsg_collector.py) ---------


def _xid_count(samples: list[Sample], code: int) -> float | None:
    return value(samples, XID, pci_bus_id="0000:3b:00.0", xid=str(code))


def _device(lines: list[str]) -> FakeKmsg:
    device = FakeKmsg.with_records(capture_records())
    for line in lines:
        device.write(line, level=3)
    return device


class TestOnTheCollector:
    async def test_a_reboot_starts_from_zero(
        self, tmp_path: Path, executor: concurrent.futures.Executor
    ) -> None:
        h = Harness(tmp_path, _device([XID13, IO, IO]), executor)
        _, samples = await h.collect()
        assert _xid_count(samples, 13) == 1
        await h.restart()
        _, samples = await h.collect()
        assert _xid_count(samples, 13) == 1  # the same boot: carried
        assert value(samples, FINDINGS, kind="io_error") == 2
        write_boot_id(h.boot_id, "boot-b")
        h.device = _device([])  # a new boot's ring: the old records are gone
        await h.restart()
        _, samples = await h.collect()
        assert _xid_count(samples, 13) is None
        assert value(samples, FINDINGS, kind="io_error") == 0

    async def test_restarts_in_a_row_never_add_twice(
        self, tmp_path: Path, executor: concurrent.futures.Executor
    ) -> None:
        """Carried, not added to again: three restarts, then one more Xid, counts 2."""
        device = _device([XID13, SXID])
        h = Harness(tmp_path, device, executor)
        await h.collect()
        for _ in range(3):
            await h.restart()
            _, samples = await h.collect()
            assert _xid_count(samples, 13) == 1
            assert value(samples, SXIDS, sxid="12028") == 1
        device.write(XID13.replace("13, pid=4242", "13, pid=4243"), level=3)
        _, samples = await h.collect(time.time() + 600)  # past the holdoff: its own event
        assert _xid_count(samples, 13) == 2
        assert value(samples, FINDINGS, kind="xid") == 2

    async def test_a_reload_takes_the_xid_counts_over_once(
        self, tmp_path: Path, executor: concurrent.futures.Executor
    ) -> None:
        """A collector rebuilt in the same process (a reload) shares the correlator: its counts
        are not carried into it a second time; its own counters come back from the state."""
        h = Harness(tmp_path, _device([XID13, IO]), executor)
        await h.collect()
        await h.restart()
        await h.collect()
        await h.collector.close()
        h.collector = h.build()  # same SharedServices, same store
        _, samples = await h.collect()
        assert _xid_count(samples, 13) == 1
        assert value(samples, FINDINGS, kind="io_error") == 1

    @pytest.mark.parametrize(
        "stored",
        [
            "not a table",
            {"boot": "boot-a", "findings": "x", "xids": 7, "sxids": [[1, 2]]},
            {"boot": "boot-a", "findings": {"io_error": -3, "xid": True}, "xids": [["p", "13", 1]]},
            {"boot": "boot-a", "xids": [["0000:3b:00.0", 13, "many"]], "confirmed": [[None]]},
            {"findings": {"io_error": 4}},  # no boot: not this one's
        ],
    )
    async def test_a_stored_value_that_does_not_parse_is_zero(
        self, tmp_path: Path, executor: concurrent.futures.Executor, stored: JSONValue
    ) -> None:
        h = Harness(tmp_path, _device([]), executor)
        h.store.put(STATE_NAMESPACE, COUNTS_KEY, stored)
        _, samples = await h.collect()
        assert value(samples, FINDINGS, kind="io_error") == 0
        assert [s for s in samples if s.family.name == XID] == []
