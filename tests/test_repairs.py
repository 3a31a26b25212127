"""The repair ledger (which actions are required now) and the escalation of an Xid that two
reboots did not cure, on the real state store and the real kernel_log collector."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.contracts.collector import MemoryKeyValueStore
from agent.contracts.errors import ModelError
from agent.contracts.model import Event, RepairAction, Severity
from agent.program import config_file as config
from agent.program import registry
from agent.runtime.core import Runtime
from agent.runtime.repairs import RepairLedger
from agent.runtime.state import StateStore
from collectors._repair import XidRecurrence
from collectors._xid import XidCorrelator
from tests.support.kmsg import FakeKmsg, capture_records, write_boot_id
from tests.test_kmsg_collector import Harness

R = RepairAction


def ev(
    kind: str,
    repair: RepairAction = R.NONE,
    *,
    subject: str = "GPU-1",
    clears: tuple[str, ...] = (),
    source: str = "gpu",
    severity: Severity = Severity.CRITICAL,
    **attributes: str | int,
) -> Event:
    return Event(
        source,
        kind,
        severity,
        f"{kind} on {subject}",
        subject=subject,
        repair_action=repair,
        clears=clears,
        attributes=attributes,
    )


def active(ledger: RepairLedger) -> set[tuple[str, str, str]]:
    return {(r.action.value, r.kind, r.subject) for r in ledger.active()}


class TestLedger:
    def test_raised_until_its_all_clear_on_the_same_subject(self) -> None:
        ledger = RepairLedger(MemoryKeyValueStore(), "boot-a")
        assert ledger.apply(ev("gpu_lost", R.REBOOT_NODE))
        assert ledger.apply(ev("gpu_lost", R.REBOOT_NODE, subject="GPU-2"))
        assert not ledger.apply(ev("gpu_recovered", clears=("gpu_lost",), subject="GPU-3"))
        assert not ledger.apply(ev("gpu_recovered", clears=("gpu_lost",), source="disk"))
        assert ledger.apply(ev("gpu_recovered", clears=("gpu_lost",)))
        assert active(ledger) == {("reboot_node", "gpu_lost", "GPU-2")}

    def test_every_kind_of_the_subject_clears_with_a_star(self) -> None:
        ledger = RepairLedger(MemoryKeyValueStore(), "boot-a")
        ledger.apply(ev("xid", R.REBOOT_NODE, xid=79))
        ledger.apply(ev("xid", R.RESET_GPU, xid=48))
        ledger.apply(ev("row_remap_failure", R.HARDWARE_INSPECTION))
        ledger.apply(ev("xid", R.RESET_GPU, subject="GPU-2"))
        ledger.apply(ev("xid", clears=("*",)))
        assert active(ledger) == {("reset_gpu", "xid", "GPU-2")}

    def test_an_application_fault_and_no_action_are_never_held(self) -> None:
        ledger = RepairLedger(MemoryKeyValueStore(), "boot-a")
        assert not ledger.apply(ev("xid", R.RESTART_APPLICATION, fault="application"))
        assert not ledger.apply(ev("xid", R.NONE))
        assert ledger.active() == []

    def test_a_restart_keeps_it_and_a_reboot_clears_what_it_performs(self, tmp_path: Path) -> None:
        store = StateStore.open(tmp_path / "state")
        ledger = RepairLedger(store, "boot-a")
        ledger.apply(ev("gpu_lost", R.REBOOT_NODE))
        ledger.apply(ev("xid", R.RESET_GPU, subject="GPU-2"))
        ledger.apply(ev("row_remap_failure", R.HARDWARE_INSPECTION))
        ledger.apply(ev("filesystem_space_low", R.CHECK_STORAGE, subject="/data", source="disk"))
        store.close()
        store = StateStore.open(tmp_path / "state")
        assert len(RepairLedger(store, "boot-a").active()) == 4  # the agent restarted
        after_reboot = RepairLedger(store, "boot-b")
        assert {a for a, _, _ in active(after_reboot)} == {"hardware_inspection", "check_storage"}
        store.close()

    def test_a_subject_is_cleared_under_another_of_its_names(self, tmp_path: Path) -> None:
        """A GPU named by its PCI address before it was read, by its UUID after (with the
        address as an alias): either name clears the other, also after a restart."""
        pci, uuid = "0000:3b:00.0", "GPU-1"
        store = StateStore.open(tmp_path / "state")
        ledger = RepairLedger(store, "boot-a")
        ledger.apply(ev("xid", R.RESET_GPU, subject=pci))
        ledger.apply(dataclasses.replace(ev("xid", R.REBOOT_NODE, subject=uuid), aliases=(pci,)))
        ledger.apply(ev("xid", R.RESET_GPU, subject="0000:86:00.0"))
        store.close()
        store = StateStore.open(tmp_path / "state")
        ledger = RepairLedger(store, "boot-a")  # the agent restarted: the aliases are kept
        assert {r.subject: r.aliases for r in ledger.active()}[uuid] == (pci,)
        ledger.apply(ev("xid", clears=("*",), subject=pci))  # named by its address only
        assert active(ledger) == {("reset_gpu", "xid", "0000:86:00.0")}
        store.close()

    def test_aliases_travel_and_older_payloads_have_none(self) -> None:
        event = dataclasses.replace(ev("xid", R.RESET_GPU), aliases=("0000:3b:00.0",))
        data = event.to_dict()
        assert data["aliases"] == ["0000:3b:00.0"]
        assert Event.from_dict(data) == event
        assert "aliases" not in ev("xid").to_dict()
        assert Event.from_dict(ev("xid").to_dict()).aliases == ()
        with pytest.raises(ModelError, match="aliases must be a list"):
            Event.from_dict({**data, "aliases": "0000:3b:00.0"})

    def test_a_worse_repeat_refreshes_it_keeping_when_it_began(self) -> None:
        ledger = RepairLedger(MemoryKeyValueStore(), "boot-a")
        first = ev("filesystem_space_low", R.CHECK_STORAGE, severity=Severity.WARNING)
        ledger.apply(first)
        worse = dataclasses.replace(
            ev("filesystem_space_low", R.CHECK_STORAGE), time=first.time + 60
        )
        assert ledger.apply(worse)
        (entry,) = ledger.active()
        assert entry.severity is Severity.CRITICAL
        assert entry.since == first.time


class TestAfter:
    """What the ledger will hold once events on their way to the store are taken in: a
    collector instance that starts now takes over from it (tests/test_held_across_instances.py)."""

    EVENTS = (
        ev("gpu_lost", R.REBOOT_NODE),
        ev("xid", R.RESET_GPU, subject="GPU-2"),
        ev("gpu_recovered", clears=("gpu_lost",)),
        ev("filesystem_space_low", R.CHECK_STORAGE, subject="/data", source="disk"),
        ev("xid", R.RESTART_APPLICATION, subject="GPU-3"),
    )

    def test_the_same_as_applying_them_and_nothing_changed(self) -> None:
        store = MemoryKeyValueStore()
        ledger = RepairLedger(store, "boot-a")
        ledger.apply(ev("row_remap_failure", R.HARDWARE_INSPECTION, subject="GPU-4"))
        before, stored = ledger.active(), store.items("repairs")
        preview = ledger.after(self.EVENTS)
        assert (ledger.active(), store.items("repairs")) == (before, stored)
        for event in self.EVENTS:
            ledger.apply(event)
        assert preview == ledger.active()
        assert {(r.kind, r.subject) for r in preview} == {
            ("row_remap_failure", "GPU-4"),
            ("xid", "GPU-2"),
            ("filesystem_space_low", "/data"),
        }

    async def test_the_runtime_counts_what_is_not_announced_yet(self) -> None:
        cfg = dataclasses.replace(config.parse({"prometheus": {"enabled": False}}), collectors={})
        rt = Runtime(cfg, StateStore.in_memory(), collectors={}, sinks=registry.SINKS)
        await rt.start()
        try:
            rt.emit(ev("gpu_lost", R.REBOOT_NODE))  # on the loop: queued for the store writer
            assert rt.repairs() == []
            assert [r.kind for r in rt.held_repairs()] == ["gpu_lost"]
            await rt.settle()
            assert rt.held_repairs() == rt.repairs() != []
            rt.emit(ev("gpu_recovered", clears=("gpu_lost",)))
            assert rt.held_repairs() == [] != rt.repairs()
        finally:
            await rt.stop()

    async def test_and_what_the_store_writer_is_storing(self) -> None:
        """A slow disk: the store writer has taken the event and is still writing it."""
        cfg = dataclasses.replace(config.parse({"prometheus": {"enabled": False}}), collectors={})
        rt = Runtime(cfg, StateStore.in_memory(), collectors={}, sinks=registry.SINKS)
        await rt.start()
        writing, done = threading.Event(), threading.Event()
        flush = rt.guard.flush

        def slow_flush(outbox: bool) -> bool:
            writing.set()
            done.wait(10)
            return flush(outbox)

        rt.guard.flush = slow_flush  # type: ignore[method-assign]
        try:
            rt.emit(ev("gpu_lost", R.REBOOT_NODE))
            assert await asyncio.to_thread(writing.wait, 10)
            assert rt._unannounced == []  # taken by the writer, not announced yet
            assert rt.repairs() == []
            assert [r.kind for r in rt.held_repairs()] == ["gpu_lost"]
        finally:
            done.set()
            await rt.stop()
        assert [r.kind for r in rt.repairs()] == ["gpu_lost"]


async def test_metrics_show_one_series_per_required_action_and_subject() -> None:
    cfg = dataclasses.replace(config.parse({"prometheus": {"enabled": False}}), collectors={})
    rt = Runtime(cfg, StateStore.in_memory(), collectors={}, sinks=registry.SINKS)
    await rt.start()
    try:

        def series() -> dict[tuple[str, ...], float]:
            return {
                s.label_values: s.value
                for s in rt.samples()
                if s.family.name == "gpuwarden_repair_required"
            }

        rt.emit(ev("xid", R.REBOOT_NODE, xid=79, severity=Severity.WARNING))
        rt.emit(ev("gpu_lost", R.REBOOT_NODE))  # the same action of the same GPU: one series
        rt.emit(ev("row_remap_failure", R.HARDWARE_INSPECTION, subject="GPU-2"))
        # A warning that needs a drain-class action (a degraded PCIe link) is not a page: the
        # alert rules tell the two apart by the severity label, the worst of the entries.
        rt.emit(
            ev(
                "pcie_link_degraded",
                R.HARDWARE_INSPECTION,
                subject="GPU-3",
                severity=Severity.WARNING,
            )
        )
        await rt.settle()
        assert series() == {
            ("reboot_node", "GPU-1", "critical"): 1,
            ("hardware_inspection", "GPU-2", "critical"): 1,
            ("hardware_inspection", "GPU-3", "warning"): 1,
        }
        rt.emit(ev("xid", clears=("*",)))
        await rt.settle()
        assert series() == {
            ("hardware_inspection", "GPU-2", "critical"): 1,
            ("hardware_inspection", "GPU-3", "warning"): 1,
        }
    finally:
        await rt.stop()


class TestEscalation:
    def test_a_reset_xid_back_after_two_reboots_needs_inspection(self) -> None:
        store = MemoryKeyValueStore()
        repairs = []
        for boot in ("boot-a", "boot-b", "boot-c", "boot-c"):
            recurrence = XidRecurrence(store, functools.partial(str, boot))  # one per agent start
            escalated = recurrence.escalate(ev("xid", R.RESET_GPU, xid=48))
            repairs.append(escalated.repair_action)
        assert repairs == [R.RESET_GPU, R.RESET_GPU, R.HARDWARE_INSPECTION, R.HARDWARE_INSPECTION]

    def test_other_gpus_codes_and_repairs_count_apart(self) -> None:
        store = MemoryKeyValueStore()
        for boot in ("boot-a", "boot-b", "boot-c"):
            recurrence = XidRecurrence(store, functools.partial(str, boot))
            app = recurrence.escalate(ev("xid", R.RESTART_APPLICATION, xid=31))
            other = recurrence.escalate(ev("xid", R.RESET_GPU, subject=f"GPU-{boot}", xid=48))
        assert app.repair_action is R.RESTART_APPLICATION
        assert other.repair_action is R.RESET_GPU

    def test_no_boot_id_no_escalation_and_no_loss(self) -> None:
        def broken() -> str:
            raise OSError("no /proc")

        event = ev("xid", R.RESET_GPU, xid=48)
        assert XidRecurrence(MemoryKeyValueStore(), broken).escalate(event) == event


@pytest.fixture
def executor() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    pool = concurrent.futures.ThreadPoolExecutor(2)
    yield pool
    pool.shutdown(wait=True)


async def test_the_kernel_log_collector_escalates_across_boots(
    tmp_path: Path, executor: concurrent.futures.Executor
) -> None:
    """Xid 79 in three boots, the agent restarted each time on the same state store."""

    def device() -> FakeKmsg:
        kmsg = FakeKmsg.with_records(capture_records())
        kmsg.write("NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus.")
        return kmsg

    h = Harness(tmp_path, device(), executor)
    seen = []
    for boot in ("boot-a", "boot-b", "boot-c"):
        write_boot_id(h.boot_id, boot)
        h.device = device()
        await h.restart()
        events, _ = await h.collect()
        (xid,) = [e for e in events if e.kind == "xid"]
        seen.append((xid.repair_action, xid.attributes["boots_seen"]))
    await h.collector.close()
    h.store.close()
    assert seen == [(R.REBOOT_NODE, 1), (R.REBOOT_NODE, 2), (R.HARDWARE_INSPECTION, 3)]


async def test_the_ledger_writes_no_statement_on_the_loop(tmp_path: Path) -> None:
    """Requirements raised and cleared while the agent runs: the ledger's writes go through
    the store writer's thread, none runs on the event loop."""
    cfg = dataclasses.replace(config.parse({"prometheus": {"enabled": False}}), collectors={})
    store = StateStore.open(tmp_path / "state")
    rt = Runtime(cfg, store, collectors={}, sinks=registry.SINKS, boot_id="boot-a")
    await rt.start()
    loop_thread = threading.get_ident()
    on_loop: list[str] = []

    def trace(sql: str) -> None:
        if threading.get_ident() == loop_thread:
            on_loop.append(sql)

    try:
        with store._lock:
            store._conn.set_trace_callback(trace)
        for n in range(5):
            rt.emit(ev("gpu_lost", R.REBOOT_NODE, subject=f"GPU-{n}"))
            rt.emit(ev("gpu_recovered", clears=("gpu_lost",), subject=f"GPU-{n}"))
            rt.emit(ev("row_remap_failure", R.HARDWARE_INSPECTION, subject=f"GPU-{n}"))
            await asyncio.sleep(0.05)
        for _ in range(200):  # read from a thread: the test must not run SQL on the loop
            if len(await asyncio.to_thread(store.items, "repairs")) == 5:
                break
            await asyncio.sleep(0.05)
        assert on_loop == []
    finally:
        with store._lock:
            store._conn.set_trace_callback(None)
        await rt.stop()
        store.close()
    reopened = StateStore.open(tmp_path / "state")
    assert {r.subject for r in RepairLedger(reopened, "boot-a").active()} == {
        f"GPU-{n}" for n in range(5)
    }
    reopened.close()


