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
from collections.abc import Mapping, Sequence
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
    """

    source: str
    kind: str
    severity: Severity
    message: str
    subject: str = ""
    action: str = ""
    attributes: Mapping[str, AttributeValue] = field(default_factory=dict)
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

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "time": self.time,
            "node": self.node,
            "source": self.source,
            "kind": self.kind,
            "severity": self.severity.label,
            "subject": self.subject,
            "message": self.message,
            "action": self.action,
            "attributes": dict(self.attributes),
        }

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
                attributes=dict(attributes),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelError(f"not an event: {exc}") from exc


@dataclass(frozen=True, slots=True)
class Collection:
    """What one collector run produced."""

    samples: Sequence[Sample] = ()
    events: Sequence[Event] = ()


GPU_LABELS: Final = ("gpu", "uuid", "pci_bus_id", "model")
"""Every per-GPU series carries at least these labels (docs/ARCHITECTURE.md, metrics contract)."""
