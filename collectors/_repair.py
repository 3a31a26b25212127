"""From the Xid catalog's buckets to an event's repair action, and the escalation of an Xid
that a reset did not cure.

The catalog (collectors/_xid_catalog.json) gives every Xid and SXid one of a fixed set of
buckets (NVIDIA's resolution buckets in gpuwarden's words); an event carries one of the smaller
set `RepairAction` (agent/contracts/model.py), which a scheduler or a remediator acts on. Two
buckets are decided per line: NVLink5 Xids by the driver's Fatal or Nonfatal, Xid 154 by the
recovery action it names.

Escalation: an Xid whose repair is a reset or a reboot, seen again after two reboots, did not
go away with them; it becomes `hardware_inspection`. The boots each (GPU, code) was seen in are
kept in the collector's KeyValueStore, so the count survives the agent's restarts.

A GPU has two names: its UUID once NVML has read it, its PCI address before (an Xid logged at
boot and read from the kernel log before the GPU collector's first round). A boot is counted
under the UUID once the GPU at that address is identified in it (`learn`), under the address
while it is not; a sighting named by its UUID counts its address's unidentified boots too (the
slot's GPU, as far as anyone can know), one named by its address alone only those. A sighting
judged by its address before the GPU was identified may cross the line only once it is: `learn`
then raises `xid_recurred`, with the escalation the first event could not have.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from typing import Final

import structlog

from agent.contracts.collector import CollectorDeps, KeyValueStore
from agent.contracts.model import AttributeValue, Event, RepairAction, Severity, stable_event_id
from collectors._xid_catalog import (
    BUCKETS,
    NVLINK5_BUCKET,
    RECOVERY_BUCKET,
    XidInfo,
    catalog,
    lookup_event,
)

log = structlog.get_logger(component="repair")

R = RepairAction

BUCKET_REPAIR: Final[Mapping[str, RepairAction]] = {
    "ignore": R.NONE,
    "restart_application": R.RESTART_APPLICATION,
    "restart_vm": R.RESTART_VM,
    "reset_gpu": R.RESET_GPU,
    "reboot_node": R.REBOOT_NODE,
    "reset_fabric": R.RESET_FABRIC,
    "hardware_inspection": R.HARDWARE_INSPECTION,
    "check_cooling": R.CHECK_COOLING,
    "update_software": R.UPDATE_SOFTWARE,
    # A reset only where UVM or vGPU is in use: a person decides, the node is not drained.
    "check_uvm": R.INVESTIGATE,
    "contact_support": R.CONTACT_SUPPORT,
    # Xid 45 follows other errors (their own events carry the action); alone it is noise.
    "workflow_xid45": R.NONE,
    # Uncorrectable ECC: NVIDIA's workflow resets the GPU (row remapping happens on reset).
    "workflow_xid48": R.RESET_GPU,
    "workflow_nvlink": R.RESET_GPU,
    # Decided per line (repair_for): these are the readings without the driver's word.
    NVLINK5_BUCKET: R.INVESTIGATE,
    RECOVERY_BUCKET: R.INVESTIGATE,
    "not_given": R.INVESTIGATE,
}
"""Every catalog bucket's repair action (a test holds that it covers `BUCKETS`)."""

RECOVERY_REPAIR: Final[Mapping[str, RepairAction]] = {
    # the driver's NV2080_CTRL_GPU_RECOVERY_ACTION names, as in the catalog's recovery_actions
    "none": R.NONE,
    "gpu reset required": R.RESET_GPU,
    "node reboot required": R.REBOOT_NODE,
    "drain p2p": R.DRAIN_P2P,
    "drain and reset": R.DRAIN_AND_RESET,
    "recover imex domain": R.RECOVER_IMEX,
}

RECURRING_REPAIRS: Final = frozenset({R.RESET_GPU, R.DRAIN_AND_RESET, R.REBOOT_NODE})
"""Repairs a reboot performs: the same Xid after them means the hardware."""
ESCALATE_AFTER_REBOOTS: Final = 2
BOOTS_KEPT: Final = 8
NAMESPACE: Final = "xid_boots"
RECURRED: Final = "xid_recurred"
"""The escalation of a sighting named by its PCI address, once the GPU there is identified."""


def repair_for(info: XidInfo) -> RepairAction:
    """The repair action of one Xid or SXid line, as the catalog (and the line) says."""
    details = dict(info.details)
    if info.bucket == RECOVERY_BUCKET and "recovery_action" in details:
        return RECOVERY_REPAIR.get(details["recovery_action"].strip().lower(), R.INVESTIGATE)
    if info.bucket == NVLINK5_BUCKET and "driver_severity" in details:
        fatal = not details["driver_severity"].lower().startswith("non")
        return R.RESET_GPU if fatal else R.INVESTIGATE
    return BUCKET_REPAIR.get(info.bucket, R.INVESTIGATE)


