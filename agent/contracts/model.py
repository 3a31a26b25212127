"""The data model every collector and exporter speaks: metric families, samples and events.

Collectors declare their metric families up front (so HELP/TYPE are right and every name can be
linted), produce `Sample`s of those families and `Event`s for things that happened. Exporters
render them. Nothing here knows hardware or protocols.
"""

from __future__ import annotations

import enum
import json
import math
import re
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from agent.contracts.errors import ModelError

METRIC_PREFIX: Final = "gpuwarden_"

_METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

AttributeValue = str | int | float | bool | None


class Severity(enum.IntEnum):
    """How bad an event is. Ordered, so `max()` gives the worst of several."""

    INFO = 0
    WARNING = 1
    CRITICAL = 2
    FATAL = 3

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> Severity:
        try:
            return cls[text.strip().upper()]
        except KeyError:
            names = ", ".join(s.label for s in cls)
            raise ModelError(f"unknown severity {text!r}; expected one of {names}") from None


class RepairAction(enum.StrEnum):
    """What must be done about an event, as data: a small fixed set that a scheduler, a pager
    or a remediator can act on. It follows NVIDIA's Xid catalog resolution buckets
    (collectors/_xid_catalog.json, `buckets`) and its GPU recovery actions (Xid 154), plus the
    few the host collectors need; `action` is the same advice for a person. docs/actions.md,
    "Repair actions as data", says which bucket maps to which value.

    `none` is no requirement (an all-clear, an observation). Every other value is required
    until cleared (agent/runtime/repairs.py)."""

    NONE = "none"
    RESTART_APPLICATION = "restart_application"
    RESTART_VM = "restart_vm"
    RESET_GPU = "reset_gpu"
    DRAIN_AND_RESET = "drain_and_reset"
    DRAIN_P2P = "drain_p2p"
    RECOVER_IMEX = "recover_imex"
    REBOOT_NODE = "reboot_node"
    RESET_FABRIC = "reset_fabric"
    HARDWARE_INSPECTION = "hardware_inspection"
    CHECK_COOLING = "check_cooling"
    CHECK_STORAGE = "check_storage"
    UPDATE_SOFTWARE = "update_software"
    CONTACT_SUPPORT = "contact_support"
    INVESTIGATE = "investigate"
    """Look at it: no published remedy (a code without guidance, a stuck process, the agent's
    own delivery or collection failing)."""

    @property
    def required(self) -> bool:
        return self is not RepairAction.NONE

    @property
    def cleared_by_reboot(self) -> bool:
        """A restart of the node performs this action (a reboot resets every GPU and the
        fabric and restarts every application); inspection, support, storage and software
        outlive it."""
        return self in _CLEARED_BY_REBOOT

    @classmethod
    def parse(cls, text: str) -> RepairAction:
        try:
            return cls(text.strip().lower())
        except ValueError:
            names = ", ".join(a.value for a in cls)
            raise ModelError(f"unknown repair action {text!r}; expected one of {names}") from None


_CLEARED_BY_REBOOT: Final = frozenset(
    {
        RepairAction.RESTART_APPLICATION,
        RepairAction.RESTART_VM,
        RepairAction.RESET_GPU,
        RepairAction.DRAIN_AND_RESET,
        RepairAction.DRAIN_P2P,
        RepairAction.RECOVER_IMEX,
        RepairAction.REBOOT_NODE,
        RepairAction.RESET_FABRIC,
    }
)

CLEARS_ALL: Final = "*"
"""In `Event.clears`: every requirement on the event's subject from the event's source."""


def clears_kind(clears: Iterable[str], kind: str) -> bool:
    """Whether `clears` (an event's or a kernel-log finding's) ends what `kind` raised."""
    return any(name in (kind, CLEARS_ALL) for name in clears)


class MetricType(enum.StrEnum):
    GAUGE = "gauge"
    COUNTER = "counter"


