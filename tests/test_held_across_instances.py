"""A repair requirement a collector raised ends with the fault, whichever instance sees it end.

The repair ledger outlives a collector instance (a reload replaces it) and the process (it is
in the state store). An instance that knew only its own rounds never raised the all-clear for
a fault its predecessor reported and that ended before it looked: the requirement (a GPU
reset, a storage check; a Slurm drain on it) was held until a reboot, or for ever. The
measured case: a GPU hung, a reload, the call returned before the new instance's first round.

Each case raises a fault with the first instance, ends it, then lets a second instance (the
same one, a reloaded one, one of a restarted agent on the same state directory) look: the
all-clear comes, under the subject the fault was raised under, and nothing is held.
"""

from __future__ import annotations

import ast
import dataclasses
import errno
import os
import subprocess
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml
import pytest

from agent.contracts.collector import CollectorDeps, CollectorSettings, CollectorSpec
from agent.contracts.model import Event
from agent.contracts.settings import build
from agent.program import config_file as config
from agent.program import registry
from agent.runtime.core import Runtime
from agent.runtime.state import StateStore
from collectors._nvml import NvmlBackend
from collectors.disk.collector import DiskCollector, DiskSettings
from collectors.gpu.collector import GpuSettings
from collectors.io_probe import IoProbeSettings
from collectors.processes import ProcessesSettings
from tests.support.disk import SmallDisk
from tests.support.host import ProcTree
from tests.support.nvml import fake_gpus
from tests.support.nvml_fake import FakeNvml
from tests.support.waiting import until

SLOW = 30.0
"""The first instance's interval: after its first round it does not look again."""
FAST = 0.05


@dataclass
class Fault:
    """One fault of one collector: started before the first instance runs, ended after it
    reported it."""

    collector: str
    raised: str
    cleared: str
    subject: str
    settings: Callable[[float], CollectorSettings]
    start: Callable[[], None]
    end: Callable[[], None]
    specs: dict[str, CollectorSpec[Any]] = field(default_factory=dict)
    shared: Callable[[Runtime], None] = lambda runtime: None
    close: Callable[[], None] = lambda: None
    remove: Callable[[], CollectorSettings | None] | None = None
    """Stop watching the fault's subject while the fault goes on: new settings to reload
    with, or None where the host changed (the mount is gone)."""
    reuse: Callable[[], None] | None = None
    """The fault's subject named by another thing now, in the same fault (a pid reused by
    a new process after a restart, stuck as the old one was)."""