def clears_for(info: XidInfo) -> tuple[str, ...]:
    """Xid 154 moving to `None`: the GPU needs no recovery any more, whatever its Xids said."""
    details = dict(info.details)
    if info.bucket == RECOVERY_BUCKET and details.get("recovery_action", "").lower() == "none":
        return ("*",)
    return ()


def check_mapping() -> None:
    """Every bucket and every recovery action of the catalog has a repair action."""
    missing = [b for b in BUCKETS if b not in BUCKET_REPAIR]
    missing += [
        a.name for a in catalog().recovery_actions.values() if a.name.lower() not in RECOVERY_REPAIR
    ]
    if missing:
        raise LookupError(f"no repair action for catalog entries: {', '.join(missing)}")


class XidRecurrence:
    """Per (GPU, code): the boots an Xid with a reset/reboot repair was seen in; from the
    third boot on (seen again after two reboots) its events say `hardware_inspection`.

    Keys are `name:code`, the name a UUID or, for boots the GPU was not identified in, a PCI
    address. Shared by the collectors that drain the Xid correlator and the one that
    identifies the GPUs (one per process). Thread-safe."""

    def __init__(self, store: KeyValueStore, boot_id: Callable[[], str]) -> None:
        self._store = store
        self._read_boot_id = boot_id
        self._boot: str | None = None
        self._lock = threading.Lock()
        self._seen_in: dict[str, list[str]] = {}
        self._identified: dict[str, str] = {}
        """PCI address -> the UUID of the GPU there, this boot (`learn`)."""
        self._judged: dict[str, Event] = {}
        """`address:code` -> the last event judged under the address alone, this process:
        what `learn` escalates (its repair, its action) if the GPU turns out to have recurred."""
        self.loaded = False
        """The stored boots are in memory (`load`): `escalate` then only writes, and a
        write to a collector's state is held in memory until the runtime stores it."""

    def load(self) -> None:
        """Read every stored (GPU, code) once (blocking: the state store). Thread-safe."""
        try:
            stored = self._store.items(NAMESPACE)
        except Exception as exc:  # escalate reads per key instead
            log.warning("Xid recurrence not read", error=str(exc))
            return
        with self._lock:
            for key, raw in stored.items():
                if isinstance(raw, list):
                    self._seen_in.setdefault(key, [b for b in raw if isinstance(b, str)])
            self.loaded = True

    def _current_boot(self) -> str | None:
        if self._boot is None:
            try:
                self._boot = self._read_boot_id()
            except Exception as exc:  # no boot id: no escalation, but the event still goes out
                log.warning("boot id unreadable; Xid recurrence not tracked", error=str(exc))
                return None
        return self._boot

    def escalate(self, event: Event) -> Event:
        if event.kind != "xid" or event.repair_action not in RECURRING_REPAIRS:
            return event
        boot = self._current_boot()
        code = event.attributes.get("xid")
        if boot is None or code is None:
            return event
        with self._lock:
            name = self._identified.get(event.subject, event.subject)
            others = [a for a in event.aliases if a != name]
            try:
                boots = self._record(f"{name}:{code}", boot)
                for alias in others:  # its address's boots no GPU was identified in
                    boots = _union(boots, self._boots(f"{alias}:{code}"))
            except Exception as exc:  # the store failing must not lose the event
                log.warning("Xid recurrence not stored", key=f"{name}:{code}", error=str(exc))
                return event
        reboots = len(boots) - 1
        attributes: dict[str, AttributeValue] = {**event.attributes, "boots_seen": len(boots)}
        if reboots < ESCALATE_AFTER_REBOOTS:
            # Named by its address alone: `learn` may escalate it once the GPU is identified.
            if not event.aliases and name == event.subject:
                with self._lock:
                    self._judged[f"{name}:{code}"] = event
            return dataclasses.replace(event, attributes=attributes)
        attributes["escalated_from"] = event.repair_action.value
        return dataclasses.replace(
            event,
            repair_action=R.HARDWARE_INSPECTION,
            action=_inspect(code, reboots, event.repair_action, event.action),
            attributes=attributes,
        )

    def learn(self, pci_bus_id: str, labels: Mapping[str, str]) -> list[Event]:
        """The GPU at `pci_bus_id` is identified this boot (labels gpu, uuid, pci_bus_id,
        model): the boots counted under its address this boot are its own. The events of
        the sightings this moves across the line (`xid_recurred`), for the caller to emit.

        Cheap when nothing changed (the identity is read again on every slow round)."""
        uuid = labels.get("uuid", "")
        if not self.loaded:  # the boots before this one unknown: tried again on the next read
            return []
        boot = self._current_boot()
        if not uuid or not pci_bus_id or uuid == pci_bus_id or boot is None:
            return []
        events: list[Event] = []
        with self._lock:
            if self._identified.get(pci_bus_id) == uuid:
                return []
            self._identified[pci_bus_id] = uuid
            prefix = f"{pci_bus_id}:"
            for key in [k for k, boots in self._seen_in.items() if k.startswith(prefix)]:
                boots = self._seen_in[key]
                code = key[len(prefix) :]
                if boot not in boots or not code.isdigit():
                    continue
                judged = len(boots)  # what the sighting under the address was judged by
                try:
                    self._forget(key, boot)
                    ours = self._record(f"{uuid}:{code}", boot)
                except Exception as exc:  # counted under its address, as before
                    log.warning("Xid recurrence not moved", key=key, error=str(exc))
                    continue
                total = _union(ours, self._seen_in.get(key, []))
                if judged - 1 < ESCALATE_AFTER_REBOOTS <= len(total) - 1:
                    judged_event = self._judged.pop(key, None)
                    events.append(_recurred(int(code), boot, total, labels, judged_event))
        return events

    def _boots(self, key: str) -> list[str]:
        boots = self._seen_in.get(key)
        if boots is None and not self.loaded:
            raw = self._store.get(NAMESPACE, key)
            boots = [b for b in raw if isinstance(b, str)] if isinstance(raw, list) else []
            self._seen_in[key] = boots
        return boots or []

    def _record(self, key: str, boot: str) -> list[str]:
        boots = self._boots(key)
        if boot not in boots:
            boots = [*boots, boot][-BOOTS_KEPT:]
            self._store.put(NAMESPACE, key, list(boots))
        self._seen_in[key] = boots
        return boots

    def _forget(self, key: str, boot: str) -> None:
        boots = [b for b in self._boots(key) if b != boot]
        if boots:
            self._store.put(NAMESPACE, key, boots)
        else:
            self._store.delete(NAMESPACE, key)
        self._seen_in[key] = boots


