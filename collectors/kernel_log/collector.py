"""kernel_log: Xids, SXids, lost GPUs, GPUs the driver could not bring up, PCIe errors, disk and
file-system errors, host memory errors, OOM kills and hung tasks from the kernel log
(/dev/kmsg live, or a file of saved lines), read without replay across restarts.

Xids go to the shared `XidCorrelator`, which raises each at first sight and turns the NVML
side's sighting of the same Xid into a confirmation, never a second alert; everything else
becomes an event here. Every finding a read produced is an event of that same round, so the
cursor the round stores (with its events, in one transaction: agent/runtime/store_guard.py)
is never past a finding that is not stored. A storm of the same host finding (thousands of
I/O errors on one disk) raises one event per `repeat_holdoff`; the counters count every line.

Between rounds the collector waits on the log itself (`wake`): /dev/kmsg's descriptor
polls readable when a record arrives, a followed file is watched with inotify; the runtime
starts the next round then, not at the next interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agent.contracts.collector import (
    CollectContext,
    CollectorDeps,
    CollectorSettings,
    CollectorSpec,
    JSONValue,
)
from agent.contracts.errors import GpuwardenError
from agent.contracts.model import (
    AttributeValue,
    Collection,
    Event,
    MetricFamily,
    MetricType,
    Sample,
    Severity,
    clears_kind,
    stable_event_id,
)
from agent.contracts.pause import PauseHistory, PauseWindow, logged_during_pause
from agent.contracts.settings import setting
from collectors._repair import shared_recurrence
from collectors._xid import (
    XID_CONFIRMED,
    XID_ERRORS,
    XidObservation,
    gpu_aliases,
    gpu_description,
    parse_snapshot,
    shared_correlator,
)
from collectors.kernel_log.kmsg import (
    STATE_NAMESPACE,
    FileLogReader,
    HandedOn,
    KmsgIO,
    KmsgReader,
    LogReader,
    ReadBatch,
    is_character_device,
    read_boot_id,
)
from collectors.kernel_log.matchers import (
    KINDS,
    PAUSABLE_KINDS,
    Finding,
    MatcherSet,
    about_gpu,
)
from collectors.kernel_log.parse import LogRecord

# The Xid event's own attributes (collectors/_xid.py build_xid_event); the finding's other
# attributes (MIG instance, a fallen-off-the-bus block's facts) travel on as details.
_XID_OWN = frozenset({"fault", "known", "text"})

C = MetricType.COUNTER

COUNTS_KEY = "finding_counts"
LIVE_FROM_KEY = "live_from"
"""Where this boot's agent first read the log live, past the backlog it found at its first
start: {"boot", "log", "position"} (the log as `LogReader.origin` names it, the record's
position there). A record from there on was logged while an agent ran, so that a later life
reading it again (killed before its cursor was stored) does not call it "logged before the
agent started", and makes of it the event the first life made: one payload per id."""
"""The state key of the finding counters (`_Counts`), stored with each round's cursor."""