class Statvfs:
    """statvfs for two mounts: '/' answers; '/mnt/data' answers, hangs until `release`, or
    fails with EIO, as `mode` says."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.release = threading.Event()

    def __call__(self, path: str) -> os.statvfs_result:
        if path.endswith("/mnt/data"):
            if self.mode == "hang":
                self.release.wait(30)
            elif self.mode == "error":
                raise OSError(errno.EIO, os.strerror(errno.EIO), path)
        return os.statvfs("/")


def gpu_fault(tmp_path: Path, *, read_first: bool) -> Fault:
    fake = FakeNvml(fake_gpus(2))
    release = threading.Event()
    gpu = fake.gpus[1]

    def start() -> None:
        gpu.hang = release

    def end() -> None:
        gpu.hang = None
        release.set()

    def settings(interval: float) -> CollectorSettings:
        return GpuSettings(interval=interval, timeout=0.2, event_thread=False)

    def shared(runtime: Runtime) -> None:
        runtime.shared.put(NvmlBackend, NvmlBackend(fake))

    fault = Fault(
        "gpu",
        "gpu_unresponsive",
        "gpu_recovered",
        gpu.uuid if read_first else "1",
        settings,
        start,
        end,
        shared=shared,
    )
    if not read_first:  # hung in the first round of all: named by its index
        start()
    return fault


def disk_fault(tmp_path: Path, *, mode: str) -> Fault:
    """/mnt/data stuck, failing, or read-only at the super block (as after file-system
    errors); its all-clear when it answers, works, is writable again."""
    tree = ProcTree(tmp_path / "proc")

    def mount(super_options: str) -> None:
        tree.set_mountinfo(
            "27 1 259:2 / / rw - ext4 /dev/sda1 rw\n"
            f"30 27 0:45 / /mnt/data rw - nfs4 storage01:/export {super_options}\n"
        )

    mount("rw,hard")
    statvfs = Statvfs()

    def make(settings: DiskSettings, deps: CollectorDeps) -> DiskCollector:
        return DiskCollector(settings, deps, statvfs)

    def settings(interval: float) -> CollectorSettings:
        values = {"proc_root": str(tree.root), "interval": interval, "timeout": 0.2}
        return build(DiskSettings, values)

    def start() -> None:
        if mode == "read-only":
            mount("ro,hard")
        else:
            statvfs.mode = mode

    def end() -> None:
        if mode == "read-only":
            mount("rw,hard")
        statvfs.mode = "ok"
        statvfs.release.set()

    def unmount() -> None:  # 'umount -f -l', as mount_stuck advises
        tree.set_mountinfo("27 1 259:2 / / rw - ext4 /dev/sda1 rw\n")

    raised, cleared = {
        "hang": ("mount_stuck", "mount_recovered"),
        "error": ("mount_error", "mount_error_cleared"),
        "read-only": ("filesystem_readonly", "filesystem_writable"),
    }[mode]
    spec: CollectorSpec[Any] = CollectorSpec("disk", "test", DiskSettings, make)
    return Fault(
        "disk", raised, cleared, "/mnt/data", settings, start, end, {"disk": spec}, remove=unmount
    )


def probe_fault(tmp_path: Path) -> Fault:
    """The write probe on a real tmpfs, remounted read-only (EROFS) and back."""
    disk = SmallDisk(tmp_path / "probed").__enter__()
    directory = str(disk.path)

    def remount(mode: str) -> Callable[[], None]:
        def run() -> None:
            subprocess.run(["mount", "-o", f"remount,{mode}", directory], check=True)

        return run

    def settings(interval: float) -> CollectorSettings:
        values = {
            "enabled": True,
            "directories": [directory],
            "size_mib": 1,
            "free_margin_mib": 0,
            "interval": interval,
        }
        return build(IoProbeSettings, values)

    other = tmp_path / "other"
    other.mkdir()

    def remove() -> CollectorSettings:
        return build(IoProbeSettings, {"enabled": True, "directories": [str(other)]})

    return Fault(
        "io_probe",
        "io_probe_failed",
        "io_probe_recovered",
        directory,
        settings,
        remount("ro"),
        remount("rw"),
        close=lambda: disk.__exit__(None, None, None),
        remove=remove,
    )


def nvml_fault(tmp_path: Path) -> Fault:
    """No driver at the first round of all: NVML cannot start, then can."""
    fake = FakeNvml(fake_gpus(1))

    def start() -> None:
        fake.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED

    def end() -> None:
        fake.init_error = None

    def settings(interval: float) -> CollectorSettings:
        values = {"interval": interval, "event_thread": False, "nvml_retry_interval": 1.0}
        return build(GpuSettings, values)

    def shared(runtime: Runtime) -> None:
        runtime.shared.put(NvmlBackend, NvmlBackend(fake))

    start()
    return Fault(
        "gpu", "nvml_unavailable", "nvml_available", "host", settings, start, end, shared=shared
    )


def process_fault(tmp_path: Path, *, zombies: bool) -> Fault:
    """A process stuck in D state, or a parent that leaves its zombies unreaped, in a /proc
    tree of the test's; the fault ends when the process (its zombies) go."""
    tree = ProcTree(tmp_path / "proc")
    tree.add_process(1, "systemd", "S", ppid=0)

    def start() -> None:
        if zombies:
            tree.add_process(700, "trainer", "S")
            for pid in range(701, 705):
                tree.add_process(pid, "worker", "Z", ppid=700)
        else:
            tree.add_process(700, "trainer", "D", wchan="nfs_wait_on_request")

    def end() -> None:
        for pid in range(701, 705) if zombies else (700,):
            if (tree.root / str(pid)).exists():  # ended once already
                tree.remove_process(pid)

    def reuse() -> None:
        """pid 700 ended; a new process got its pid, and is stuck (leaves zombies) too."""
        end()
        if (tree.root / "700").exists():
            tree.remove_process(700)
        if zombies:
            tree.add_process(700, "other", "S", starttime=5000)
            for pid in range(711, 715):
                tree.add_process(pid, "worker", "Z", ppid=700)
        else:
            tree.add_process(700, "other", "D", starttime=5000, wchan="blk_mq_get_tag")

    def settings(interval: float) -> CollectorSettings:
        values = {
            "proc_root": str(tree.root),
            "interval": interval,
            "d_state_threshold": 0.01,
            "zombie_threshold": 4,
        }
        return build(ProcessesSettings, values)

    kinds = (
        ("zombies_accumulating", "zombies_reaped")
        if zombies
        else (
            "process_stuck_d_state",
            "process_d_state_ended",
        )
    )
    return Fault("processes", *kinds, "pid 700", settings, start, end, reuse=reuse)


