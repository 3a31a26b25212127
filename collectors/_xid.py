"""Xid correlation: the same Xid seen by the kernel log and by NVML events is one event.

Both sources report `XidObservation`s to one shared `XidCorrelator` (through
`deps.shared.get(XidCorrelator, XidCorrelator)`). An observation waits `window` seconds for its
twin from the other source (same GPU, same code); then `drain` turns it into one event that
lists the sources that saw it. Both the gpu and the kernel_log collectors call `drain` every
round, so whichever runs first delivers the events, once.

The catalog lookup lives in collectors/_xid_catalog.py; `build_xid_event` here is the default
event builder (meaning, severity, action, which sources saw it), so the NVML side gets full
events whether or not the kernel_log collector runs. `set_builder` replaces it.
"""

from __future__ import annotations

import dataclasses
import math
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from agent.contracts.model import AttributeValue, Event
from collectors._xid_catalog import lookup_event

XidSource = Literal["kmsg", "nvml"]

_PCI = re.compile(
    r"^(?:(?P<domain>[0-9a-fA-F]{4,8}):)?(?P<bus>[0-9a-fA-F]{2}):(?P<device>[0-9a-fA-F]{2})"
    r"(?:\.(?P<function>[0-7]))?$"
)


def normalize_pci_bus_id(text: str) -> str:
    """Any PCI address form -> the Linux form `0000:3b:00.0`.

    The kernel log writes `0000:3b:00` (no function), sometimes with a `PCI:` prefix; NVML
    writes `00000000:3B:00.0` (8-digit domain, upper case). Raises ValueError on anything else.
    """
    cleaned = text.strip()
    if cleaned.upper().startswith("PCI:"):
        cleaned = cleaned[4:]
    match = _PCI.match(cleaned)
    if match is None:
        raise ValueError(f"not a PCI address: {text!r}")
    domain = int(match["domain"] or "0", 16)
    if domain > 0xFFFF:
        raise ValueError(f"PCI domain out of range: {text!r}")
    function = int(match["function"] or "0")
    return f"{domain:04x}:{match['bus'].lower()}:{match['device'].lower()}.{function}"


@dataclass(frozen=True, slots=True)
class XidObservation:
    source: XidSource
    pci_bus_id: str
    """Normalised with `normalize_pci_bus_id`."""
    code: int
    time: float
    """Seconds since the epoch (UTC) when the source saw it."""
    text: str = ""
    """The kernel-log line or NVML event description, for the event's attributes."""
    predates_agent: bool = False
    """A kernel-log record of the current boot written before the agent started."""
    details: Mapping[str, AttributeValue] = field(default_factory=dict)
    """What the source said beyond the code: the MIG `gpu_instance` and `compute_instance`
    the driver attributed the Xid to, a fallen-off-the-bus message's facts. They go into the
    event's attributes (never replacing its own)."""


@dataclass
class _Pending:
    first: XidObservation
    deadline: float
    sources: set[XidSource] = field(default_factory=set)
    texts: list[str] = field(default_factory=list)
    per_source: dict[XidSource, int] = field(default_factory=dict)
    worded: XidObservation | None = None
    """The kernel-log line whose words judge the event worst (NVML's events carry none)."""

    def keep_words(self, obs: XidObservation) -> None:
        if obs.source != "kmsg":
            return
        if self.worded is None or _severity(obs) > _severity(self.worded):
            self.worded = obs

    def shown(self) -> XidObservation:
        """The first observation, with the driver's words of the worst line, if any."""
        if self.worded is None or self.worded is self.first:
            return self.first
        return dataclasses.replace(self.first, text=self.worded.text)

    @property
    def occurrences(self) -> int:
        """Xids this entry stands for: the larger count of the two sources (the same Xid
        seen by both counts once)."""
        return max(self.per_source.values(), default=0)


def _severity(obs: XidObservation) -> int:
    return int(lookup_event(obs.code, obs.text).severity)