RESET_REQUIRED = (
    "NVRM: Xid (PCI:0000:3b:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 "
    "(GPU Reset Required)"
)
RECOVERED = (
    "NVRM: Xid (PCI:0000:3b:00): 154, GPU recovery action changed from 0x1 "
    "(GPU Reset Required) to 0x0 (None)"
)
IDENTITY = {
    "gpu": "0",
    "uuid": "GPU-0502fb4c-14ff-1753-75b7-804bfa7d4500",
    "pci_bus_id": "0000:3b:00.0",
    "model": "NVIDIA H200",
}


@pytest.mark.parametrize(
    ("known_at_raise", "known_at_clear"),
    [(False, True), (True, False)],
    ids=["raised-before-the-gpu-was-read", "cleared-before-the-gpu-was-read"],
)
async def test_a_gpu_named_two_ways_is_still_cleared(
    tmp_path: Path,
    executor: concurrent.futures.Executor,
    known_at_raise: bool,
    known_at_clear: bool,
) -> None:
    """A kernel-log finding names its GPU by UUID once the GPU collector has read it, by PCI
    address before (the backlog read at start, an agent restarted). The requirement an Xid
    154 raised under one name is still cleared by the Xid 154 back to None under the other."""
    h = Harness(tmp_path, FakeKmsg.with_records(capture_records()), executor)
    ledger = RepairLedger(MemoryKeyValueStore(), "boot-a")
    try:
        await h.collect()  # the capture's own records
        names: list[str] = []
        for line, known in ((RESET_REQUIRED, known_at_raise), (RECOVERED, known_at_clear)):
            if not known and names:
                await h.restart()  # a new agent: it has not read the GPU yet
            if known:
                h.shared.get(XidCorrelator, XidCorrelator).set_identity(
                    IDENTITY["pci_bus_id"], IDENTITY
                )
            h.device.write(line)
            events, _ = await h.collect()
            (xid,) = [e for e in events if e.kind == "xid"]
            names.append(xid.subject)
            ledger.apply(xid)
            if line is RESET_REQUIRED:
                assert [r.action for r in ledger.active()] == [R.RESET_GPU]
        assert len(set(names)) == 2  # the case: two names of one GPU
        assert ledger.active() == []
    finally:
        await h.collector.close()
        h.store.close()