FAULTS: dict[str, Callable[[Path], Fault]] = {
    "gpu-hung": lambda p: gpu_fault(p, read_first=True),
    "gpu-hung-never-read": lambda p: gpu_fault(p, read_first=False),
    "mount-stuck": lambda p: disk_fault(p, mode="hang"),
    "mount-error": lambda p: disk_fault(p, mode="error"),
    "mount-read-only": lambda p: disk_fault(p, mode="read-only"),
    "probe-failed": probe_fault,
    "nvml-unavailable": nvml_fault,
    "process-stuck": lambda p: process_fault(p, zombies=False),
    "zombies": lambda p: process_fault(p, zombies=True),
}


TAKEN_OVER: dict[str, tuple[str, ...]] = {
    # all-clear -> the FAULTS that run it across a reload and a restart (the fixture checks
    # that each fault's all-clear is the one named here)
    "gpu_recovered": ("gpu-hung", "gpu-hung-never-read"),
    "nvml_available": ("nvml-unavailable",),
    "mount_recovered": ("mount-stuck",),
    "mount_error_cleared": ("mount-error",),
    "filesystem_writable": ("mount-read-only",),
    "io_probe_recovered": ("probe-failed",),
    "process_d_state_ended": ("process-stuck",),
    "zombies_reaped": ("zombies",),
}


class Agent:
    """Runtimes on one state directory, one at a time, as an agent and its restarts are."""

    def __init__(self, tmp_path: Path, fault: Fault) -> None:
        self.state_dir = tmp_path / "state"
        self.state_dir.mkdir()
        self.fault = fault
        self.runtime: Runtime | None = None
        self.events: list[Event] = []
        """Every event of every runtime, in order."""

    async def start(self, interval: float) -> Runtime:
        cfg = config.parse({"prometheus": {"enabled": False}})
        cfg = dataclasses.replace(
            cfg,
            core=dataclasses.replace(cfg.core, state_dir=self.state_dir),
            collectors={self.fault.collector: self.fault.settings(interval)},
        )
        runtime = Runtime(
            cfg,
            StateStore.open(self.state_dir),
            collectors={**registry.COLLECTORS, **self.fault.specs},
            sinks=registry.SINKS,
            boot_id="this-boot",
        )
        self.fault.shared(runtime)
        runtime.subscribe(self.events.append)
        await runtime.start()
        self.runtime = runtime
        return runtime

    async def stop(self) -> None:
        if self.runtime is not None:
            runtime, self.runtime = self.runtime, None
            await runtime.stop()
            runtime.store.close()

    def of(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.kind == kind]

    def looking_for(self, kind: str) -> Callable[[], bool]:
        """For `until`: whether an event of `kind` came; if not, the collector's next round
        runs now (the first instance's interval is long)."""

        def seen() -> bool:
            if self.of(kind):
                return True
            if self.runtime is not None:
                self.runtime.collectors[self.fault.collector].wake.set()
            return False

        return seen

    def held(self) -> list[tuple[str, str, str]]:
        assert self.runtime is not None
        return [(r.source, r.kind, r.subject) for r in self.runtime.repairs()]


@pytest.fixture(params=sorted(FAULTS))
async def agent(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Agent]:
    async for agent in running(request.param, tmp_path):
        yield agent


@pytest.fixture(params=["mount-error", "mount-read-only", "mount-stuck", "probe-failed"])
async def removable(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Agent]:
    """The faults whose subject can stop being watched."""
    async for agent in running(request.param, tmp_path):
        yield agent


async def running(name: str, tmp_path: Path) -> AsyncIterator[Agent]:
    fault = FAULTS[name](tmp_path)
    assert name in TAKEN_OVER[fault.cleared]
    agent = Agent(tmp_path, fault)
    try:
        yield agent
    finally:
        agent.fault.end()
        await agent.stop()
        agent.fault.close()


