"""An Xid that two reboots did not cure is counted per GPU whatever name each sighting had.

A GPU is named by its UUID once NVML has read it, by its PCI address before that: an Xid logged
at boot, read from the kernel log's backlog before the GPU collector's first round, is named by
the address alone. The class under test: over three boots, each sighting of the same GPU and
code named by its UUID, by its address and then identified in the same boot, or by its address
in a boot where the GPU was never identified, the third boot says `hardware_inspection`
exactly once (at first sight, or once the GPU is identified) whenever the three boots are the
same GPU's as far as the agent can know, and never earlier; a GPU swapped into the slot does not
inherit the old one's boots.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import pynvml
import pytest

from agent.contracts.collector import MemoryKeyValueStore
from agent.contracts.model import Event, RepairAction
from agent.program import config_file as config
from agent.program import registry
from agent.runtime.core import Runtime
from agent.runtime.repairs import RepairLedger
from agent.runtime.state import StateStore
from collectors._nvml import NvmlBackend
from collectors._repair import NAMESPACE, RECURRED, XidRecurrence
from collectors._xid import XidCorrelator, XidObservation
from collectors.gpu.collector import GpuSettings
from collectors.kernel_log.collector import KernelLogSettings
from tests.support.kmsg import FakeKmsg, capture_records, kernel_log_spec, write_boot_id
from tests.support.nvml import fake_gpus
from tests.support.nvml_fake import FakeNvml
from tests.support.waiting import announced, until

R = RepairAction
PCI = "0000:3b:00.0"
Naming = Literal["uuid", "pci_identified", "pci_never_identified"]
NAMINGS: tuple[Naming, ...] = ("uuid", "pci_identified", "pci_never_identified")
XID79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus."


def labels(uuid: str) -> dict[str, str]:
    return {"gpu": "0", "uuid": uuid, "pci_bus_id": PCI, "model": "NVIDIA H200"}


def boot(
    store: MemoryKeyValueStore, boot_id: str, naming: Naming, uuid: str = "GPU-a"
) -> list[Event]:
    """One boot of the agent: a fresh process (correlator and recurrence) on the same store,
    an Xid 79 (reboot_node) on the GPU at PCI named as `naming` says. The events it raises."""
    recurrence = XidRecurrence(store, functools.partial(str, boot_id))
    recurrence.load()
    correlator = XidCorrelator(window=5.0, holdoff=0.0)
    events: list[Event] = []

    def identify() -> None:
        correlator.set_identity(PCI, labels(uuid))
        events.extend(recurrence.learn(PCI, labels(uuid)))

    if naming == "uuid":
        identify()
    observed = correlator.observe(
        XidObservation(
            "kmsg",
            PCI,
            79,
            1000.0,
            text=XID79,
            predates_agent=naming != "uuid",
            origin=("node-a", f"kmsg:{boot_id}", "17"),
        )
    )
    assert observed is not None
    assert observed.subject == (uuid if naming == "uuid" else PCI)
    events.append(recurrence.escalate(observed))
    if naming == "pci_identified":
        identify()
    return events


def inspections(events: Sequence[Event]) -> list[Event]:
    return [e for e in events if e.repair_action is R.HARDWARE_INSPECTION]


def same_gpu_as_far_as_known(namings: Sequence[Naming]) -> bool:
    """The agent can tie the three boots to one GPU: the third boot's GPU was identified (the
    boots it was never identified in were its slot's), or none of them was."""
    return namings[-1] != "pci_never_identified" or set(namings) == {"pci_never_identified"}