SXID_ERRORS = MetricFamily(
    "gpuwarden_sxid_errors_total",
    C,
    "NVSwitch SXid errors per switch and code seen in the kernel log on this boot, carried "
    "across agent restarts",
    ("pci_bus_id", "device", "sxid"),
)
FINDINGS = MetricFamily(
    "gpuwarden_kernel_log_findings_total",
    C,
    "Kernel-log lines that are findings, by kind, on this boot, carried across agent restarts "
    "(GPU findings logged while the GPUs were paused count in "
    "gpuwarden_kernel_log_paused_findings_total instead)",
    ("kind",),
)
PAUSED_FINDINGS = MetricFamily(
    "gpuwarden_kernel_log_paused_findings_total",
    C,
    "GPU findings (Xid, SXid, fallen off the bus) logged while the GPUs were paused "
    "(gpuwarden pause), by kind: sent as info events marked during_pause, in no other series",
    ("kind",),
)
RECORDS = MetricFamily(
    "gpuwarden_kernel_log_records_total", C, "Kernel-log records read since the agent started"
)
MALFORMED = MetricFamily(
    "gpuwarden_kernel_log_malformed_records_total",
    C,
    "Kernel-log records or lines that could not be parsed, skipped",
)
IGNORED = MetricFamily(
    "gpuwarden_kernel_log_ignored_records_total",
    C,
    "Records that looked like a finding of this kind but were written from user space "
    "(facility >= 1), so not trusted",
    ("kind",),
)
LOST = MetricFamily(
    "gpuwarden_kernel_log_lost_records_total",
    C,
    "Records overwritten in the kernel ring buffer before the agent read them",
)
OVERRUNS = MetricFamily(
    "gpuwarden_kernel_log_overruns_total",
    C,
    "Times /dev/kmsg answered EPIPE: the reader fell behind the ring buffer",
)
SKIPPED = MetricFamily(
    "gpuwarden_kernel_log_replay_skipped_records_total",
    C,
    "Records of this boot already processed before a restart, skipped instead of replayed",
)
SUPPRESSED = MetricFamily(
    "gpuwarden_kernel_log_suppressed_events_total",
    C,
    "Findings that raised no event because the same kind and subject raised one within "
    "repeat_holdoff",
    ("kind",),
)


@dataclass(frozen=True)
class KernelLogSettings(CollectorSettings):
    path: Path = setting(
        Path("/dev/kmsg"), help="/dev/kmsg, or a file of saved kernel-log lines (read like tail -f)"
    )
    boot_id_path: Path = setting(
        Path("/proc/sys/kernel/random/boot_id"),
        help="the kernel's boot id; with the last sequence number "
        "read it keeps a restart from replaying old records",
    )
    repeat_holdoff: float = setting(
        300.0,
        minimum=0.0,
        maximum=86400.0,
        help="seconds in which repeats of a non-Xid finding (the same fault of the same "
        "device, process or GPU, no worse than its last event) raise no new event; they "
        "are counted",
    )


@dataclass
class _Holdoff:
    last: float
    severity: Severity
    """The worst raised in this holdoff: a finding worse than it is news."""
    clears: tuple[str, ...] = ()
    """What the finding that opened it clears (an all-clear's kinds)."""
    suppressed: int = 0


_Key = tuple[str, ...]
"""A holdoff's key: (kind, subject, name, code)."""


class _Holdoffs:
    """The open holdoffs by key, and the keys of each subject. A fault and its all-clear take
    turns: raising one ends the other's holdoff on the same subject, so that a file server that
    stops answering again after its `OK` (or a slot whose link goes down again) is news, and
    so is the all-clear after it. They are found among the subject's own keys: a look at every
    key would make a read of 50,000 findings about as many subjects (hung tasks, each its own
    pid) cost its square."""

    def __init__(self) -> None:
        self._held: dict[_Key, _Holdoff] = {}
        self._keys: dict[str, set[_Key]] = {}

    def get(self, key: _Key) -> _Holdoff | None:
        return self._held.get(key)

    def open(self, key: _Key, held: _Holdoff) -> int:
        """A new holdoff for `key` (its finding raised an event); the other side's ends. Returns
        how many repeats the faults it clears held back since their last event (an all-clear's
        news: nothing else raises them)."""
        subject = key[1]
        ended = 0
        for other in [k for k in self._keys.get(subject, ()) if k != key]:
            if clears_kind(held.clears, other[0]):
                ended += self._held[other].suppressed
                self._drop(other)
            elif clears_kind(self._held[other].clears, key[0]):
                self._drop(other)
        self._held[key] = held
        self._keys.setdefault(subject, set()).add(key)
        return ended

    def prune(self, horizon: float) -> None:
        """Forget the holdoffs whose last event is older than `horizon`."""
        for key in [k for k, held in self._held.items() if held.last < horizon]:
            self._drop(key)

    def clear(self) -> None:
        self._held.clear()
        self._keys.clear()

    def _drop(self, key: _Key) -> None:
        del self._held[key]
        keys = self._keys[key[1]]
        keys.discard(key)
        if not keys:
            del self._keys[key[1]]


