"""A GPU's findings answer to both of its names: its UUID, and its PCI address.

The class under test: every event the gpu collector raises about an identified GPU (in its
rounds, and from the NVML event thread) names it by its UUID and carries its PCI address as an
alias, so that what is raised under one name is cleared under the other: a kernel-log Xid 154
that the GPU needs no recovery any more (named by the address before the GPU is read), or
`gpuwarden repairs clear --subject 0000:18:00.0` with the address nvidia-smi shows.
"""

from __future__ import annotations

import threading

import pynvml

from agent.contracts.collector import MemoryKeyValueStore
from agent.contracts.model import Event, RepairAction, Severity
from agent.runtime.repairs import RepairLedger
from collectors.gpu.collector import GpuSettings
from tests.support.nvml import GpuRig, fake_gpus
from tests.support.nvml_fake import FakeNvml
from tests.support.waiting import until

UNCORRECTED_VOLATILE = (
    pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
    pynvml.NVML_VOLATILE_ECC,
)


async def faults(rig: GpuRig) -> list[Event]:
    """Every fault of an identified GPU the fake can script, raised and ended."""
    events: list[Event] = []

    async def collect() -> None:
        events.extend((await rig.collect()).events)

    gpu, other = rig.fake.gpus
    await collect()
    gpu.ecc[UNCORRECTED_VOLATILE] = 2
    gpu.remapped_rows = (0, 0, 1, 0)
    other.pcie_width = (8, 16)
    rig.now += rig.collector.settings.slow_interval  # the link width is a slow read
    await collect()
    gpu.remapped_rows = (0, 0, 0, 1)
    other.pcie_width = (16, 16)
    rig.now += rig.collector.settings.slow_interval
    await collect()
    other.lost = True
    await collect()
    other.lost = False
    await collect()
    release = threading.Event()
    gpu.hang = release
    await collect()
    gpu.hang = None
    release.set()
    await until(lambda: "nvml:gpu0" not in rig.caller.hung, 5, "the hung call to return")
    await collect()
    return events


async def test_every_finding_of_an_identified_gpu_carries_its_address() -> None:
    rig = GpuRig(FakeNvml(fake_gpus(2)), timeout=0.3)
    try:
        events = await faults(rig)
    finally:
        await rig.close()
    identities = rig.correlator.identities()
    address = {labels["uuid"]: pci for pci, labels in identities.items()}
    about_gpus = [e for e in events if e.subject in address]
    raised = {e.kind for e in about_gpus}
    assert {
        "ecc_uncorrected_volatile_increase",
        "row_remap_pending",
        "row_remap_failure",
        "pcie_link_degraded",
        "pcie_link_degraded_cleared",
        "gpu_lost",
        "gpu_recovered",
        "gpu_unresponsive",
    } <= raised, raised
    assert [(e.kind, e.aliases) for e in about_gpus if e.aliases != (address[e.subject],)] == []

    ledger = RepairLedger(MemoryKeyValueStore(), "boot-a")
    for event in about_gpus:
        ledger.apply(event)
    held = {r.subject for r in ledger.active()}
    assert held, "the faults hold some repair"
    for uuid in held:  # cleared under the address alone, as an Xid read at boot names it
        ledger.apply(Event("gpu", "xid", Severity.INFO, "ok", subject=address[uuid], clears=("*",)))
    assert ledger.active() == []


async def test_the_nvml_event_threads_findings_carry_it_too() -> None:
    fake = FakeNvml(fake_gpus(1))
    rig = GpuRig(fake, settings=GpuSettings(event_thread=True, event_wait_ms=50))
    try:
        await rig.collect()
        await rig.collect()
        fake.push_event(fake.gpus[0], pynvml.nvmlEventTypeDoubleBitEccError)
        await until(lambda: bool(rig.emitted), 10, "the event thread's event")
    finally:
        await rig.close()
    (event,) = [e for e in rig.emitted if e.repair_action is RepairAction.RESET_GPU]
    (pci,) = rig.correlator.identities()
    assert event.subject == fake.gpus[0].uuid
    assert event.aliases == (pci,)