@pytest.mark.parametrize("namings", list(itertools.product(NAMINGS, repeat=3)), ids="-".join)
def test_the_third_boot_needs_inspection_whatever_each_sighting_was_named(
    namings: tuple[Naming, Naming, Naming],
) -> None:
    store = MemoryKeyValueStore()
    per_boot = [boot(store, f"boot-{n}", naming) for n, naming in enumerate(namings)]
    assert inspections(per_boot[0]) == [] and inspections(per_boot[1]) == []
    raised = inspections(per_boot[2])
    if not same_gpu_as_far_as_known(namings):
        assert raised == []
        return
    assert len(raised) == 1, [(e.kind, e.repair_action.value) for e in per_boot[2]]
    (inspection,) = raised
    assert inspection.attributes["boots_seen"] == 3
    assert inspection.attributes["escalated_from"] == R.REBOOT_NODE.value
    assert inspection.attributes["xid"] == 79
    # At first sight where its name alone tells (its UUID, or a slot whose GPU was never
    # identified in any boot); otherwise once the GPU is identified, after that event went out.
    late = namings[-1] == "pci_identified" and namings[:2].count("pci_never_identified") < 2
    assert inspection.kind == (RECURRED if late else "xid")
    if late:  # it names the event it escalates, and keeps that event's advice
        (first,) = [e for e in per_boot[2] if e.kind == "xid"]
        assert inspection.attributes["escalates"] == first.id
        assert inspection.action.endswith(first.action)
    assert inspection.subject == ("GPU-a" if late or namings[-1] == "uuid" else PCI)
    # Held in the ledger until cleared under either of the GPU's names.
    for name in ("GPU-a", PCI):
        ledger = RepairLedger(MemoryKeyValueStore(), "boot-2")
        for event in per_boot[2]:
            ledger.apply(event)
        assert {(r.action, r.subject) for r in ledger.active()} >= {
            (R.HARDWARE_INSPECTION, inspection.subject)
        }
        aliases = (PCI,) if name != PCI else ()  # as the GPU's events name it once identified
        ledger.apply(
            Event(
                "gpu",
                "xid",
                inspection.severity,
                "ok",
                subject=name,
                aliases=aliases,
                clears=("*",),
            )
        )
        assert [r for r in ledger.active() if r.action is R.HARDWARE_INSPECTION] == []


def test_a_gpu_swapped_into_the_slot_starts_its_own_count() -> None:
    store = MemoryKeyValueStore()
    boot(store, "boot-0", "uuid", uuid="GPU-old")
    boot(store, "boot-1", "pci_identified", uuid="GPU-old")
    for naming in NAMINGS[:2]:  # the new GPU, identified: the old one's boots are not its own
        fresh = MemoryKeyValueStore()
        for key, value in store.items(NAMESPACE).items():
            fresh.put(NAMESPACE, key, value)
        assert inspections(boot(fresh, "boot-2", naming, uuid="GPU-new")) == []


def test_identified_again_in_the_same_boot_raises_nothing_more() -> None:
    """A restart in the third boot (the backlog read again), or the identity read again."""
    store = MemoryKeyValueStore()
    boot(store, "boot-0", "uuid")
    boot(store, "boot-1", "uuid")
    first = boot(store, "boot-2", "pci_identified")
    again = boot(store, "boot-2", "pci_identified")
    assert [e.kind for e in inspections(first)] == [RECURRED]
    (late,) = inspections(first)
    assert [e.id for e in inspections(again)] == [late.id]  # the same event: stored once
    recurrence = XidRecurrence(store, functools.partial(str, "boot-2"))
    recurrence.load()
    assert recurrence.learn(PCI, labels("GPU-a")) == []


class Agent:
    """The runtime with the real gpu collector on the fake NVML and the real kernel_log
    collector on a /dev/kmsg stand-in, on one state directory across boots."""

    def __init__(self, tmp_path: Path, boot_id: str, nvml_up: bool) -> None:
        self.kmsg = FakeKmsg.with_records(capture_records())
        self.nvml = FakeNvml(
            fake_gpus(1), init_error=None if nvml_up else pynvml.NVML_ERROR_DRIVER_NOT_LOADED
        )
        cfg = config.parse({"prometheus": {"enabled": False}, "state_dir": str(tmp_path)})
        kernel = KernelLogSettings(
            interval=0.1,
            path=Path("/dev/kmsg"),
            boot_id_path=write_boot_id(tmp_path / "boot_id", boot_id),
            repeat_holdoff=0.0,
        )
        gpu = GpuSettings(
            interval=0.1, event_thread=False, nvml_retry_interval=0.1, sysfs_root="/nonexistent"
        )
        cfg = dataclasses.replace(cfg, collectors={"gpu": gpu, "kernel_log": kernel})
        kmsg = self.kmsg
        spec = kernel_log_spec(kmsg)
        self.runtime = Runtime(
            cfg,
            StateStore.open(tmp_path / "state"),
            collectors={**registry.COLLECTORS, "kernel_log": spec},
            sinks=registry.SINKS,
            boot_id=boot_id,
        )
        self.runtime.shared.put(NvmlBackend, NvmlBackend(self.nvml))
        # The GPU collector reads this host's boot id from /proc: the test's boots are its own.
        self.runtime.shared.put(
            XidRecurrence, XidRecurrence(self.runtime.state, functools.partial(str, boot_id))
        )