EventBuilder = Callable[[XidObservation, frozenset[XidSource], Mapping[str, str]], Event]
"""Turns a correlated Xid into an Event: (first observation, sources, GPU identity labels)."""

_SOURCE_NAMES: dict[str, str] = {"kmsg": "the kernel log", "nvml": "NVML"}


def seen_by(sources: frozenset[XidSource]) -> str:
    """`seen by kmsg and nvml` / `seen only by kmsg`, for messages and attributes."""
    names = sorted(sources)
    if len(names) == 1:
        return f"seen only by {names[0]}"
    return "seen by " + " and ".join(names)


def gpu_description(pci_bus_id: str, identity: Mapping[str, str]) -> str:
    if identity.get("gpu"):
        model = f"{identity['model']}, " if identity.get("model") else ""
        return f"GPU {identity['gpu']} ({model}{pci_bus_id})"
    return f"GPU {pci_bus_id or '(unknown PCI address)'}"


def mig_description(details: Mapping[str, AttributeValue]) -> str:
    """` (MIG GPU instance 2, compute instance 1)` when the driver named the instances."""
    parts = [
        f"{label} {details[key]}"
        for key, label in (
            ("gpu_instance", "GPU instance"),
            ("compute_instance", "compute instance"),
        )
        if details.get(key) is not None
    ]
    return f" (MIG {', '.join(parts)})" if parts else ""


def build_xid_event(
    obs: XidObservation, sources: frozenset[XidSource], identity: Mapping[str, str]
) -> Event:
    """The default Xid event: the catalog's meaning and action (as the line's own words
    make them), which sources saw it."""
    info = lookup_event(obs.code, obs.text)
    where = gpu_description(obs.pci_bus_id, identity)
    when = " (logged before the agent started)" if obs.predates_agent else ""
    message = (
        f"Xid {obs.code} ({info.name}) on {where}{mig_description(obs.details)}{when}: "
        f"{info.meaning}; {seen_by(sources)}"
    )
    attributes: dict[str, AttributeValue] = {
        "xid": obs.code,
        "name": info.name,
        "fault": info.fault,
        "known": info.known,
        "pci_bus_id": obs.pci_bus_id,
        "gpu": identity.get("gpu", ""),
        "uuid": identity.get("uuid", ""),
        "model": identity.get("model", ""),
        "sources": ",".join(sorted(sources)),
        "seen_by": seen_by(sources),
        "predates_agent": obs.predates_agent,
        "text": obs.text,
        **info.attributes(),
    }
    for key, value in obs.details.items():
        attributes.setdefault(key, value)
    return Event(
        source="gpu",
        kind="xid",
        severity=info.severity,
        message=message,
        subject=identity.get("uuid") or obs.pci_bus_id,
        action=info.action,
        attributes=attributes,
        time=obs.time,
    )


