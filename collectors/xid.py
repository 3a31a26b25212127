"""Xid correlation: the same Xid seen by the kernel log and by NVML events is one event.

Both sources report `XidObservation`s to one shared `XidCorrelator` (through
`deps.shared.get(XidCorrelator, XidCorrelator)`). An observation waits `window` seconds for its
twin from the other source (same GPU, same code); then `drain` turns it into one event that
lists the sources that saw it. Both the gpu and the kernel_log collectors call `drain` every
round, so whichever runs first delivers the events, once.

The catalog lookup and the event text live in the kernel-log work (collectors/xid_catalog.py);
this module is the meeting point of the two sources.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from agent.model import Event

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


@dataclass
class _Pending:
    first: XidObservation
    sources: set[XidSource] = field(default_factory=set)
    texts: list[str] = field(default_factory=list)
    occurrences: int = 0


EventBuilder = Callable[[XidObservation, frozenset[XidSource], Mapping[str, str]], Event]
"""Turns a correlated Xid into an Event: (first observation, sources, GPU identity labels)."""


class XidCorrelator:
    """Thread-safe: the NVML event thread observes while the loop drains."""

    def __init__(self, window: float = 5.0, build_event: EventBuilder | None = None) -> None:
        self.window = window
        self._build_event = build_event
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, int], _Pending] = {}
        self._identities: dict[str, dict[str, str]] = {}
        self.counts: dict[tuple[str, int], int] = {}
        """(pci_bus_id, code) -> Xids seen since start, counted once per correlated event."""

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

    def observe(self, obs: XidObservation) -> None:
        """Record an Xid. Repeats within the window (either source) join the pending one."""
        key = (obs.pci_bus_id, obs.code)
        with self._lock:
            pending = self._pending.setdefault(key, _Pending(obs))
            pending.sources.add(obs.source)
            pending.occurrences += 1
            if obs.text and len(pending.texts) < 8:
                pending.texts.append(obs.text)

    def drain(self, now: float) -> list[Event]:
        """Events for every pending Xid whose correlation window has closed."""
        out: list[Event] = []
        with self._lock:
            ready = [k for k, p in self._pending.items() if now - p.first.time >= self.window]
            builder = self._build_event
            for key in ready:
                pending = self._pending.pop(key)
                self.counts[key] = self.counts.get(key, 0) + 1
                if builder is not None:
                    identity = self._identities.get(key[0], {})
                    out.append(builder(pending.first, frozenset(pending.sources), identity))
        return out