def gpu_up(runtime: Runtime) -> bool:
    return any(s.family.name == "gpuwarden_gpu_up" and s.value == 1 for s in runtime.samples())


async def test_the_agent_escalates_once_the_gpu_named_by_its_address_is_identified(
    tmp_path: Path,
) -> None:
    """Boot 1 reads the Xid live, the GPU identified; boots 2 and 3 read it at start, before
    NVML comes up (the driver still loading). Before, boot 3 counted one boot under the
    address and two under the UUID, and never escalated."""
    namings: tuple[Naming, ...] = ("uuid", "pci_identified", "pci_identified")
    for n, naming in enumerate(namings):
        await agent_boot(tmp_path, n, naming)


async def agent_boot(tmp_path: Path, n: int, naming: Naming) -> None:
    uuid = fake_gpus(1)[0].uuid
    line = "NVRM: Xid (PCI:0000:18:00): 79, pid=1, name=x, GPU has fallen off the bus."
    agent = Agent(tmp_path, f"boot-{n}", nvml_up=naming == "uuid")
    runtime = agent.runtime
    if naming != "uuid":
        agent.kmsg.write(line, level=3)  # logged before the agent started
    await runtime.start()
    try:
        if naming == "uuid":
            await until(lambda: gpu_up(runtime), what="a GPU round")
            agent.kmsg.write(line, level=3)
        (xid,) = await announced(runtime, "xid")
        assert xid.subject == (uuid if naming == "uuid" else "0000:18:00.0")
        assert xid.repair_action is R.REBOOT_NODE
        agent.nvml.init_error = None  # the driver is up: the GPU collector identifies it
        await until(lambda: gpu_up(runtime), what="the GPU read")
        if n < 2:
            assert inspections(runtime.recent_events) == []
            return
        (late,) = await announced(runtime, RECURRED)
        assert late.subject == uuid and late.repair_action is R.HARDWARE_INSPECTION
        assert late.attributes["boots_seen"] == 3
        await until(
            lambda: any(r.action is R.HARDWARE_INSPECTION for r in runtime.repairs()),
            what="the requirement held",
        )
    finally:
        await runtime.stop()
        runtime.store.close()


def test_nothing_is_moved_before_the_stored_boots_are_read() -> None:
    """The store not read yet (it stalled): moving a boot then would write the UUID's boots as
    this one alone, over the two before it. Nothing moves until they are read."""
    store = MemoryKeyValueStore()
    boot(store, "boot-0", "uuid")
    boot(store, "boot-1", "uuid")
    stored = dict(store.items(NAMESPACE))
    recurrence = XidRecurrence(store, functools.partial(str, "boot-2"))
    recurrence.load()  # the kernel log read it, in the process before this one
    correlator = XidCorrelator()
    observed = correlator.observe(
        XidObservation("kmsg", PCI, 79, 1000.0, text=XID79, predates_agent=True)
    )
    assert observed is not None
    assert recurrence.escalate(observed).repair_action is R.REBOOT_NODE
    unread = XidRecurrence(store, functools.partial(str, "boot-2"))
    assert unread.learn(PCI, labels("GPU-a")) == []
    assert store.items(NAMESPACE)["GPU-a:79"] == stored["GPU-a:79"]
    unread.load()
    (late,) = unread.learn(PCI, labels("GPU-a"))
    assert late.kind == RECURRED and late.attributes["boots_seen"] == 3