def _union(a: list[str], b: list[str]) -> list[str]:
    return [*a, *(x for x in b if x not in a)]


def _inspect(code: object, reboots: int, repair: RepairAction, then: str) -> str:
    return (
        f"Xid {code} came back after {reboots} reboots, which should have cleared it "
        f"({repair.value}): take the GPU out of service and have its hardware inspected "
        f"(NVIDIA: CHECK_MECHANICALS, then contact support)" + (f"; then: {then}" if then else "")
    )


def _recurred(
    code: int, boot: str, boots: list[str], labels: Mapping[str, str], judged: Event | None
) -> Event:
    """The escalation of an Xid first judged under its address, the GPU now identified: with
    that event's repair and action where this process judged it, else the catalog's."""
    info = lookup_event(code, "")
    pci, uuid = labels.get("pci_bus_id", ""), labels["uuid"]
    repair = judged.repair_action if judged is not None else repair_for(info)
    then = judged.action if judged is not None else ""
    where = f"GPU {labels['gpu']} ({pci})" if labels.get("gpu") else pci
    return Event(
        source="gpu",
        kind=RECURRED,
        severity=Severity.CRITICAL,
        message=f"Xid {code} ({info.name}) on {where} has now been seen in {len(boots)} boots: "
        f"the reboots did not cure it",
        subject=uuid,
        aliases=(pci,) if pci and pci != uuid else (),
        action=_inspect(code, len(boots) - 1, repair, then),
        repair_action=R.HARDWARE_INSPECTION,
        attributes={
            "xid": code,
            "name": info.name,
            "pci_bus_id": pci,
            "gpu": labels.get("gpu", ""),
            "uuid": uuid,
            "model": labels.get("model", ""),
            "boots_seen": len(boots),
            "escalated_from": repair.value,
            **({"escalates": judged.id} if judged is not None else {}),
        },
        # The same boot, GPU and code give the same id: an agent restarted in this boot that
        # raises it again raises the same event, which consumers deduplicate.
        id=stable_event_id(boot, uuid, str(code), RECURRED),
    )


def shared_recurrence(deps: CollectorDeps, boot_id: Callable[[], str]) -> XidRecurrence:
    """The process's one XidRecurrence (the collectors that drain Xids share it)."""
    return deps.shared.get(XidRecurrence, lambda: XidRecurrence(deps.state, boot_id))