async def start_faulty(agent: Agent) -> Runtime:
    """The first instance: one round, the fault, the round that reports it."""
    fault = agent.fault
    runtime = await agent.start(SLOW)
    status = runtime.collectors[fault.collector]
    await until(lambda: status.rounds_done >= 1, what="the first round")
    fault.start()  # a no-op where the fault was there before the first round
    await until(agent.looking_for(fault.raised), what=fault.raised)
    return runtime


async def raise_and_end(agent: Agent) -> Runtime:
    """The first instance reports the fault; the fault ends; no instance has looked since."""
    fault = agent.fault
    runtime = await start_faulty(agent)
    assert (fault.raised, fault.subject) in {(k, s) for _, k, s in agent.held()}
    fault.end()
    await until(lambda: runtime.hung_calls() == 0, what="the hung call to return")
    return runtime


async def check_cleared(agent: Agent, runtime: Runtime) -> None:
    fault = agent.fault
    assert runtime is agent.runtime
    await until(agent.looking_for(fault.cleared), timeout=5, what=fault.cleared)
    assert [e.subject for e in agent.of(fault.cleared)] == [fault.subject]
    assert agent.held() == []
    assert [e.subject for e in agent.of(fault.raised)] == [fault.subject]


class TestAllClearWhoeverSeesIt:
    async def test_same_instance(self, agent: Agent) -> None:
        await check_cleared(agent, await raise_and_end(agent))

    async def test_reloaded_instance(self, agent: Agent) -> None:
        runtime = await raise_and_end(agent)
        collectors = {agent.fault.collector: agent.fault.settings(FAST)}
        await runtime.reload(dataclasses.replace(runtime.config, collectors=collectors))
        await check_cleared(agent, runtime)

    async def test_restarted_agent(self, agent: Agent) -> None:
        await raise_and_end(agent)
        await agent.stop()
        await check_cleared(agent, await agent.start(FAST))

    async def test_disabled_then_enabled(self, agent: Agent) -> None:
        """A collector disabled by a reload clears nothing (no one looked: the GPU, the mount,
        the process may still be broken, and an action such as Slurm's resume must not take
        an edit for a repair); enabled again, its new instance takes over and clears."""
        runtime = await start_faulty(agent)
        fault = agent.fault
        off = fault.settings(FAST).replace(enabled=False)
        await runtime.reload(dataclasses.replace(runtime.config, collectors={fault.collector: off}))
        assert fault.collector not in runtime.collectors
        fault.end()  # while no one looks
        await until(lambda: runtime.hung_calls() == 0, what="the hung call to return")
        await runtime.settle()
        assert (fault.raised, fault.subject) in {(k, s) for _, k, s in agent.held()}
        assert agent.of(fault.cleared) == []
        collectors = {fault.collector: fault.settings(FAST)}
        await runtime.reload(dataclasses.replace(runtime.config, collectors=collectors))
        await check_cleared(agent, runtime)


class TestStillFaultyAfterAnInstanceChange:
    """The new instance that finds the fault still there says nothing new: the requirement
    is held already, under the same subject."""

    async def test_reloaded_instance(self, agent: Agent) -> None:
        fault = agent.fault
        runtime = await start_faulty(agent)
        collectors = {fault.collector: fault.settings(FAST)}
        await runtime.reload(dataclasses.replace(runtime.config, collectors=collectors))
        status = runtime.collectors[fault.collector]
        await until(lambda: status.rounds_done >= 3, what="rounds of the second instance")
        assert [e.subject for e in agent.of(fault.raised)] == [fault.subject]
        assert agent.of(fault.cleared) == []
        await ends_cleared(agent)

    async def test_restarted_agent(self, agent: Agent) -> None:
        fault = agent.fault
        await start_faulty(agent)
        await agent.stop()
        runtime = await agent.start(FAST)
        status = runtime.collectors[fault.collector]
        await until(lambda: status.rounds_done >= 3, what="rounds of the restarted agent")
        assert [e.subject for e in agent.of(fault.raised)] == [fault.subject]
        assert agent.of(fault.cleared) == []
        await ends_cleared(agent)


@pytest.fixture(params=["process-stuck", "zombies"])
async def reused(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Agent]:
    """The faults whose subject's name another thing can take."""
    async for agent in running(request.param, tmp_path):
        yield agent