@dataclass
class _ProcessLog:
    """Shared by the kernel_log collectors of one process (the runtime's SharedServices)."""

    backlog_read: bool = False
    """A batch that reached the end of the log is committed: what a reader reads from then
    on was written while the agent ran. Not before: a reader made again by a reload that
    cut the first rounds short reads their records again, as the backlog they are."""
    totals: Counter[str] = field(default_factory=Counter)
    """The records read, malformed, lost, ... since the agent started: a reload that makes
    the collector again is no start (the counters' help says "since the agent started"), and
    an instance of its own that began at zero lowered every one of them."""
    ignored: Counter[str] = field(default_factory=Counter)
    """The matchers' user-space findings, counted the same way (MatcherSet.ignored)."""
    handed_on: HandedOn = field(default_factory=HandedOn)
    """How far this process's /dev/kmsg readers have handed records on: the reader a reload
    makes reads the ring again from its start, and counts none of those records twice."""


class KernelLogCollector:
    name = "kernel_log"

    def __init__(
        self, settings: KernelLogSettings, deps: CollectorDeps, io: KmsgIO | None = None
    ) -> None:
        self.settings = settings
        self.deps = deps
        self.io = io
        self.correlator = shared_correlator(deps)
        self.recurrence = shared_recurrence(deps, lambda: read_boot_id(settings.boot_id_path))
        process = deps.shared.get(_ProcessLog, _ProcessLog)
        self.matchers = MatcherSet()
        self.matchers.ignored = process.ignored
        self.reader: LogReader | None = None
        self.findings: Counter[str] = Counter(dict.fromkeys(KINDS, 0))
        self.sxids: Counter[tuple[str, str, int]] = Counter()
        # The process's, not this instance's (the finding counters are taken over from the
        # store instead, `_load_counts`: they count the boot).
        self.totals = process.totals
        self.suppressed: Counter[str] = Counter()
        self.pauses = deps.shared.get(PauseHistory, PauseHistory)
        self.paused_findings: Counter[str] = Counter(dict.fromkeys(sorted(PAUSABLE_KINDS), 0))
        self._holdoff = _Holdoffs()
        self._paused_holdoff = _Holdoffs()
        """Apart from `_holdoff`: what the reset logs must not hold back the same finding
        logged right after the resume (the GPU came back broken)."""
        self._more = False
        self._counts_loaded = False
        self._boot: str | None = None
        self._stored_counts: JSONValue | None = None
        self._live_from: tuple[str, int] | None = None
        """(log, position) of `LIVE_FROM_KEY` on this boot, once known."""
        self._live_from_set = False
        """This instance has taken (or kept) the mark, at its first live batch."""
        # The Xid counters are the correlator's series, exported while this runs (or the gpu
        # collector does): never this collector's own samples, which a failed round drops.
        self.correlator.attach(self, self.name)

    def families(self) -> Sequence[MetricFamily]:
        return (
            XID_ERRORS,
            XID_CONFIRMED,
            SXID_ERRORS,
            FINDINGS,
            PAUSED_FINDINGS,
            RECORDS,
            MALFORMED,
            IGNORED,
            LOST,
            OVERRUNS,
            SKIPPED,
            SUPPRESSED,
        )

    def _open_reader(self) -> LogReader:
        path = self.settings.path
        # Only the backlog read first predates the agent: a reader made again by a reload
        # after it picks up records the agent was running for (`_ProcessLog.backlog_read`).
        process = self.deps.shared.get(_ProcessLog, _ProcessLog)
        backlog = not process.backlog_read
        if is_character_device(path) or self.io is not None:
            return KmsgReader(
                path,
                self.settings.boot_id_path,
                self.deps.state,
                io=self.io,
                backlog=backlog,
                handed_on=process.handed_on,
            )
        return FileLogReader(path, self.deps.state, backlog=backlog)

    async def collect(self, ctx: CollectContext) -> Collection:
        if self.reader is None:
            self.reader = await ctx.call("kernel_log:open", self._open_reader)
        if not self._counts_loaded:
            await ctx.call("kernel_log:counts", self._load_counts)
        reader = self.reader
        batch = await ctx.call("kernel_log:read", reader.read)
        self._more = batch.more
        self._prune_holdoff(ctx.now)
        if not self.recurrence.loaded:  # its boots in memory: escalation reads no SQL here
            await ctx.call("kernel_log:xid_boots", self.recurrence.load)
        events = self._process(batch, reader)
        self._store_counts()
        # Every finding of the batch is in `events`, none waits in memory: the runtime stores
        # them with (never after) this cursor, so no death of the process between here and
        # the store loses a finding, and a restart does not skip one. Never raises.
        reader.commit(batch)
        if not batch.more:
            self.deps.shared.get(_ProcessLog, _ProcessLog).backlog_read = True
        return Collection(samples=self._samples(), events=events)

    async def wake(self, timeout: float) -> None:
        """Return when the log has something new to read, or after `timeout` seconds (the
        runtime's wait between rounds). Without a descriptor to wait on (a test double of
        /dev/kmsg, no inotify) it simply waits the timeout, as an interval would."""
        if self._more:  # the last read stopped at its bound: read on at once
            await asyncio.sleep(0)
            return
        reader = self.reader
        fd = reader.wake_fd() if reader is not None else None
        if fd is None:
            await asyncio.sleep(timeout)
            return
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        try:
            loop.add_reader(fd, ready.set)
        except (OSError, ValueError):  # closed meanwhile (a stop or reload)
            await asyncio.sleep(timeout)
            return
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ready.wait(), timeout)
        finally:
            loop.remove_reader(fd)
        if reader is not None:
            reader.woken()

    def _load_counts(self) -> None:
        """Take over the finding counters this boot's last life of the agent stored with its
        cursor (`COUNTS_KEY`): they stand for exactly the records before that cursor, which
        this life does not read again. A finding stored and then killed before Prometheus
        scraped it is still in the series, and a restart alone never lowers one (a lower
        value would read as a counter reset). Another boot's, or none: from zero."""
        self._counts_loaded = True
        try:
            self._boot = read_boot_id(self.settings.boot_id_path)
        except GpuwardenError:
            self._boot = None  # no boot to tie them to: neither carried nor stored
            return
        self._live_from = _live_from(
            self.deps.state.get(STATE_NAMESPACE, LIVE_FROM_KEY), self._boot
        )
        saved = self.deps.state.get(STATE_NAMESPACE, COUNTS_KEY)
        if not isinstance(saved, dict) or saved.get("boot") != self._boot:
            # Nothing of this boot's last life: and none to come, since what is stored from
            # here on is this process's own counts, which the correlator holds already (a
            # collector made again by a reload took them over a second time).
            self.correlator.carry_counts({}, {}, origin="kernel_log")
            return
        self._stored_counts = saved
        for name, into in (
            ("findings", self.findings),
            ("paused_findings", self.paused_findings),
            ("suppressed", self.suppressed),
        ):
            for kind, number in _pairs(saved.get(name)):
                into[kind] += number
        for pci, device, code, n in _rows(saved.get("sxids"), 4):
            sxid, many = _count(code), _count(n)
            if isinstance(pci, str) and isinstance(device, str) and sxid is not None and many:
                self.sxids[(pci, device, sxid)] += many
        counts, confirmed = parse_snapshot(saved)
        self.correlator.carry_counts(counts, confirmed, origin="kernel_log")

    def _store_counts(self) -> None:
        """The finding counters as they are now, in the round's state (stored with its
        cursor, in one transaction); written only when they changed."""
        if self._boot is None:
            return
        value: JSONValue = {
            "boot": self._boot,
            "findings": {k: n for k, n in sorted(self.findings.items()) if n},
            "paused_findings": {k: n for k, n in sorted(self.paused_findings.items()) if n},
            "suppressed": {k: n for k, n in sorted(self.suppressed.items()) if n},
            "sxids": [[p, d, c, n] for (p, d, c), n in sorted(self.sxids.items())],
            **self.correlator.snapshot(),  # "xids", "confirmed"
        }
        if value != self._stored_counts:
            self.deps.state.put(STATE_NAMESPACE, COUNTS_KEY, value)
            self._stored_counts = value

    def _process(self, batch: ReadBatch, reader: LogReader) -> list[Event]:
        for name, value in (
            ("records", len(batch.records)),
            ("malformed", batch.malformed),
            ("lost", batch.lost),
            ("overruns", batch.overruns),
            ("skipped", batch.skipped),
        ):
            self.totals[name] += value
        findings = [f for record in batch.records for f in self.matchers.feed(record)]
        # The batch holds every record there was: a message still held open for its next line
        # is complete, and must not wait in memory past the cursor commit that follows.
        findings.extend(self.matchers.settle())
        events: list[Event] = []
        backlog: list[XidObservation] = []
        if not batch.predates_agent or not batch.more:  # the backlog ended, or had
            self._mark_live(reader, batch)
        for finding in findings:
            origin = (self.deps.node_id, *reader.origin(finding.record))
            when = reader.record_time(finding.record)
            predates = batch.predates_agent and not self._read_live(origin[1:])
            # Judged by when it was logged: a record of the pause read after the resume is
            # still the pause's.
            window = self.pauses.covering(when) if about_gpu(finding) else None
            if window is not None:
                paused = self._paused(finding, when, predates, origin, window)
                if paused is not None:
                    events.append(paused)
                continue
            xid = self._xid(finding, when, predates, origin)
            if xid is None:
                event = self._handle(finding, when, predates, origin)
            elif predates:
                backlog.append(xid)
                continue
            else:
                event = self.correlator.observe(xid)
            if event is not None:
                events.append(self.recurrence.escalate(event))
        events.extend(self.recurrence.escalate(e) for e in self.correlator.observe_backlog(backlog))
        return events

    def _mark_live(self, reader: LogReader, batch: ReadBatch) -> None:
        """Where this boot's agent first read the log live (past the backlog): the first
        record of a live batch, or the one the cursor is before (a live batch with none, the
        backlog's last batch). Stored (with the round's events and cursor) unless an earlier
        life of this boot stored it already."""
        if self._boot is None or self._live_from_set:
            return
        if batch.records and not batch.predates_agent:
            first = batch.records[0]
        elif batch.cursor is not None:  # nothing new: the next record is past the cursor
            seq, line = batch.cursor.get("seq"), batch.cursor.get("line")
            first = LogRecord(
                "",
                line=line + 1 if isinstance(line, int) else 0,
                seq=seq + 1 if isinstance(seq, int) else None,
            )
        else:
            return
        origin = reader.origin(first)
        self._live_from_set = True
        if len(origin) != 2 or not origin[1].isdigit():
            return
        if self._live_from is not None and self._live_from[0] == origin[0]:
            return  # the first life's mark stays: it tells what was read live since then
        self._live_from = (origin[0], int(origin[1]))
        self.deps.state.put(
            STATE_NAMESPACE,
            LIVE_FROM_KEY,
            {"boot": self._boot, "log": origin[0], "position": int(origin[1])},
        )

    def _read_live(self, where: tuple[str, ...]) -> bool:
        """Whether the record at `where` ((log, position): `LogReader.origin`) was logged
        after this boot's agent first read the log live: an earlier life of it ran then."""
        if self._live_from is None or len(where) != 2 or where[0] != self._live_from[0]:
            return False
        try:
            return int(where[1]) >= self._live_from[1]
        except ValueError:
            return False

    def _paused(
        self,
        finding: Finding,
        when: float,
        predates: bool,
        origin: tuple[str, ...],
        window: PauseWindow,
    ) -> Event | None:
        """A GPU finding logged while the GPUs were paused: an event marked as such, counted
        apart; it touches nothing a finding outside the pause is judged by (the Xid counts
        and correlation, the recurrence across boots, the holdoff)."""
        self.paused_findings[finding.kind] += 1
        key = (finding.kind, self._subject(finding), finding.name, str(finding.code))
        if finding.kind == "xid" and finding.code is not None:
            held_back = self._held_back(self._paused_holdoff, key, when, finding)
            if held_back is None:
                return None
            event = self.correlator.describe(self._observation(finding, when, predates, origin))
            attributes = {**event.attributes, "repeats_since_last_event": held_back[0]}
            event = dataclasses.replace(event, attributes=attributes)
        else:
            found = self._event(finding, when, predates, self._paused_holdoff, key)
            if found is None:
                return None
            event = dataclasses.replace(found, id=stable_event_id(*origin, finding.kind))
        return logged_during_pause(event, window)

    def _xid(
        self, finding: Finding, when: float, predates: bool, origin: tuple[str, ...]
    ) -> XidObservation | None:
        if finding.kind != "xid" or finding.code is None:
            return None
        self.findings[finding.kind] += 1
        return self._observation(finding, when, predates, origin)

    def _observation(
        self, finding: Finding, when: float, predates: bool, origin: tuple[str, ...]
    ) -> XidObservation:
        assert finding.code is not None
        return XidObservation(
            source="kmsg",
            pci_bus_id=finding.pci_bus_id,
            code=finding.code,
            time=when,
            text=finding.record.message,
            predates_agent=predates,
            details={k: v for k, v in finding.attributes.items() if k not in _XID_OWN},
            origin=origin,
        )

    def _handle(
        self, finding: Finding, when: float, predates: bool, origin: tuple[str, ...]
    ) -> Event | None:
        self.findings[finding.kind] += 1
        if finding.kind == "sxid" and finding.code is not None:
            self.sxids[(finding.pci_bus_id, finding.device, finding.code)] += 1
        # A repeat is the same fault (the matcher's name for it: an NVMe timeout is not the
        # controller going down) of the same subject; code apart for an SXid.
        key = (finding.kind, self._subject(finding), finding.name, str(finding.code))
        event = self._event(finding, when, predates, self._holdoff, key)
        if event is None:
            return None
        # Found again from the same record after a crash, it is the same event: same id.
        return dataclasses.replace(event, id=stable_event_id(*origin, finding.kind))

    def _held_back(
        self,
        holdoff: _Holdoffs,
        key: _Key,
        when: float,
        finding: Finding,
    ) -> tuple[int, int] | None:
        """None: a repeat within repeat_holdoff of the last event for `key`, no worse than
        the worst raised there, counted and raising none; otherwise how many were held back
        since that event (a worse one, a corrected error turned uncorrected, is news), and for
        an all-clear how many repeats of the faults it ends were (`_Holdoffs.open`)."""
        held = holdoff.get(key)
        # Either side: two records of one stamp can come out a few microseconds apart the
        # wrong way (boot time is taken from the clocks at each read), and with
        # repeat_holdoff 0 nothing may be held back.
        if (
            held is not None
            and abs(when - held.last) < self.settings.repeat_holdoff
            and finding.severity <= held.severity
        ):
            held.suppressed += 1
            self.suppressed[finding.kind] += 1
            return None
        ended = holdoff.open(key, _Holdoff(when, finding.severity, finding.clears))
        return (held.suppressed if held is not None else 0), ended

    def _subject(self, finding: Finding) -> str:
        identity = self.correlator.identity(finding.pci_bus_id) if finding.pci_bus_id else {}
        return identity.get("uuid") or finding.subject

    def _event(
        self,
        finding: Finding,
        when: float,
        predates: bool,
        holdoff: _Holdoffs,
        key: _Key,
    ) -> Event | None:
        held_back = self._held_back(holdoff, key, when, finding)
        if held_back is None:
            return None
        repeats, fault_repeats = held_back
        identity = self.correlator.identity(finding.pci_bus_id) if finding.pci_bus_id else {}
        subject = identity.get("uuid") or finding.subject
        attributes: dict[str, AttributeValue] = dict(finding.to_dict())
        for name in ("kind", "severity", "meaning", "action"):
            attributes.pop(name, None)
        attributes.update(
            {
                "predates_agent": predates,
                "repeats_since_last_event": repeats,
                **({"fault_repeats_held_back": fault_repeats} if finding.clears else {}),
                **{k: v for k, v in identity.items() if k in ("gpu", "uuid", "model")},
            }
        )
        return Event(
            source=self.name,
            kind=finding.kind,
            severity=finding.severity,
            message=_message(finding, identity, predates),
            subject=subject,
            action=finding.action,
            repair_action=finding.repair_action,
            clears=finding.clears,
            attributes=attributes,
            aliases=gpu_aliases(identity.get("uuid", ""), finding.pci_bus_id or ""),
            time=when,
        )

    def _samples(self) -> list[Sample]:
        samples = [
            RECORDS.sample(self.totals["records"]),
            MALFORMED.sample(self.totals["malformed"]),
            LOST.sample(self.totals["lost"]),
            OVERRUNS.sample(self.totals["overruns"]),
            SKIPPED.sample(self.totals["skipped"]),
        ]
        samples += [FINDINGS.sample(n, kind) for kind, n in sorted(self.findings.items())]
        samples += [PAUSED_FINDINGS.sample(n, kind) for kind, n in self.paused_findings.items()]
        samples += [IGNORED.sample(self.matchers.ignored[kind], kind) for kind in KINDS]
        samples += [
            SUPPRESSED.sample(self.suppressed[kind], kind) for kind in KINDS if kind not in ("xid",)
        ]
        for (pci, device, code), count in sorted(self.sxids.items()):
            samples.append(SXID_ERRORS.sample(count, pci, device, str(code)))
        return samples

    async def close(self) -> None:
        """Release the descriptors. Nothing waits in memory: every finding read is already
        one of a round's events."""
        self.correlator.detach(self)
        if self.reader is not None:
            self.reader.close()
            self.reader = None

    def _prune_holdoff(self, now: float) -> None:
        horizon = now - self.settings.repeat_holdoff
        self._holdoff.prune(horizon)
        self._paused_holdoff.prune(horizon)