class XidCorrelator:
    """Thread-safe: the NVML event thread observes while the loop drains.

    An Xid waits `window` seconds after it arrived for its twin from the other source (same
    GPU, same code); repeats within the window join it. Xids that predate the agent (kernel-log
    backlog) expect no twin: they are ready at once and merge per GPU and code, so a backlog of
    500 identical lines is one event saying 500. A twin that arrives after its event went out
    (within the window of the first) is counted in `late_twins`, not raised again.
    """

    def __init__(
        self,
        window: float = 5.0,
        build_event: EventBuilder | None = None,
        clock: Callable[[], float] = time.time,
        holdoff: float = 300.0,
    ) -> None:
        self.window = window
        self.holdoff = holdoff
        """Seconds after an Xid event in which new incidents of the same GPU and code raise no
        event (an application faulting every second would raise one per window); they are
        counted, and the next event says how many were held back."""
        self._last_event: dict[tuple[str, int], float] = {}
        self._held: dict[tuple[str, int], int] = {}
        self.held_back = 0
        self._build_event: EventBuilder = build_event or build_xid_event
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, int, bool], _Pending] = {}
        self._ready: list[_Pending] = []
        self._recent: dict[tuple[str, int], tuple[float, frozenset[XidSource]]] = {}
        self._identities: dict[str, dict[str, str]] = {}
        self.counts: dict[tuple[str, int], int] = {}
        """(pci_bus_id, code) -> Xids seen since start, a twin seen by both sources once."""
        self.late_twins = 0

    def set_builder(self, build_event: EventBuilder) -> None:
        with self._lock:
            self._build_event = build_event

    def set_identity(self, pci_bus_id: str, labels: Mapping[str, str]) -> None:
        """GPU labels (gpu, uuid, pci_bus_id, model) for a PCI address, from NVML."""
        with self._lock:
            self._identities[pci_bus_id] = dict(labels)

    def identity(self, pci_bus_id: str) -> dict[str, str]:
        with self._lock:
            return dict(self._identities.get(pci_bus_id, {}))

    def identities(self) -> dict[str, dict[str, str]]:
        with self._lock:
            return {k: dict(v) for k, v in self._identities.items()}

    def observe(self, obs: XidObservation) -> None:
        """Record an Xid. Repeats within the window (either source) join the pending one."""
        key = (obs.pci_bus_id, obs.code, obs.predates_agent)
        with self._lock:
            pending = self._pending.get(key)
            if (
                pending is not None
                and not obs.predates_agent
                and (abs(obs.time - pending.first.time) > self.window)
            ):
                self._ready.append(self._pending.pop(key))  # a new incident, not a twin
                pending = None
            if pending is None:
                if self._is_late_twin(obs):
                    self.late_twins += 1
                    return
                deadline = (
                    -math.inf if obs.predates_agent else max(obs.time, self._clock()) + self.window
                )
                pending = self._pending[key] = _Pending(obs, deadline)
            pending.sources.add(obs.source)
            pending.keep_words(obs)
            pending.per_source[obs.source] = pending.per_source.get(obs.source, 0) + 1
            if obs.text and len(pending.texts) < 8:
                pending.texts.append(obs.text)

    def _is_late_twin(self, obs: XidObservation) -> bool:
        recent = self._recent.get((obs.pci_bus_id, obs.code))
        if recent is None or obs.predates_agent:
            return False
        first_time, sources = recent
        return obs.source not in sources and abs(obs.time - first_time) <= self.window

    def drain(self, now: float) -> list[Event]:
        """Events for every pending Xid whose correlation window has closed."""
        out: list[Event] = []
        with self._lock:
            ready = [k for k, p in self._pending.items() if p.deadline <= now]
            batch = self._ready + [self._pending.pop(k) for k in ready]
            self._ready = []
            for pending in batch:
                event = self._finish(pending)
                if event is not None:
                    out.append(event)
            self._recent = {k: v for k, v in self._recent.items() if now - v[0] <= 2 * self.window}
        return out

    def _finish(self, pending: _Pending) -> Event | None:
        first = pending.first
        key = (first.pci_bus_id, first.code)
        self.counts[key] = self.counts.get(key, 0) + pending.occurrences
        sources = frozenset(pending.sources)
        if first.predates_agent:
            held = 0
        else:
            self._recent[key] = (first.time, sources)
            last = self._last_event.get(key)
            if last is not None and 0 <= first.time - last < self.holdoff:
                self._held[key] = self._held.get(key, 0) + pending.occurrences
                self.held_back += 1
                return None
            self._last_event[key] = first.time
            held = self._held.pop(key, 0)
        identity = self._identities.get(first.pci_bus_id, {})
        event = self._build_event(pending.shown(), sources, identity)
        extra: dict[str, AttributeValue] = {
            "occurrences": pending.occurrences,
            "repeats_since_last_event": held,
        }
        if len(pending.texts) > 1:
            extra["texts"] = " | ".join(pending.texts)
        return dataclasses.replace(event, attributes={**event.attributes, **extra})