@dataclass(frozen=True, slots=True)
class MetricFamily:
    """A metric declared by a collector before it produces any sample of it.

    `name` is the full exposition name (with the project prefix, and `_total` for counters).
    `unit` is informational (the base unit is already in the name, as Prometheus asks).
    """

    name: str
    type: MetricType
    help: str
    labels: tuple[str, ...] = ()
    unit: str = ""

    def __post_init__(self) -> None:
        if not _METRIC_NAME.match(self.name):
            raise ModelError(f"metric name {self.name!r} is not a valid Prometheus name")
        if not self.name.startswith(METRIC_PREFIX):
            raise ModelError(f"metric name {self.name!r} must start with {METRIC_PREFIX!r}")
        if self.type is MetricType.COUNTER and not self.name.endswith("_total"):
            raise ModelError(f"counter {self.name!r} must end with '_total'")
        if self.type is MetricType.GAUGE and self.name.endswith("_total"):
            raise ModelError(f"gauge {self.name!r} must not end with '_total'")
        if not self.help.strip():
            raise ModelError(f"metric {self.name!r} needs a help text")
        if len(set(self.labels)) != len(self.labels):
            raise ModelError(f"metric {self.name!r} repeats a label name: {self.labels}")
        for label in self.labels:
            if not _LABEL_NAME.match(label) or label.startswith("__"):
                raise ModelError(f"metric {self.name!r}: invalid label name {label!r}")

    def sample(self, value: float, *label_values: str) -> Sample:
        """A sample of this family; label values in the order of `labels`."""
        return Sample(self, tuple(label_values), float(value))

    def sample_map(self, value: float, labels: Mapping[str, str]) -> Sample:
        """A sample of this family with labels given by name (every declared label required)."""
        missing = [name for name in self.labels if name not in labels]
        extra = [name for name in labels if name not in self.labels]
        if missing or extra:
            raise ModelError(f"metric {self.name!r}: labels missing {missing} / unexpected {extra}")
        return Sample(self, tuple(labels[name] for name in self.labels), float(value))


@dataclass(frozen=True, slots=True)
class Sample:
    """The current value of one series. NaN is not a value: absent readings produce no sample."""

    family: MetricFamily
    label_values: tuple[str, ...]
    value: float

    def __post_init__(self) -> None:
        if len(self.label_values) != len(self.family.labels):
            raise ModelError(
                f"metric {self.family.name!r} has labels {self.family.labels}, "
                f"got {len(self.label_values)} values"
            )
        if math.isnan(self.value):
            raise ModelError(
                f"metric {self.family.name!r}: NaN is not a reading; leave the sample out"
            )

    @property
    def labels(self) -> dict[str, str]:
        return dict(zip(self.family.labels, self.label_values, strict=True))


def new_event_id() -> str:
    """A unique, stable event id: assigned once at creation and kept across retries."""
    return uuid.uuid4().hex


_EVENT_ID_NAMESPACE: Final = uuid.UUID("6f1c2d4e-8a3b-5c7d-9e0f-1a2b3c4d5e6f")


def stable_event_id(*origin: str) -> str:
    """An event id derived from where the event was found (node, boot id and kernel-log
    sequence number, a file's inode and line): an event made again from the same record
    after a crash gets the same id, which consumers already deduplicate on."""
    return uuid.uuid5(_EVENT_ID_NAMESPACE, "\x1f".join(origin)).hex


