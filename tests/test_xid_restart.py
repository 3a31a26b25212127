"""One alert per Xid across unclean restarts: the same Xid seen by NVML and by the kernel log
is one `xid` event even when the process is killed between the two sightings.

Each "life" of the agent here is what a process holds: a new correlator (a new
SharedServices), a new NVML event thread over a new fake NVML (NVML delivers no event of
before its registration: nothing is replayed), a kernel_log collector over the same /dev/kmsg
double (the H200 capture plus the test's records, written with the kernel's monotonic
stamps), and the real state store on disk, which is all that outlives a kill. A round is
stored as the runtime stores it: its events and its cursor in one transaction; a kill loses
what was not stored. The class under test: whichever source saw the Xid first, wherever the
kill fell (before the line was read, after it was read but before its round was stored), and
however many times in a row, the user gets one `xid` event and the other sighting is an
`xid_confirmed` of it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest

from agent.contracts.collector import (
    CollectContext,
    CollectorDeps,
    MemoryKeyValueStore,
    SharedServices,
)
from agent.contracts.model import Event, Severity
from agent.program import config_file as config
from agent.runtime.blocking import PooledCaller
from agent.runtime.core import Runtime
from agent.runtime.state import StateStore
from collectors._nvml import NvmlBackend
from collectors._xid import XID_KINDS, shared_correlator
from collectors.gpu.events import GpuEventThread
from collectors.kernel_log.collector import KernelLogCollector, KernelLogSettings
from collectors.kernel_log.kmsg import KMSG_CURSOR_KEY, STATE_NAMESPACE
from tests.support.kmsg import FakeKmsg, capture_records, write_boot_id
from tests.support.nvml import fake_gpus
from tests.support.nvml_fake import FakeNvml
from tests.support.waiting import wait_until

PCI = "0000:18:00.0"
"""The fake GPU 0's address (`00000000:18:00.0` in NVML's form)."""
CODES = (13, 31, 48, 79, 94, 119)


def xid_line(code: int) -> str:
    return f"NVRM: Xid (PCI:0000:18:00): {code}, pid=4242, name=python3, restart test"


def now_usec() -> int:
    """A kmsg stamp for a record logged now (the kernel's monotonic clock)."""
    return int(time.monotonic() * 1e6)


@pytest.fixture
def executor() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    pool = concurrent.futures.ThreadPoolExecutor(2)
    yield pool
    pool.shutdown(wait=True)


class Life:
    """One agent process over the state store in `state_dir`."""

    def __init__(
        self, tmp_path: Path, device: FakeKmsg, executor: concurrent.futures.Executor
    ) -> None:
        self.store = StateStore.open(tmp_path / "state")
        self.device = device
        self.executor = executor
        self.emitted: list[Event] = []
        kv = MemoryKeyValueStore()  # the collector's values, as the store last held them
        cursor = self.store.get(STATE_NAMESPACE, KMSG_CURSOR_KEY)
        if cursor is not None:
            kv.put(STATE_NAMESPACE, KMSG_CURSOR_KEY, cursor)
        self.kv = kv
        self.deps = CollectorDeps(
            "node",
            tmp_path,
            kv,
            SharedServices(),
            self.emitted.append,
            stored_events=self.store.events_since,
        )
        settings = KernelLogSettings(
            path=Path("/dev/kmsg"), boot_id_path=write_boot_id(tmp_path / "boot_id", "boot-a")
        )
        self.kernel_log = KernelLogCollector(settings, self.deps, io=device)
        self.nvml = FakeNvml(fake_gpus(1))
        self.backend = NvmlBackend(self.nvml)
        self.backend.start()
        self.events = GpuEventThread(
            self.backend, shared_correlator(self.deps), self.emitted.append, [(0, 0xFF9F)], dict
        )
        self.events.start()
        assert self.events.ready.wait(5)
        self.rounds = 0

    def nvml_xid(self, code: int) -> Event:
        """NVML reports the Xid; its event is emitted and stored (the runtime's emit)."""
        before = len(self.emitted)
        self.nvml.push_event(self.nvml.gpus[0], pynvml.nvmlEventTypeXidCriticalError, code)
        wait_until(lambda: len(self.emitted) > before, timeout=5.0, what="the NVML event")
        event = self.emitted[-1]
        self.store.record_events([event], outbox=False)
        return event

    async def read_kernel_log(self, *, store: bool = True) -> list[Event]:
        """One kernel_log round; stored with its cursor unless the kill comes first."""
        ctx = CollectContext(PooledCaller(self.executor, 5.0), time.time(), self.rounds)
        self.rounds += 1
        events = list((await self.kernel_log.collect(ctx)).events)
        if store:
            cursor = self.kv.get(STATE_NAMESPACE, KMSG_CURSOR_KEY)
            values = {(STATE_NAMESPACE, KMSG_CURSOR_KEY): json.dumps(cursor)}
            self.store.write_batch(events, values, outbox=False)
        return events

    def kill(self) -> None:
        """SIGKILL, as far as this process's memory goes: nothing more is stored."""
        self.events.stop()
        self.backend.stop()
        self.store.close()


def kinds(events: list[Event]) -> list[str]:
    return [e.kind for e in events]


class TestNvmlFirstThenKill:
    @pytest.mark.parametrize("code", CODES)
    @pytest.mark.parametrize("killed", ["before the read", "before the round was stored"])
    async def test_the_reread_line_confirms_the_stored_event(
        self, tmp_path: Path, executor: concurrent.futures.Executor, code: int, killed: str
    ) -> None:
        device = FakeKmsg.with_records(capture_records())
        life = Life(tmp_path, device, executor)
        assert await life.read_kernel_log() == []  # the capture holds no Xid
        raised = life.nvml_xid(code)
        device.write(xid_line(code), usec=now_usec())
        if killed == "before the round was stored":
            [read] = await life.read_kernel_log(store=False)
            assert read.kind == "xid_confirmed"  # as the live process saw it
        life.kill()

        again = Life(tmp_path, device, executor)
        events = await again.read_kernel_log()
        again.kill()
        assert kinds(events) == ["xid_confirmed"], [e.message for e in events]
        assert events[0].attributes["confirms"] == raised.id
        assert [e.id for e in stored_xids(tmp_path) if e.kind == "xid"] == [raised.id]

    async def test_a_restart_loop_raises_once(
        self, tmp_path: Path, executor: concurrent.futures.Executor
    ) -> None:
        """Killed again and again, at every point: one xid, one confirmation, the same id."""
        device = FakeKmsg.with_records(capture_records())
        life = Life(tmp_path, device, executor)
        raised = life.nvml_xid(79)
        device.write(xid_line(79), usec=now_usec())
        life.kill()
        confirmations: set[str] = set()
        for n in range(4):  # read and killed unstored, three times; then stored
            life = Life(tmp_path, device, executor)
            events = await life.read_kernel_log(store=n == 3)
            life.kill()
            assert kinds(events) == ["xid_confirmed"]
            confirmations.add(events[0].id)
        life = Life(tmp_path, device, executor)
        assert await life.read_kernel_log() == []  # past the cursor now
        life.kill()
        assert len(confirmations) == 1
        assert [(e.kind, e.id) for e in stored_xids(tmp_path)] == [
            ("xid", raised.id),
            ("xid_confirmed", confirmations.pop()),
        ]


class TestKernelLogFirstThenKill:
    async def test_the_nvml_twin_in_the_next_life_confirms(
        self, tmp_path: Path, executor: concurrent.futures.Executor
    ) -> None:
        """The kernel log raised it and the round was stored; NVML's report of it reaches
        the restarted process (inside the window): it confirms, it raises nothing."""
        device = FakeKmsg.with_records(capture_records())
        life = Life(tmp_path, device, executor)
        await life.read_kernel_log()
        device.write(xid_line(48), usec=now_usec())
        [raised] = await life.read_kernel_log()
        assert raised.kind == "xid"
        life.kill()

        again = Life(tmp_path, device, executor)
        assert await again.read_kernel_log() == []  # the cursor is past the line
        twin = again.nvml_xid(48)
        again.kill()
        assert twin.kind == "xid_confirmed"
        assert twin.attributes["confirms"] == raised.id

    async def test_nvml_replays_nothing_and_nothing_is_raised_again(
        self, tmp_path: Path, executor: concurrent.futures.Executor
    ) -> None:
        """Both sightings stored before the kill: the next life raises nothing for them."""
        device = FakeKmsg.with_records(capture_records())
        life = Life(tmp_path, device, executor)
        await life.read_kernel_log()
        device.write(xid_line(31), usec=now_usec())
        [raised] = await life.read_kernel_log()
        assert life.nvml_xid(31).attributes["confirms"] == raised.id
        life.kill()
        again = Life(tmp_path, device, executor)
        assert await again.read_kernel_log() == []
        time.sleep(0.3)  # the NVML thread's waits: nothing was queued for this life
        again.kill()
        assert again.emitted == []
        assert [e.kind for e in stored_xids(tmp_path)] == ["xid", "xid_confirmed"]


class TestNewXidsAfterTheRestart:
    async def test_an_xid_of_another_time_is_its_own_event(
        self, tmp_path: Path, executor: concurrent.futures.Executor
    ) -> None:
        """The seed matches by when the Xid happened: a line of the same GPU and code logged
        a minute before the stored event (outside the window) is another Xid, raised."""
        device = FakeKmsg.with_records(capture_records())
        life = Life(tmp_path, device, executor)
        raised = life.nvml_xid(13)
        life.kill()
        device.write(xid_line(13), usec=now_usec() - 60_000_000)  # a minute before
        again = Life(tmp_path, device, executor)
        events = await again.read_kernel_log()
        again.kill()
        assert kinds(events) == ["xid"]
        assert events[0].id != raised.id

    async def test_another_gpu_or_code_is_its_own_event(
        self, tmp_path: Path, executor: concurrent.futures.Executor
    ) -> None:
        device = FakeKmsg.with_records(capture_records())
        life = Life(tmp_path, device, executor)
        life.nvml_xid(13)
        life.kill()
        device.write(xid_line(31), usec=now_usec())
        device.write(
            "NVRM: Xid (PCI:0000:86:00): 13, pid=1, name=python3, restart test", usec=now_usec()
        )
        again = Life(tmp_path, device, executor)
        events = await again.read_kernel_log()
        again.kill()
        assert sorted(
            (e.kind, e.attributes["pci_bus_id"], e.attributes["xid"]) for e in events
        ) == [
            ("xid", PCI, 31),
            ("xid", "0000:86:00.0", 13),
        ]


def stored_xids(tmp_path: Path) -> list[Event]:
    store = StateStore.open(tmp_path / "state")
    try:
        return store.events_since("gpu", XID_KINDS, 0.0)
    finally:
        store.close()


def test_the_runtime_hands_collectors_the_stored_xid_events(tmp_path: Path) -> None:
    """What the agent wires: CollectorDeps.stored_events reads the runtime's store (the source
    and kinds asked, from `since` on, oldest first), and a store that cannot be read gives
    none rather than a failed start."""
    store = StateStore.open(tmp_path / "state")
    old = Event(
        source="gpu", kind="xid", severity=Severity.WARNING, message="old", subject=PCI, time=100.0
    )
    new = Event(
        source="gpu",
        kind="xid_confirmed",
        severity=Severity.WARNING,
        message="new",
        subject=PCI,
        time=200.0,
    )
    other = Event(
        source="disk",
        kind="xid",
        severity=Severity.WARNING,
        message="other",
        subject="sda",
        time=200.0,
    )
    store.record_events([new, old, other], outbox=False)
    cfg = dataclasses.replace(config.parse({"prometheus": {"enabled": False}}), collectors={})
    runtime = Runtime(cfg, store, collectors={}, sinks={})
    deps = runtime._deps("kernel_log")
    assert [e.id for e in deps.stored_events("gpu", XID_KINDS, 0.0)] == [old.id, new.id]
    assert [e.id for e in deps.stored_events("gpu", XID_KINDS, 150.0)] == [new.id]
    store.close()
    assert list(deps.stored_events("gpu", XID_KINDS, 0.0)) == []


async def test_the_events_of_another_boot_are_not_taken_over(tmp_path: Path) -> None:
    """A reboot ends what the last life raised: the Xid lines of a new boot are new Xids (the
    holdoff does not hold one back either). A store that does not say which boot its events
    are of gives none (a store of an older agent)."""
    store = StateStore.open(tmp_path / "state")
    store.record_events(
        [Event(source="gpu", kind="xid", severity=Severity.CRITICAL, message="x", subject=PCI)],
        outbox=False,
    )
    cfg = dataclasses.replace(config.parse({"prometheus": {"enabled": False}}), collectors={})
    seen = []
    for boot in ("boot-a", "boot-a", "boot-b", "boot-b"):
        runtime = Runtime(cfg, store, collectors={}, sinks={}, boot_id=boot)
        seen.append(len(runtime._deps("kernel_log").stored_events("gpu", XID_KINDS, 0.0)))
        await runtime.start()
        await runtime.stop()
    store.close()
    assert seen == [0, 1, 0, 1]
