"""Xid correlation: the same Xid seen by the kernel log and by NVML events is one event.

Both sources report `XidObservation`s to one shared `XidCorrelator` (through
`deps.shared.get(XidCorrelator, XidCorrelator)`). The first source to see an Xid raises its
event at once: `observe` returns it, and the caller hands it on in the same step (the
kernel_log collector in the round that stores its cursor, the NVML thread through `emit`).
Nothing waits in memory for a twin, so no unclean death can lose an Xid that was read.
The other source's sighting within `window` seconds (same GPU, same code) is a follow-up
event `xid_confirmed` that names the first event's id (`confirms`) and is counted; it is
never a second alert. Where the driver's words make the Xid worse than the first event
said (NVLink5 `Fatal`, Xid 154 to a reset), the follow-up is `xid_escalated`, at the worse
severity.

The correlation outlives the process: `shared_correlator` seeds the correlator once per
process with the Xid events the state store holds from its last life on this boot
(`CollectorDeps.stored_events`), so that a kernel-log line read again after a crash confirms
the event NVML raised before it, instead of raising a second one.

The Xid counters (`gpuwarden_xid_errors_total`, `gpuwarden_xid_confirmed_total`) are the
correlator's own series (`SharedSeries`): the runtime renders them once, live, while either
source's collector is attached (`attach` at construction, `detach` at close), so that neither
collector exports them (two would make each series twice, one alone has none where only the
other runs), and a failed round or a reload of either takes nothing away.

The catalog lookup lives in collectors/_xid_catalog.py; `build_xid_event` here is the default
event builder (meaning, severity, action, which sources saw it), so the NVML side gets full
events whether or not the kernel_log collector runs. `set_builder` replaces it.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from agent.contracts.collector import CollectorDeps, JSONValue
from agent.contracts.model import (
    GPU_LABELS,
    AttributeValue,
    Event,
    MetricFamily,
    MetricType,
    RepairAction,
    Sample,
    Severity,
    stable_event_id,
)
from collectors._repair import clears_for, repair_for
from collectors._xid_catalog import lookup_event

XidSource = Literal["kmsg", "nvml"]

_PCI = re.compile(
    r"^(?:(?P<domain>[0-9a-fA-F]{4,8}):)?(?P<bus>[0-9a-fA-F]{2}):(?P<device>[0-9a-fA-F]{2})"
    r"(?:\.(?P<function>[0-7]))?$"
)


def normalize_pci_bus_id(text: str) -> str:
    """Any PCI address form -> the Linux form `0000:3b:00.0`.

    The kernel log writes `0000:3b:00` (no function), sometimes with a `PCI:` prefix; NVML
    writes `00000000:3B:00.0` (8-digit domain, upper case). A domain may be wider than 16 bits
    (Intel VMD puts its devices in domains from 0x10000; Hyper-V's pci-hyperv makes its own):
    Linux writes it with `%04x`, so `10000:01:00.0` (NVML: `00010000:01:00.0`), and that is the
    form returned. Raises ValueError on anything else.
    """
    cleaned = text.strip()
    if cleaned.upper().startswith("PCI:"):
        cleaned = cleaned[4:]
    match = _PCI.match(cleaned)
    if match is None:
        raise ValueError(f"not a PCI address: {text!r}")
    domain = int(match["domain"] or "0", 16)  # at most 8 digits: 32 bits, as Linux and NVML
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
    origin: tuple[str, ...] = ()
    """Where the source saw it, stable when the same record is read again after a crash
    (node, boot id and sequence number; a file's inode and line): the event id is derived
    from it, so a re-read gives the same id. Empty: a fresh random id (NVML's events)."""


Asks = tuple[str, tuple[str, ...]]
"""What an Xid line asks: its repair action and the kinds it clears."""


def _asks(obs: XidObservation) -> Asks:
    """What the sighting's event asks: the code's, with the driver's words where it has them.

    Lines of one GPU and code that ask differently are not repeats of each other: Xid 154
    names the recovery action it moved to, and its move back to None is the all-clear of
    the one before; NVLink5's Xid 149 says Fatal or Nonfatal."""
    info = lookup_event(obs.code, obs.text)
    return repair_for(info).value, clears_for(info)


def _words(obs: XidObservation) -> Asks | None:
    """What the line's words ask; None for NVML's event, which has none: it joins or
    repeats whatever the kernel log said."""
    return _asks(obs) if obs.source == "kmsg" else None


@dataclass
class _Incident:
    """One Xid on one GPU, open for twins and repeats for `window` seconds after its first
    sighting."""

    first: XidObservation
    event_id: str | None
    """The event raised for it; None when the holdoff held it back."""
    subject: str
    severity: Severity
    per_source: dict[XidSource, int] = field(default_factory=dict)
    asks: Asks | None = None
    """What its event asked (`_asks`)."""

    @property
    def occurrences(self) -> int:
        """Xids this incident stands for: the larger count of the two sources (the same Xid
        seen by both counts once)."""
        return max(self.per_source.values(), default=0)


EventBuilder = Callable[[XidObservation, frozenset[XidSource], Mapping[str, str]], Event]
"""Turns a correlated Xid into an Event: (first observation, sources, GPU identity labels)."""

_SOURCE_NAMES: dict[str, str] = {"kmsg": "the kernel log", "nvml": "NVML"}


def seen_by(sources: frozenset[XidSource]) -> str:
    """`seen by kmsg and nvml` / `seen by kmsg`, for messages and attributes (an event
    raised at first sight names one source; `xid_confirmed` tells of the other)."""
    return "seen by " + " and ".join(sorted(sources))


def gpu_description(pci_bus_id: str, identity: Mapping[str, str]) -> str:
    if identity.get("gpu"):
        model = f"{identity['model']}, " if identity.get("model") else ""
        return f"GPU {identity['gpu']} ({model}{pci_bus_id})"
    return f"GPU {pci_bus_id or '(unknown PCI address)'}"


def mig_description(details: Mapping[str, AttributeValue]) -> str:
    """` (MIG GPU instance 2, compute instance 1)` when the driver named the instances; the
    GPU instance's profile after its id where the gpu collector knows it (`2 (2g.35gb)`)."""
    parts = [
        f"{label} {details[key]}"
        for key, label in (
            ("gpu_instance", "GPU instance"),
            ("compute_instance", "compute instance"),
        )
        if details.get(key) is not None
    ]
    profile = details.get("gpu_instance_profile")
    if parts and profile and details.get("gpu_instance") is not None:
        parts[0] += f" ({profile})"
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
        repair_action=repair_for(info),
        clears=clears_for(info),
        attributes=attributes,
        aliases=gpu_aliases(identity.get("uuid", ""), obs.pci_bus_id),
        time=obs.time,
    )


def gpu_aliases(uuid: str, pci_bus_id: str) -> tuple[str, ...]:
    """The other name of a GPU named by its UUID: its PCI address. A finding logged before
    the GPU collector read the GPU (the backlog at start, an agent restarted) is named by
    its address alone, one after by its UUID: the ledger clears either under the other."""
    return (pci_bus_id,) if uuid and pci_bus_id and pci_bus_id != uuid else ()


CONFIRMED: Final = "xid_confirmed"
ESCALATED: Final = "xid_escalated"
XID_KINDS: Final = ("xid", CONFIRMED, ESCALATED)
SEED_HORIZON: Final = 86400.0
"""Seconds of stored Xid events a new process takes over (`XidCorrelator.seed`): the
kernel-log backlog it reads again after a crash may be that old (a restart loop, a stop of
hours); a sighting is matched to them by when the Xid happened, not by when it is read."""


XID_ERRORS: Final = MetricFamily(
    "gpuwarden_xid_errors_total",
    MetricType.COUNTER,
    "Xid errors per GPU and code on this boot, carried across agent restarts (kernel log and "
    "NVML correlated: one Xid seen by both counts once); GPU labels empty when NVML does not "
    "know the GPU",
    (*GPU_LABELS, "xid"),
)
XID_CONFIRMED: Final = MetricFamily(
    "gpuwarden_xid_confirmed_total",
    MetricType.COUNTER,
    "Xids the second source (kernel log or NVML) saw within the correlation window of the "
    "first, which had raised the event: confirmations, not new faults",
    (*GPU_LABELS, "xid"),
)
XID_FAMILIES: Final = (XID_ERRORS, XID_CONFIRMED)

NVML_COUNTS: Final = ("xid", "nvml_counts")
"""The state key of the Xid counts as the NVML thread last stored them: `{"boot": id,
"xids": [[pci, code, n], ...], "confirmed": [...]}`, written with each of its Xid events (in
the event's transaction: `CollectorDeps.emit_with`), or alone for a sighting that raised none
(a repeat, an incident the holdoff held back). The kernel_log collector stores the same
counts with its rounds (its `finding_counts`); a restart takes the larger of the two."""


def parse_snapshot(
    value: object,
) -> tuple[dict[tuple[str, int], int], dict[tuple[str, int], int]]:
    """(counts, confirmations) of a stored snapshot (`XidCorrelator.snapshot`): what of it is
    well formed (a row of a PCI address, a code and a count of at least one)."""
    tables: list[dict[tuple[str, int], int]] = []
    for name in ("xids", "confirmed"):
        table: dict[tuple[str, int], int] = {}
        rows = value.get(name) if isinstance(value, dict) else None
        for row in rows if isinstance(rows, list) else []:
            if not isinstance(row, list) or len(row) != 3:
                continue
            pci, code, n = row
            if isinstance(pci, str) and _whole(code) and _whole(n) and n > 0:
                table[(pci, code)] = n
        tables.append(table)
    return tables[0], tables[1]


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def shared_correlator(deps: CollectorDeps) -> XidCorrelator:
    """The process's one correlator (`deps.shared`), seeded once per process with the Xid
    events the state store holds from its last life (`XidCorrelator.seed`)."""
    correlator = deps.shared.get(XidCorrelator, XidCorrelator)
    correlator.seed_once(lambda since: deps.stored_events("gpu", XID_KINDS, since), SEED_HORIZON)
    return correlator


class XidCorrelator:
    """Thread-safe: the NVML event thread observes while the loop's rounds do.

    A live Xid raises its event at first sight. Within `window` seconds of that sighting
    the same GPU and code from the other source is its twin (an `xid_confirmed` follow-up,
    counted in `confirmations`), from the same source a repeat (counted; the next event
    says how many). Xids that predate the agent (kernel-log backlog) are grouped:
    `observe_backlog` makes one event per GPU and code of a batch, so a backlog of 500
    identical lines is one event saying 500; that event is then an incident like a live
    one's (a twin confirms it, the holdoff runs from it).
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
        self._last_event: dict[tuple[str, int], tuple[float, Asks]] = {}
        """(pci_bus_id, code) -> when the last event was raised, and what its line asked."""
        self._held: dict[tuple[str, int], int] = {}
        self.held_back = 0
        self._build_event: EventBuilder = build_event or build_xid_event
        self._clock = clock
        self._lock = threading.Lock()
        self._open: dict[tuple[str, int], _Incident] = {}
        self._identities: dict[str, dict[str, str]] = {}
        self._mig_profiles: dict[str, dict[int, str]] = {}
        self.counts: dict[tuple[str, int], int] = {}
        """(pci_bus_id, code) -> Xids seen on this boot (since start, plus what `carry_counts`
        took over from the last life), a twin seen by both sources once."""
        self.confirmations: dict[tuple[str, int], int] = {}
        """(pci_bus_id, code) -> Xids the second source saw within the window of the first."""
        self._past: dict[tuple[str, int], list[_Incident]] = {}
        """(pci_bus_id, code) -> the incidents of the process's last life (`seed`), oldest
        first: a sighting within `window` of one of them (by when the Xid happened) joins it."""
        self._seeded = False
        self.seeded = 0
        """Stored Xid events taken over at start."""
        self._attached: dict[int, str] = {}
        """id() -> name of the collectors feeding it now (`attach`): its series are exported
        while there is one."""
        self._carried_from: set[str] = set()
        self._carried: tuple[dict[tuple[str, int], int], dict[tuple[str, int], int]] = ({}, {})
        """What `carry_counts` took over: (counts, confirmations) of the last life."""

    def carry_counts(
        self,
        counts: Mapping[tuple[str, int], int],
        confirmations: Mapping[tuple[str, int], int],
        origin: str = "kernel_log",
    ) -> bool:
        """Take over the counts the process's last life had on this boot, as one of its
        stored snapshots says (`origin`: the kernel_log collector's, stored with its rounds;
        the NVML thread's, `NVML_COUNTS`, stored with its Xids), once per origin and process:
        a collector rebuilt by a reload finds its own taken. Each snapshot is the shared
        counts as they were when it was stored, so what was carried is, per GPU and code,
        the larger of them: the one stored last. False when this origin's was already."""
        with self._lock:
            if origin in self._carried_from:
                return False
            self._carried_from.add(origin)
            tables = (self.counts, self.confirmations)
            pairs = zip(tables, self._carried, (counts, confirmations), strict=True)
            for into, carried, stored in pairs:
                for key, n in stored.items():
                    more = n - carried.get(key, 0)
                    if more > 0:
                        carried[key] = n
                        into[key] = into.get(key, 0) + more
            return True

    def attach(self, owner: object, name: str) -> None:
        """A collector that feeds the correlator runs (`owner`, from its construction until
        `detach` at its close): the Xid series are exported while one does. A collector
        rebuilt by a reload attaches before the instance it replaces detaches."""
        with self._lock:
            self._attached[id(owner)] = name

    def detach(self, owner: object) -> None:
        with self._lock:
            self._attached.pop(id(owner), None)

    def shared_families(self) -> Sequence[MetricFamily]:
        return XID_FAMILIES

    def shared_samples(self) -> list[Sample]:
        """The Xid counters as they are now, one series per GPU and code, while a source's
        collector runs (`attach`); none otherwise. GPU labels from NVML's identity of the
        address, empty strings where NVML does not know it."""
        with self._lock:
            if not self._attached:
                return []
            tables = ((XID_ERRORS, dict(self.counts)), (XID_CONFIRMED, dict(self.confirmations)))
            identities = {k: dict(v) for k, v in self._identities.items()}
        samples: list[Sample] = []
        for family, table in tables:
            for (pci, code), count in sorted(table.items()):
                labels = identities.get(pci, {})
                samples.append(
                    family.sample(
                        count,
                        labels.get("gpu", ""),
                        labels.get("uuid", ""),
                        labels.get("pci_bus_id", pci),
                        labels.get("model", ""),
                        str(code),
                    )
                )
        return samples

    def snapshot(self) -> dict[str, JSONValue]:
        """`counts` and `confirmations` as stored (`parse_snapshot` reads them back)."""
        with self._lock:
            return {
                "xids": [[p, c, n] for (p, c), n in sorted(self.counts.items())],
                "confirmed": [[p, c, n] for (p, c), n in sorted(self.confirmations.items())],
            }

    def seed_once(self, read: Callable[[float], Sequence[Event]], horizon: float) -> None:
        """`seed` with the events `read(since)` gives, `horizon` seconds back; only the first
        call of a process reads (a collector rebuilt by a reload finds it done)."""
        with self._lock:
            if self._seeded:
                return
            self._seeded = True
        self.seed(read(self._clock() - horizon))

    def seed(self, events: Sequence[Event]) -> None:
        """Take over the Xid events of the process's last life (the state store's, oldest
        first). A process killed after NVML raised an Xid and before the kernel log's line of
        it was read, or its cursor stored, reads the line again at start: it confirms the
        stored event (`xid_confirmed`, the id the line gives) instead of raising a second
        one; an NVML twin of a kernel-log event raised just before the kill does too. The
        holdoff goes on from the last event's time. Events that do not parse are skipped."""
        with self._lock:
            by_id: dict[str, _Incident] = {}
            for event in events:
                if event.kind == "xid":
                    incident = _stored_incident(event)
                    if incident is None:
                        continue
                    key = (incident.first.pci_bus_id, incident.first.code)
                    self._past.setdefault(key, []).append(incident)
                    by_id[event.id] = incident
                    last = self._last_event.get(key)
                    if incident.asks is not None and (last is None or last[0] <= event.time):
                        self._last_event[key] = (event.time, incident.asks)
                    self.seeded += 1
                    continue
                confirmed = by_id.get(str(event.attributes.get("confirms", "")))
                source = event.attributes.get("source_now")
                if confirmed is None or source not in _SOURCE_NAMES:
                    continue
                named: XidSource = "kmsg" if source == "kmsg" else "nvml"
                confirmed.per_source[named] = confirmed.per_source.get(named, 0) + 1
                if event.kind == ESCALATED and event.severity > confirmed.severity:
                    confirmed.severity = event.severity

    def set_builder(self, build_event: EventBuilder) -> None:
        with self._lock:
            self._build_event = build_event

    def set_identity(self, pci_bus_id: str, labels: Mapping[str, str]) -> None:
        """GPU labels (gpu, uuid, pci_bus_id, model) for a PCI address, from NVML."""
        with self._lock:
            self._identities[pci_bus_id] = dict(labels)

    def set_mig_profiles(self, pci_bus_id: str, profiles: Mapping[int, str]) -> None:
        """GPU instance id -> profile (`1g.18gb`) of a GPU in MIG mode, from NVML; empty
        when it has none. An Xid naming an instance then names its profile too."""
        with self._lock:
            if profiles:
                self._mig_profiles[pci_bus_id] = dict(profiles)
            else:
                self._mig_profiles.pop(pci_bus_id, None)

    def identity(self, pci_bus_id: str) -> dict[str, str]:
        with self._lock:
            return dict(self._identities.get(pci_bus_id, {}))

    def identities(self) -> dict[str, dict[str, str]]:
        with self._lock:
            return {k: dict(v) for k, v in self._identities.items()}

    def observe(self, obs: XidObservation) -> Event | None:
        """A live Xid: its event at first sight; a follow-up for the other source's twin or
        for worse words; None for a repeat, or a new incident the holdoff holds back.

        The caller hands the event on at once (the round's events, or emit)."""
        if obs.predates_agent:
            return next(iter(self.observe_backlog([obs])), None)
        key = (obs.pci_bus_id, obs.code)
        with self._lock:
            incident = self._twin_of(key, obs)
            if incident is None:
                return self._first_sight(key, obs)
            return self._join(key, incident, obs)

    def _twin_of(self, key: tuple[str, int], obs: XidObservation) -> _Incident | None:
        """The open incident, or one of the last life's, that `obs` is a sighting of (within
        `window` of its first); it is the open one from here on. Under the lock."""
        incident = self._open.get(key)
        if incident is not None and abs(obs.time - incident.first.time) > self.window:
            del self._open[key]  # closed: this is a new incident, not a twin
            incident = None
        if incident is None:
            past = [
                i for i in self._past.get(key, ()) if abs(obs.time - i.first.time) <= self.window
            ]
            if past:
                incident = self._open[key] = past[-1]
        return incident

    def describe(self, obs: XidObservation) -> Event:
        """The event of an Xid as the builder makes it, and nothing else: not counted, no
        incident opened for a twin or a repeat, no holdoff. For an Xid logged while the GPUs
        were paused (the caller marks it, agent/contracts/pause.py): it is no fault count, and
        an Xid right after the resume must not pass for its twin or its repeat."""
        with self._lock:
            return self._event(obs, frozenset({obs.source}), 1, 0)

    def _first_sight(self, key: tuple[str, int], obs: XidObservation) -> Event | None:
        self._prune(obs.time)
        self.counts[key] = self.counts.get(key, 0) + 1
        identity = self._identities.get(obs.pci_bus_id, {})
        last = self._last_event.get(key)
        words = _words(obs)
        if (
            last is not None
            and 0 <= obs.time - last[0] < self.holdoff
            and (words is None or words == last[1])
        ):
            self._held[key] = self._held.get(key, 0) + 1
            self.held_back += 1
            self._open[key] = _Incident(
                obs, None, identity.get("uuid") or obs.pci_bus_id, _word_severity(obs), asks=last[1]
            )
            self._open[key].per_source[obs.source] = 1
            return None
        return self._raise(key, obs)

    def _raise(self, key: tuple[str, int], obs: XidObservation) -> Event:
        """The event of a new incident (or of a line that asks otherwise than the last)."""
        asks = _asks(obs)
        self._last_event[key] = (obs.time, asks)
        event = self._event(obs, frozenset({obs.source}), 1, self._held.pop(key, 0))
        incident = self._open[key] = _Incident(
            obs, event.id, event.subject, event.severity, asks=asks
        )
        incident.per_source[obs.source] = 1
        return event

    def _join(self, key: tuple[str, int], incident: _Incident, obs: XidObservation) -> Event | None:
        words = _words(obs)
        severity = _word_severity(obs)
        worse = severity > incident.severity
        if words is not None and words != incident.asks and not worse:  # worse: escalated
            # The driver's words ask otherwise than the incident's event (an Xid 154 back to
            # None): the line's own event, as a new incident; an NVML twin of it joins it.
            self.counts[key] = self.counts.get(key, 0) + 1
            return self._raise(key, obs)
        before = incident.occurrences
        new_source = obs.source not in incident.per_source
        incident.per_source[obs.source] = incident.per_source.get(obs.source, 0) + 1
        grown = incident.occurrences - before
        self.counts[key] = self.counts.get(key, 0) + grown
        if new_source:
            self.confirmations[key] = self.confirmations.get(key, 0) + 1
        elif incident.event_id is not None:
            # A repeat from the same source: counted now, told with the next event.
            self._held[key] = self._held.get(key, 0) + grown
        if incident.event_id is None or not (new_source or worse):
            return None
        if worse:
            incident.severity = severity
        return self._follow_up(incident, obs, new_source, worse)

    def _event(
        self,
        obs: XidObservation,
        sources: frozenset[XidSource],
        occurrences: int,
        held: int,
        *,
        texts: Sequence[str] = (),
    ) -> Event:
        identity = self._identities.get(obs.pci_bus_id, {})
        event = self._build_event(self._with_profile(obs), sources, identity)
        extra: dict[str, AttributeValue] = {
            "occurrences": occurrences,
            "repeats_since_last_event": held,
        }
        if len(texts) > 1:
            extra["texts"] = " | ".join(texts)
        changes: dict[str, object] = {"attributes": {**event.attributes, **extra}}
        if obs.origin:
            changes["id"] = stable_event_id(*obs.origin, "xid")
        return dataclasses.replace(event, **changes)  # type: ignore[arg-type]

    def _with_profile(self, obs: XidObservation) -> XidObservation:
        """The observation with its GPU instance's profile in its details, where known."""
        gi = obs.details.get("gpu_instance")
        if not isinstance(gi, int) or "gpu_instance_profile" in obs.details:
            return obs
        profile = self._mig_profiles.get(obs.pci_bus_id, {}).get(gi)
        if not profile:
            return obs
        return dataclasses.replace(obs, details={**obs.details, "gpu_instance_profile": profile})

    def _follow_up(
        self, incident: _Incident, obs: XidObservation, new_source: bool, worse: bool
    ) -> Event:
        first = incident.first
        identity = self._identities.get(first.pci_bus_id, {})
        info = lookup_event(obs.code, obs.text)
        delay = obs.time - first.time
        where = gpu_description(first.pci_bus_id, identity)
        said = _SOURCE_NAMES[obs.source]
        if worse:
            message = (
                f"Xid {obs.code} on {where} is worse than first reported: {said} says "
                f"{incident.severity.label} ({info.meaning})"
            )
        else:
            message = (
                f"Xid {obs.code} on {where} confirmed by {said} {delay:+.1f} s after "
                f"{_SOURCE_NAMES[first.source]} reported it; not a new fault"
            )
        attributes: dict[str, AttributeValue] = {
            "confirms": incident.event_id or "",
            "xid": obs.code,
            "pci_bus_id": first.pci_bus_id,
            "gpu": identity.get("gpu", ""),
            "uuid": identity.get("uuid", ""),
            "model": identity.get("model", ""),
            "first_source": first.source,
            "source_now": obs.source,
            "confirmed": new_source,
            "sources": ",".join(sorted(incident.per_source)),
            "delay_s": round(delay, 3),
            "text": obs.text,
            **info.attributes(),
        }
        kind = ESCALATED if worse else CONFIRMED
        event = Event(
            source="gpu",
            kind=kind,
            severity=incident.severity if worse else Severity.INFO,
            # Worse: the same fault, now with the line's worse repair; confirmed: nothing new.
            repair_action=repair_for(info) if worse else RepairAction.NONE,
            message=message,
            subject=incident.subject,
            action=info.action if worse else "",
            attributes=attributes,
            aliases=gpu_aliases(identity.get("uuid", ""), first.pci_bus_id),
            time=obs.time,
        )
        if obs.origin:  # the same record gives the same id after a restart
            event = dataclasses.replace(event, id=stable_event_id(*obs.origin, kind))
        return event

    def observe_backlog(self, observations: Sequence[XidObservation]) -> list[Event]:
        """Xids logged before the agent started (one read's worth): one event per GPU and
        code, at once, standing for all of them; no holdoff holds it back. From then on it
        is an Xid event like a live one: the other source's sighting within `window` of it
        is its twin, the same source's a repeat, and the holdoff runs from it (as it would
        from the stored event after a restart: `seed`)."""
        # Lines that ask otherwise are apart (an Xid 154 to a reset and back to None): in
        # the order they were first logged, so the all-clear comes after what it clears.
        groups: dict[tuple[str, int, Asks | None], list[XidObservation]] = {}
        out: list[Event] = []
        with self._lock:
            for obs in observations:
                # A line of an Xid already raised, by this process's NVML thread or before a
                # crash (`seed`): its twin or repeat, never a second event.
                key = (obs.pci_bus_id, obs.code)
                incident = self._twin_of(key, obs)
                if incident is None:
                    groups.setdefault((obs.pci_bus_id, obs.code, _words(obs)), []).append(obs)
                    continue
                follow_up = self._join(key, incident, obs)
                if follow_up is not None:
                    out.append(follow_up)
            for (pci_bus_id, code, _), group in groups.items():
                key = (pci_bus_id, code)
                self.counts[key] = self.counts.get(key, 0) + len(group)
                worst = max(group, key=_word_severity)  # the first of the worst words
                shown = dataclasses.replace(group[0], text=worst.text)
                sources = frozenset(o.source for o in group)
                texts = [o.text for o in group if o.text][:8]
                event = self._event(shown, sources, len(group), 0, texts=texts)
                out.append(event)
                self._opened(key, group, event)
        return out

    def _opened(self, key: tuple[str, int], group: Sequence[XidObservation], event: Event) -> None:
        """A backlog's event is the open incident of its GPU and code, and the holdoff runs
        from it, as `seed` takes it over after a restart (under the lock)."""
        asks = _asks(group[0])
        incident = _Incident(group[0], event.id, event.subject, event.severity, asks=asks)
        for obs in group:
            incident.per_source[obs.source] = incident.per_source.get(obs.source, 0) + 1
        self._open[key] = incident
        last = self._last_event.get(key)
        if last is None or last[0] <= event.time:
            self._last_event[key] = (event.time, asks)

    def _prune(self, now: float) -> None:
        """Forget incidents whose window closed (called under the lock)."""
        for key in [k for k, i in self._open.items() if abs(now - i.first.time) > self.window]:
            del self._open[key]


def _stored_incident(event: Event) -> _Incident | None:
    """The incident a stored `xid` event raised; None when its attributes do not say."""
    pci = event.attributes.get("pci_bus_id")
    code = event.attributes.get("xid")
    if not isinstance(pci, str) or not pci or not isinstance(code, int) or isinstance(code, bool):
        return None
    sources = [s for s in str(event.attributes.get("sources", "")).split(",") if s in _SOURCE_NAMES]
    if not sources:
        return None
    named: list[XidSource] = ["kmsg" if s == "kmsg" else "nvml" for s in sources]
    text = event.attributes.get("text")
    first = XidObservation(
        named[0], pci, code, event.time, text=text if isinstance(text, str) else ""
    )
    incident = _Incident(
        first,
        event.id,
        event.subject,
        event.severity,
        # As the first life judged it: the stored event's own repair may be a recurrence's.
        asks=_asks(first),
    )
    for source in named:
        incident.per_source[source] = 1
    return incident


def _word_severity(obs: XidObservation) -> Severity:
    """How bad the catalog judges this sighting, with the driver's words on the line."""
    return lookup_event(obs.code, obs.text).severity