@dataclass(frozen=True, slots=True)
class Event:
    """Something that happened. Durable: stored before any sink is told about it.

    `time` is seconds since the epoch (UTC). `node` is filled in by the runtime if the
    collector leaves it empty. `subject` names what the event is about: a GPU UUID or PCI bus
    id, a mount point, a pid, a sink.

    `repair_action` is what must be done, as data; `action` says it to a person. An event
    with a required repair action makes it active for (source, kind, subject) until an event
    of the same source and subject lists that kind in `clears` (or `CLEARS_ALL`), or a reboot
    performs it (agent/runtime/repairs.py). `aliases` are other names of the subject (a
    GPU's PCI address beside its UUID): a finding raised under one name is cleared under
    another.
    """

    source: str
    kind: str
    severity: Severity
    message: str
    subject: str = ""
    action: str = ""
    repair_action: RepairAction = RepairAction.NONE
    clears: tuple[str, ...] = ()
    attributes: Mapping[str, AttributeValue] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()
    node: str = ""
    time: float = field(default_factory=time.time)
    id: str = field(default_factory=new_event_id)

    def __post_init__(self) -> None:
        if not self.source or not self.kind:
            raise ModelError("an event needs a source and a kind")
        if not self.message.strip():
            raise ModelError(f"event {self.source}/{self.kind} needs a message")
        if not isinstance(self.severity, Severity):
            raise ModelError(f"event severity must be a Severity, got {self.severity!r}")
        if not isinstance(self.repair_action, RepairAction):
            raise ModelError(
                f"event repair_action must be a RepairAction, got {self.repair_action!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        data = {
            "id": self.id,
            "time": self.time,
            "node": self.node,
            "source": self.source,
            "kind": self.kind,
            "severity": self.severity.label,
            "subject": self.subject,
            "message": self.message,
            "action": self.action,
            "repair_action": self.repair_action.value,
            "clears": list(self.clears),
            "attributes": dict(self.attributes),
        }
        if self.aliases:  # absent for most events, and from older agents
            data["aliases"] = list(self.aliases)
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Event:
        try:
            attributes = data.get("attributes") or {}
            if not isinstance(attributes, Mapping):
                raise ModelError("attributes must be an object")
            return cls(
                id=str(data["id"]),
                time=float(data["time"]),
                node=str(data.get("node", "")),
                source=str(data["source"]),
                kind=str(data["kind"]),
                severity=Severity.parse(str(data["severity"])),
                subject=str(data.get("subject", "")),
                message=str(data["message"]),
                action=str(data.get("action", "")),
                # Payloads and stored events from before repair actions have neither key.
                repair_action=RepairAction.parse(str(data.get("repair_action") or "none")),
                clears=_clears(data.get("clears")),
                attributes=dict(attributes),
                aliases=_names(data.get("aliases"), "aliases"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelError(f"not an event: {exc}") from exc


def _clears(value: Any) -> tuple[str, ...]:
    return _names(value, "clears", "a list of event kinds")


def _names(value: Any, key: str, what: str = "a list of strings") -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ModelError(f"{key} must be {what}")
    return tuple(value)


@dataclass(frozen=True, slots=True)
class ActiveRepair:
    """A repair action required and not yet cleared: what the repair gauge shows, what an
    action (a Slurm drain) acts on, and what clears again (agent/runtime/repairs.py)."""

    action: RepairAction
    source: str
    kind: str
    subject: str
    severity: Severity
    since: float
    """When the requirement was first raised (seconds since the epoch)."""
    event_id: str
    """The event that raised it last."""
    message: str
    fault: str = ""
    """The catalog's `fault` for an Xid (application, node, either, unknown); empty otherwise."""
    boot: str = ""
    """The boot it was raised in (a reboot performs some actions, and so clears them)."""
    aliases: tuple[str, ...] = ()
    """Other names of the subject, from the event (`Event.aliases`)."""

    @property
    def names(self) -> frozenset[str]:
        """Every name its subject goes by."""
        return frozenset((self.subject, *self.aliases))

    @property
    def key(self) -> str:
        return "\x1f".join((self.action.value, self.source, self.kind, self.subject))

    def to_dict(self) -> dict[str, Any]:
        return {
            "action": self.action.value,
            "source": self.source,
            "kind": self.kind,
            "subject": self.subject,
            "severity": self.severity.label,
            "since": self.since,
            "event_id": self.event_id,
            "message": self.message,
            "fault": self.fault,
            "boot": self.boot,
            "aliases": list(self.aliases),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ActiveRepair:
        try:
            return cls(
                action=RepairAction.parse(str(data["action"])),
                source=str(data["source"]),
                kind=str(data["kind"]),
                subject=str(data["subject"]),
                severity=Severity.parse(str(data["severity"])),
                since=float(data["since"]),
                event_id=str(data["event_id"]),
                message=str(data["message"]),
                fault=str(data.get("fault", "")),
                boot=str(data.get("boot", "")),
                aliases=_names(data.get("aliases"), "aliases"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelError(f"not an active repair: {exc}") from exc


@dataclass(frozen=True, slots=True)
class Collection:
    """What one collector run produced."""

    samples: Sequence[Sample] = ()
    events: Sequence[Event] = ()


GPU_LABELS: Final = ("gpu", "uuid", "pci_bus_id", "model")
"""Every per-GPU series carries at least these labels (docs/ARCHITECTURE.md, metrics contract)."""
