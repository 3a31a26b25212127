"""Which repair actions are required now: raised by events, cleared by events or a reboot.

An event with a required `repair_action` makes it active for (action, source, kind, subject);
the same again refreshes it (a file system going from low to critical). It is cleared by

- an event of the same source and subject (or another name of it: `Event.aliases`, a GPU's
  PCI address beside its UUID) that lists the kind in `clears` (`*`: every kind),
  the all-clear its collector raises (gpu_recovered, row_remap_pending_cleared, Xid 154 to
  None, filesystem_space_ok, benchmark_recovered ...);
- a reboot, for the actions a reboot performs (`RepairAction.cleared_by_reboot`): entries of
  an earlier boot are dropped when the agent starts.

`restart_application` is never held: the application has already died of it, the node needs
nothing, and nothing would ever say it was done.

The ledger persists in the state store (namespace `repairs`), so an agent restart neither
forgets a requirement nor (for Slurm's `resume = "when_cleared"`) takes its end for granted.
In the runtime (`persist_on_apply=False`) what an event does to it is written in the same
transaction as the event (`changes`, computed when the event is queued): a kill between the
two would otherwise leave the event stored, its source's cursor past it, and the requirement
(or its all-clear) lost for good.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from typing import Final

import structlog

from agent.contracts.collector import KeyValueStore
from agent.contracts.errors import GpuwardenError
from agent.contracts.model import ActiveRepair, Event, RepairAction, clears_kind

log = structlog.get_logger(component="repairs")

NAMESPACE: Final = "repairs"
NOT_HELD: Final = frozenset({RepairAction.NONE, RepairAction.RESTART_APPLICATION})


class RepairLedger:
    def __init__(
        self, store: KeyValueStore, boot_id: str = "", *, persist_on_apply: bool = True
    ) -> None:
        """`persist_on_apply=False`: `apply` changes only the ledger in memory; the caller
        stores what `changes` returned for each event, with the event."""
        self._store = store
        self._boot = boot_id
        self._persist = persist_on_apply
        self._active: dict[str, ActiveRepair] = {}
        self._load()
        self._queued: dict[str, ActiveRepair] = dict(self._active)
        """The ledger once every event handed to `changes` is applied."""

    def _load(self) -> None:
        try:
            stored = self._store.items(NAMESPACE)
        except GpuwardenError as exc:
            log.warning("repair ledger not read; starting empty", error=str(exc))
            return
        for key, value in stored.items():
            try:
                if not isinstance(value, dict):
                    raise ValueError(f"expected an object, got {type(value).__name__}")
                entry = ActiveRepair.from_dict(value)
            except (ValueError, GpuwardenError) as exc:
                log.warning("stored repair unreadable; dropped", key=key, error=str(exc))
                self._forget([key])
                continue
            if self._rebooted_since(entry):
                log.info(
                    "repair cleared by the reboot",
                    action=entry.action.value,
                    subject=entry.subject,
                    kind=entry.kind,
                )
                self._forget([key])
                continue
            self._active[entry.key] = entry

    def _rebooted_since(self, entry: ActiveRepair) -> bool:
        known = bool(self._boot and entry.boot)
        return known and entry.boot != self._boot and entry.action.cleared_by_reboot

    def changes(self, event: Event) -> dict[tuple[str, str], str | None]:
        """What `event` will do to the stored ledger once the events before it are applied:
        (namespace, key) -> the entry as JSON text, or None for a removal. Called for every
        event, in the order they will be applied."""
        out: dict[tuple[str, str], str | None] = {}
        for key in _cleared(self._queued, event):
            del self._queued[key]
            out[(NAMESPACE, key)] = None
        if event.repair_action not in NOT_HELD:
            entry = self._entry(event, self._queued)
            self._queued[entry.key] = entry
            out[(NAMESPACE, entry.key)] = json.dumps(entry.to_dict())
        return out

    def active(self) -> list[ActiveRepair]:
        return sorted(self._active.values(), key=lambda e: (e.since, e.key))

    def apply(self, event: Event) -> bool:
        """Take in one event; True when the active set changed."""
        gone = _cleared(self._active, event)
        for key in gone:
            del self._active[key]
        if self._persist:
            self._forget(gone)
        changed = bool(gone)
        if event.repair_action not in NOT_HELD:
            changed = self._raise(event) or changed
        return changed

    def after(self, events: Iterable[Event]) -> list[ActiveRepair]:
        """What `active()` will be once `events` (emitted, not yet taken in) are: nothing
        is changed or stored."""
        active = dict(self._active)
        for event in events:
            for key in _cleared(active, event):
                del active[key]
            if event.repair_action not in NOT_HELD:
                entry = self._entry(event, active)
                active[entry.key] = entry
        return sorted(active.values(), key=lambda e: (e.since, e.key))

    def _entry(self, event: Event, active: dict[str, ActiveRepair]) -> ActiveRepair:
        fault = event.attributes.get("fault")
        entry = ActiveRepair(
            action=event.repair_action,
            source=event.source,
            kind=event.kind,
            subject=event.subject,
            severity=event.severity,
            since=event.time,
            event_id=event.id,
            message=event.message,
            fault=fault if isinstance(fault, str) else "",
            boot=self._boot,
            aliases=event.aliases,
        )
        old = active.get(entry.key)
        if old is not None:  # refreshed: keep when it began, take the latest words
            aliases = tuple(sorted({*old.aliases, *entry.aliases} - {entry.subject}))
            entry = dataclasses.replace(entry, since=old.since, aliases=aliases)
        return entry

    def _raise(self, event: Event) -> bool:
        entry = self._entry(event, self._active)
        old = self._active.get(entry.key)
        self._active[entry.key] = entry
        if not self._persist:
            return old is None or old.severity != entry.severity
        try:
            self._store.put(NAMESPACE, entry.key, entry.to_dict())
        except GpuwardenError as exc:  # held in memory all the same
            log.warning("repair not stored", key=entry.key, error=str(exc))
        return old is None or old.severity != entry.severity

    def _forget(self, keys: Iterable[str]) -> None:
        for key in keys:
            try:
                self._store.delete(NAMESPACE, key)
            except GpuwardenError as exc:
                log.warning("cleared repair not removed from the store", key=key, error=str(exc))


def _cleared(active: dict[str, ActiveRepair], event: Event) -> list[str]:
    """The keys of `active` that `event` clears."""
    if not event.clears:
        return []
    names = {event.subject, *event.aliases}
    return [
        key
        for key, entry in active.items()
        if entry.source == event.source
        and not names.isdisjoint(entry.names)
        and clears_kind(event.clears, entry.kind)
    ]