class TestNameTakenByAnother:
    """A pid is reused: after a restart, another process with the pid of the one reported
    is in the same fault. The one reported is gone (its all-clear), the new one is news (its
    own raise), and what is held is the new one's."""

    async def test_restarted_agent(self, reused: Agent) -> None:
        fault = reused.fault
        assert fault.reuse is not None
        await start_faulty(reused)
        await reused.stop()
        fault.reuse()
        runtime = await reused.start(FAST)
        await until(reused.looking_for(fault.cleared), what=fault.cleared)
        await until(lambda: len(reused.of(fault.raised)) == 2, what="the new process raised")
        first, second = reused.of(fault.raised)
        assert second.subject == first.subject == fault.subject
        assert "other" in second.message or second.attributes.get("comm") == "other"
        await until(
            lambda: [r.event_id for r in runtime.repairs()] == [second.id],
            what="the new one held, alone",
        )


async def ends_cleared(agent: Agent) -> None:
    fault = agent.fault
    fault.end()
    await until(agent.looking_for(fault.cleared), what=fault.cleared)
    assert [e.subject for e in agent.of(fault.cleared)] == [fault.subject]
    assert agent.held() == []


class TestSubjectNoLongerWatched:
    """A stuck mount detached with 'umount -l' (as mount_stuck advises), a probed directory
    left out of the configuration: nothing will ever look at the subject again, so what it
    raised ends now rather than being held for ever."""

    async def test_all_clear(self, removable: Agent) -> None:
        fault = removable.fault
        assert fault.remove is not None
        runtime = await start_faulty(removable)
        settings = fault.remove()
        if settings is not None:
            collectors = {fault.collector: settings}
            await runtime.reload(dataclasses.replace(runtime.config, collectors=collectors))
        await until(removable.looking_for(fault.cleared), what=fault.cleared)
        (cleared,) = removable.of(fault.cleared)
        assert cleared.subject == fault.subject
        assert "no longer" in cleared.message
        assert removable.held() == []


STORED: dict[str, str] = {
    # all-clear (as written at its Event site) -> where the state it ends with is kept, when
    # not taken over from the ledger (the FAULTS above)
    "xid": "a kernel-log line (Xid 154 to None): whoever reads it clears",
    "benchmark_recovered": "the last failure, in the collector's state store",
    "benchmark_regression_cleared": "regressed:<uuid>, in the collector's state store",
    "benchmark_peer_cleared": "peer_slow:<uuid>, in the collector's state store",
    "f'filesystem_{what}_ok'": "the levels, in the collector's state store",
    "f'{name}_cleared'": "ConditionTracker, in the collector's state store",
    "gpu_not_enumerated_cleared": "ConditionTracker, in the collector's state store",
    "gpus_missing_cleared": "ConditionTracker, in the collector's state store",
    "gpus_missing": "(the raising side of gpus_missing_cleared's conditional: clears nothing)",
    "finding.kind": "a kernel-log finding's clears: whoever reads the line",
    "kind": "the disk's no-longer-watched all-clears, _gone_event (TestSubjectNoLongerWatched)",
}


def all_clear_sites() -> set[str]:
    """The kind of every `Event(...)` with `clears` in collectors/: a literal, both sides of
    a conditional, or the expression as written."""
    kinds: set[str] = set()
    for path in sorted(Path(__file__).resolve().parents[1].joinpath("collectors").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "Event"
            ):
                continue
            keywords = {k.arg: k.value for k in node.keywords}
            kind = keywords.get("kind")
            if "clears" not in keywords or kind is None:
                continue
            branches = [kind.body, kind.orelse] if isinstance(kind, ast.IfExp) else [kind]
            for branch in branches:
                if isinstance(branch, ast.Constant) and isinstance(branch.value, str):
                    kinds.add(branch.value)
                else:
                    kinds.add(ast.unparse(branch))
    return kinds


def test_every_all_clear_survives_an_instance_change() -> None:
    """The class: a new all-clear is either taken over from the ledger (a case in FAULTS,
    run above across a reload and a restart) or ends a state kept in the state store."""
    sites = all_clear_sites()
    assert "gpu_recovered" in sites and len(sites) >= 15  # the scan sees them
    assert sites - set(TAKEN_OVER) - set(STORED) == set()
    assert set(STORED) <= sites  # nothing listed that is gone
    assert {name for names in TAKEN_OVER.values() for name in names} == set(FAULTS)