def _count(value: object) -> int | None:
    """A stored count: a non-negative int (not a bool); None otherwise."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def _pairs(value: object) -> list[tuple[str, int]]:
    """A stored {kind: count}, what of it is well formed."""
    if not isinstance(value, dict):
        return []
    return [(k, n) for k, v in value.items() if (n := _count(v)) is not None and isinstance(k, str)]


def _live_from(value: object, boot: str | None) -> tuple[str, int] | None:
    """A stored `LIVE_FROM_KEY` of this boot, what of it is well formed."""
    if not isinstance(value, dict) or boot is None or value.get("boot") != boot:
        return None
    log_name, position = value.get("log"), value.get("position")
    if not isinstance(log_name, str) or not isinstance(position, int) or isinstance(position, bool):
        return None
    return log_name, position


def _rows(value: object, width: int) -> list[list[object]]:
    """A stored list of rows of `width` fields, what of it is well formed in shape."""
    if not isinstance(value, list):
        return []
    return [row for row in value if isinstance(row, list) and len(row) == width]


def _message(finding: Finding, identity: dict[str, str], predates: bool) -> str:
    when = " (logged before the agent started)" if predates else ""
    line = finding.record.message.strip()
    if len(line) > 240:
        line = line[:237] + "..."
    if about_gpu(finding):
        where = (
            gpu_description(finding.pci_bus_id, identity)
            if finding.kind != "sxid"
            else f"{finding.device} ({finding.pci_bus_id or 'unknown PCI address'})"
        )
        name = f"{finding.name}: " if finding.name else ""
        return f"{where}{when}: {name}{finding.meaning}. Kernel log: {line}"
    meaning = finding.meaning[:1].upper() + finding.meaning[1:]
    return f"{meaning}{when}. Kernel log: {line}"


SPEC = CollectorSpec(
    name="kernel_log",
    description="Xids, SXids, lost GPUs, PCIe, I/O, file-system, NVMe and memory errors, OOM "
    "kills, hung tasks from /dev/kmsg or a saved log",
    settings_type=KernelLogSettings,
    factory=KernelLogCollector,
    default_settings=KernelLogSettings(interval=2.0),
)
