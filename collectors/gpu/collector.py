"""The gpu collector: NVML telemetry, memory and link errors, GPU count, and the NVML event thread.

One `ctx.call` per GPU per round, under the key `nvml:gpu<index>`: a GPU whose driver call hangs
is reported unresponsive and not called again until that call returns, while the other GPUs
keep reporting. Static facts are read at start, every `static_refresh_interval` and when the
GPU set changes; costly reads (PCIe replays, the link width, retired pages, NVLink) every
`slow_interval`, and the energy counter (about 3.3 ms per call on the H200) every
`energy_interval`, GPM activity (Hopper and later) every `gpm_interval`, against the sample the
last GPM read kept. No NVIDIA driver is a normal outcome for this collector, not a failure: it
reports `gpuwarden_nvml_up 0` and one event, and tries `nvmlInit` again every
`nvml_retry_interval`.

A GPU whose call still hangs from an earlier round (`CallStillHung`) was reported unresponsive
when that call timed out; a collector made again by a reload, on the same caller, finds it so
and does not report it again.

A GPU in MIG mode (the mode is a static fact: a GPU not in it makes no MIG call) has series
per GPU instance every round: memory, profile, and GPM on the GPM interval.

Who uses a GPU: NVML lists its compute processes every round; the `top_processes` largest get a
series each, with the owner read once per process from /proc (cgroup and user). A GPU on the
PCI bus that NVML does not see (it never enumerated) is found by counting NVIDIA functions in
sysfs on the slow interval, NVML up or not. Each GPU's identity is kept in the state store with the boot id
and GPU count, so a GPU that hangs before this collector read it (after a reload or a restart)
is still named by its UUID; one never read at all is named by its index, and the message says
that its UUID was never read.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from agent.contracts.collector import (
    Call,
    CollectContext,
    CollectorDeps,
    CollectorSettings,
    CollectorSpec,
    JSONValue,
)
from agent.contracts.errors import CallStillHung, CallTimedOut, GpuwardenError
from agent.contracts.model import Collection, Event, MetricFamily, RepairAction, Sample, Severity
from agent.contracts.pause import Released
from agent.contracts.settings import setting
from collectors._nvml import (
    GpmReading,
    GpuLost,
    GpuProcess,
    GpuRound,
    GpuSlowReading,
    GpuStatic,
    MigInstance,
    NvmlBackend,
    NvmlUnavailable,
)
from collectors._procfs import ProcessOwner, open_files, read_boot_id, read_owner
from collectors._repair import shared_recurrence
from collectors._xid import NVML_COUNTS, parse_snapshot, shared_correlator
from collectors.gpu import metrics as m
from collectors.gpu.checks import (
    FAST_COUNTERS,
    SLOW_COUNTERS,
    SOURCE,
    ConditionTracker,
    CounterTracker,
    condition_events,
    condition_inputs,
    counter_events,
    where,
)
from collectors.gpu.events import GpuEventThread
from collectors.gpu.pci import PciScan, scan_pci

STATE_NAMESPACE: Final = "gpu"
IDENTITY_NAMESPACE: Final = "gpu.identity"
"""index -> {"boot", "count", "labels"}: who the GPU at this index was, this boot."""
HOST_SUBJECT: Final = "host"
HELD_KINDS: Final = ("gpu_lost", "gpu_unresponsive")
"""The GPU's error events that hold a requirement until its gpu_recovered."""


@dataclass(frozen=True)
class GpuSettings(CollectorSettings):
    expected_gpus: int = setting(
        0,
        minimum=0,
        maximum=256,
        help="GPUs this host should have; fewer visible is a critical event (0: no expectation)",
    )
    slow_interval: float = setting(
        60.0,
        minimum=1.0,
        maximum=86400.0,
        help="seconds between costly reads: PCIe replays, the PCIe link width, retired pages, "
        "NVLink",
    )
    energy_interval: float = setting(
        300.0,
        minimum=1.0,
        maximum=86400.0,
        help="seconds between reads of the energy counter (about 3.3 ms per call on an H200)",
    )
    static_refresh_interval: float = setting(
        600.0,
        minimum=10.0,
        maximum=86400.0,
        help="seconds between re-reads of static facts (names, serials, VBIOS, thresholds, modes)",
    )
    nvml_retry_interval: float = setting(
        60.0,
        minimum=1.0,
        maximum=86400.0,
        help="seconds between nvmlInit attempts while NVML or the driver is missing",
    )
    event_thread: bool = setting(
        True, help="run the NVML event thread (Xid and ECC events as they happen)"
    )
    event_wait_ms: int = setting(
        1000,
        minimum=10,
        maximum=10000,
        help="milliseconds the event thread waits per nvmlEventSetWait (its stop latency)",
    )
    top_processes: int = setting(
        8,
        minimum=0,
        maximum=256,
        help="compute processes per GPU with a series of their own, the largest by memory "
        "(0: none; the count is always exported)",
    )
    proc_root: str = setting(
        "/proc", help="where /proc is (process names, users and cgroups of GPU processes)"
    )
    sysfs_root: str = setting(
        "/sys", help="where /sys is (NVIDIA GPUs and NVSwitches on the PCI bus)"
    )
    gpm_interval: float = setting(
        30.0,
        minimum=0.0,
        maximum=86400.0,
        help="seconds between GPM reads (activity averaged over that span; Hopper and later; "
        "0: off)",
    )


@dataclass
class _Gpu:
    """What the collector remembers of one GPU index between rounds."""

    static: GpuStatic | None = None
    static_at: float = 0.0
    slow: GpuSlowReading | None = None
    slow_at: float = 0.0
    energy_joules: float | None = None
    energy_at: float | None = None
    error: str | None = None
    error_subjects: tuple[str, ...] = ()
    """The subjects its error events were raised under (its UUID, or its index when never
    read): its gpu_recovered says the same, so that it clears what they raised."""
    # Samples of the static and slow readings, built once per reading rather than every
    # round: they are most of a steady round's Python cost (measured on the H200).
    static_samples: tuple[Sample, ...] | None = None
    slow_samples: tuple[Sample, ...] | None = None
    recovery_samples: tuple[Sample, ...] | None = None
    recovery_seen: int | None = None
    """The recovery action those samples and the conditions were made for."""
    gpm: GpmReading | None = None
    gpm_at: float | None = None
    gpm_samples: tuple[Sample, ...] | None = None
    processes: tuple[GpuProcess, ...] = ()
    """This round's top processes by memory (at most top_processes)."""
    memo: m.SampleMemo = field(default_factory=m.SampleMemo)
    """Its fast readings' samples of the last round (collectors/gpu/metrics.py)."""
    mig_profiles: dict[int, str] = field(default_factory=dict)
    """GPU instance id -> profile, as last told to the Xid correlator."""
    mig_gpm: dict[tuple[int, tuple[str, ...]], GpmReading] = field(default_factory=dict)
    """(GPU instance id, its devices' UUIDs) -> its last GPM reading, served between GPM
    reads; an instance that is gone (or re-created under the same id) loses its entry."""
    remembered: dict[str, str] | None = None
    """Identity labels stored by an earlier collector (this boot, same GPU count), for a GPU
    this one has not read yet."""

    def cached_static_samples(
        self, labels: dict[str, str], static: GpuStatic
    ) -> tuple[Sample, ...]:
        if self.static_samples is None:
            self.static_samples = tuple(m.static_samples(labels, static))
        return self.static_samples

    def cached_slow_samples(
        self, labels: dict[str, str], slow: GpuSlowReading
    ) -> tuple[Sample, ...]:
        if self.slow_samples is None:
            self.slow_samples = tuple(m.slow_samples(labels, slow))
        return self.slow_samples

    def cached_gpm_samples(self, labels: dict[str, str], gpm: GpmReading) -> tuple[Sample, ...]:
        if self.gpm_samples is None:
            self.gpm_samples = tuple(m.gpm_samples(labels, gpm))
        return self.gpm_samples

    def labels(self, index: int) -> dict[str, str]:
        if self.static is not None:
            return self.static.identity.labels()
        if self.remembered is not None:
            return dict(self.remembered)
        return {"gpu": str(index), "uuid": "", "pci_bus_id": "", "model": ""}


@dataclass
class _Round:
    samples: list[Sample] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)


def _gpu_result(answer: GpuRound | Exception) -> GpuRound | str:
    """A GPU's round, or the name of its error state: 'lost', 'unresponsive', or
    'still_unresponsive' (a call from an earlier round still hangs). Any other exception
    (NVML went away) is the whole round's."""
    if isinstance(answer, GpuLost):
        return "lost"
    if isinstance(answer, CallTimedOut):
        return "unresponsive"
    if isinstance(answer, CallStillHung):
        return "still_unresponsive"
    if isinstance(answer, Exception):
        raise answer
    return answer


class GpuCollector:
    name = "gpu"

    def __init__(
        self, settings: GpuSettings, deps: CollectorDeps, backend: NvmlBackend | None = None
    ) -> None:
        self.settings = settings
        self.deps = deps
        self.backend = backend or deps.shared.get(NvmlBackend, NvmlBackend)
        self.correlator = shared_correlator(deps)
        self.boot_id = _boot_id()
        self._carry_nvml_counts()
        self._nvml_counts_stored: JSONValue | None = None
        """The NVML thread's last stored snapshot of the Xid counts (`_record_xid`)."""
        self.recurrence = shared_recurrence(deps, lambda: read_boot_id(Path("/proc")))
        self.counters = CounterTracker(deps.state, self.boot_id)
        self.conditions = ConditionTracker(deps.state)
        self.gpus: dict[int, _Gpu] = {}
        self.count: int | None = None
        self.count_read_at = 0.0
        self.nvml_down_reason: str | None = None
        self.next_init_at = 0.0
        self.events_thread: GpuEventThread | None = None
        self.events_started_at = float("-inf")
        self.events_down_reason: str | None = None
        """Why the event thread died, while it is reported dead (one event per outage)."""
        self._start_count_checked = False
        self._stored: dict[str, Any] | None = None
        """IDENTITY_NAMESPACE as stored (loaded on first use)."""
        self._identities_unsaved: set[int] = set()
        self._held: dict[str, str] | None = None
        """subject -> error state ('lost', 'unresponsive') that the ledger held for this
        source when this instance first looked, not yet matched to a GPU (`_adopt_held`)."""
        self._nvml_held_checked = False
        self.owners: dict[int, ProcessOwner | None] = {}
        """pid -> owner (None: not in /proc), for pids on a GPU last round: read once each."""
        self.pci: PciScan | None = None
        self._pci_samples_of: tuple[PciScan, tuple[Sample, ...]] | None = None
        self.pci_read_at: float | None = None
        self.paused = False
        """Released on request (agent/contracts/pause.py): rounds make no NVML call."""
        self._round_lock = asyncio.Lock()
        """Held by a round and by pause(): NVML is never shut down under a round's calls."""
        self._before_pause: dict[str, dict[str, str]] = {}
        """uuid -> labels of the GPUs NVML listed when the pause began, until the first round
        after it has seen them again (a reset that failed leaves one out)."""
        self._unstopped: GpuEventThread | None = None
        """An event thread a pause asked to stop that did not (stuck in the driver): the next
        `pause` (the same pause asked again) waits for it again, and says so while it lives."""
        # The NVML thread's Xids count in the correlator's series, exported while this runs
        # (or the kernel_log collector does): with the kernel log off or unreadable too.
        self.correlator.attach(self, self.name)

    def families(self) -> Sequence[MetricFamily]:
        return m.FAMILIES  # not the Xid series: the correlator's (`SharedSeries`)

    # -- NVML availability ----------------------------------------------------------------------

    async def _ensure_nvml(self, ctx: CollectContext, out: _Round) -> bool:
        if self.backend.up and self._nvml_held_checked:
            return True
        if not self._nvml_held_checked:
            # An outage an earlier instance reported (before a reload or a restart) and the
            # ledger holds: NVML still down is no news, NVML up is its end.
            self._nvml_held_checked = True
            if self.deps.held_by(SOURCE, ("nvml_unavailable",)).get(HOST_SUBJECT):
                self.nvml_down_reason = "reported by an earlier instance"
        if not self.backend.up:
            if ctx.now < self.next_init_at:
                return False
            self.next_init_at = ctx.now + self.settings.nvml_retry_interval
            try:
                await ctx.call("nvml:init", self.backend.start)
            except NvmlUnavailable as exc:
                self._nvml_down(exc.reason, out)
                return False
            except (CallTimedOut, CallStillHung) as exc:
                self._nvml_down(f"nvmlInit did not return ({exc})", out)
                return False
        if self.nvml_down_reason is not None:
            out.events.append(
                Event(
                    source=SOURCE,
                    kind="nvml_available",
                    severity=Severity.INFO,
                    repair_action=RepairAction.NONE,
                    clears=("nvml_unavailable",),
                    subject=HOST_SUBJECT,
                    message="NVML answers again: GPU monitoring resumed",
                )
            )
        self.nvml_down_reason = None
        return True

    def _nvml_down(self, reason: str, out: _Round) -> None:
        self._stop_event_thread()
        self.backend.stop()
        if self.nvml_down_reason is None:  # one finding per outage, not one per retry
            expected = self.settings.expected_gpus
            out.events.append(
                Event(
                    source=SOURCE,
                    kind="nvml_unavailable",
                    severity=Severity.CRITICAL if expected else Severity.WARNING,
                    repair_action=RepairAction.REBOOT_NODE
                    if expected
                    else RepairAction.INVESTIGATE,
                    subject=HOST_SUBJECT,
                    message=f"NVML is not available ({reason}): no NVIDIA driver is loaded or "
                    "libnvidia-ml.so.1 is missing, so no GPU is monitored"
                    + (f" although {expected} are expected" if expected else ""),
                    action="on a GPU host: check that the NVIDIA driver is installed and loaded "
                    "(`lsmod | grep nvidia`, NVRM lines in the kernel log); gpuwarden retries "
                    f"every {self.settings.nvml_retry_interval:g} s. On a host without "
                    "NVIDIA GPUs: set [collectors.gpu] enabled = false",
                    attributes={"reason": reason},
                )
            )
        self.nvml_down_reason = reason
        self.gpus.clear()
        self.count = None

    # -- the round ------------------------------------------------------------------------------

    async def collect(self, ctx: CollectContext) -> Collection:
        async with self._round_lock:
            if self.paused:  # not even sysfs: a reset in progress makes the bus disagree
                return Collection()
            return await self._collect(ctx)

    async def _collect(self, ctx: CollectContext) -> Collection:
        out = _Round()
        self._scan_pci(ctx)
        try:
            if await self._ensure_nvml(ctx, out):
                await self._load_recurrence(ctx)
                await self._collect_gpus(ctx, out)
                self._compare_pci(out)
                self._check_returned(out)
        except NvmlUnavailable as exc:
            self._nvml_down(exc.reason, out)
            out.samples = []
        out.samples.extend(self._pci_samples())
        out.samples.append(m.NVML_UP.sample(1 if self.backend.up else 0))
        if self.settings.expected_gpus:
            out.samples.append(m.GPU_EXPECTED.sample(self.settings.expected_gpus))
        thread = self.events_thread
        if self.backend.up and self.settings.event_thread:
            out.samples.append(
                m.GPU_EVENT_THREAD_UP.sample(1 if thread is not None and thread.running else 0)
            )
        return Collection(samples=out.samples, events=self._named(out.events))

    def _named(self, events: list[Event]) -> list[Event]:
        """A finding about an identified GPU, named by its UUID, carries its PCI address as
        an alias: cleared under either name (an Xid read at boot names the GPU by its
        address; `repairs clear --subject` may name either)."""
        if not events:
            return events
        address = {
            labels["uuid"]: pci
            for pci, labels in self.correlator.identities().items()
            if labels.get("uuid")
        }
        return [
            dataclasses.replace(e, aliases=(address[e.subject],))
            if not e.aliases and e.subject in address
            else e
            for e in events
        ]

    async def _load_recurrence(self, ctx: CollectContext) -> None:
        """The Xid boots in memory before `learn` (which reads no SQL on the loop). A store
        that does not answer costs the GPUs nothing: tried again next round."""
        if not self.recurrence.loaded:
            with contextlib.suppress(CallTimedOut, CallStillHung):
                await ctx.call("gpu:xid_boots", self.recurrence.load)

    def _carry_nvml_counts(self) -> None:
        """Take over the Xid counts the NVML thread of this boot's last life stored with its
        Xids (`NVML_COUNTS`): an Xid it saw after the kernel_log collector's last round
        counts after a kill too. Another boot's, or none: nothing."""
        if self.boot_id is None:
            return
        try:
            saved = self.deps.state.get(*NVML_COUNTS)
        except GpuwardenError:  # unreadable: the kernel_log collector's snapshot alone
            saved = None
        if isinstance(saved, dict) and saved.get("boot") == self.boot_id:
            self.correlator.carry_counts(*parse_snapshot(saved), origin="nvml")
        else:
            # Taken over as nothing, once: what is stored from here on is this process's
            # own counts (a collector made again by a reload took them over a second time).
            self.correlator.carry_counts({}, {}, origin="nvml")

    def _record_xid(self, event: Event | None) -> None:
        """The NVML event thread's Xid sighting, in that thread: its event (an Xid that came
        back after two reboots says so; None: a sighting that raised none) and the Xid counts
        as they are now, stored in one transaction (`CollectorDeps.emit_with`), so that no
        kill -9 leaves the event stored and its count not, or a held-back repeat uncounted."""
        events = [] if event is None else [self.recurrence.escalate(self._named([event])[0])]
        values: dict[tuple[str, str], JSONValue] = {}
        if self.boot_id is not None:
            snapshot: JSONValue = {"boot": self.boot_id, **self.correlator.snapshot()}
            if snapshot != self._nvml_counts_stored:
                values[NVML_COUNTS] = self._nvml_counts_stored = snapshot
        if events or values:
            self.deps.emit_with(events, values)

    def _emit_escalated(self, event: Event) -> None:
        """The NVML event thread's emit: an Xid that came back after two reboots says so (in
        that thread: the recurrence reads the state store)."""
        (named,) = self._named([event])
        self.deps.emit(self.recurrence.escalate(named))

    async def _collect_gpus(self, ctx: CollectContext, out: _Round) -> None:
        # The count is read on the slow interval, not every round: each blocking call is a
        # thread hand-off that costs more than the NVML call (measured on the H200). A GPU that
        # falls off the bus shows at once anyway: its own read answers "lost".
        count = self.count
        if count is None or ctx.now - self.count_read_at >= self.settings.slow_interval:
            count = await ctx.call("nvml:system", self.backend.device_count)
            self.count_read_at = ctx.now
        changed = count != self.count
        if changed:
            self._count_changed(count, out)
        out.samples.append(m.GPU_COUNT.sample(count))
        for index in range(count):
            if index not in self.gpus:
                self.gpus[index] = _Gpu(remembered=self._remembered(index, count))
        # Every GPU's read is started before any is waited for: they run side by side, and
        # no task is made per GPU (a gather costs turns of the loop).
        answers = await ctx.call_each([self._gpu_call(ctx, i, changed) for i in range(count)])
        results = [_gpu_result(answer) for answer in answers]
        for index, result in enumerate(results):
            self._handle_gpu(ctx, index, result, out)
        await self._process_samples(ctx, out)
        if changed:
            self._restart_event_thread(ctx.now)
        elif self.settings.event_thread and any(g.static is not None for g in self.gpus.values()):
            self._check_event_thread(ctx.now, out)

    def _gpu_call(self, ctx: CollectContext, index: int, changed: bool) -> Call[GpuRound]:
        """The blocking call of the GPU's round: which of its reads are due."""
        gpu = self.gpus.setdefault(index, _Gpu())
        static = (
            changed
            or gpu.static is None
            or gpu.error is not None
            or ctx.now - gpu.static_at >= self.settings.static_refresh_interval
        )
        slow = gpu.slow is None or ctx.now - gpu.slow_at >= self.settings.slow_interval
        energy = gpu.energy_at is None or ctx.now - gpu.energy_at >= self.settings.energy_interval
        every = self.settings.gpm_interval
        gpm = bool(every) and (gpu.gpm_at is None or ctx.now - gpu.gpm_at >= every)
        # The one MIG check is the mode read with the static facts: a GPU not in MIG mode
        # costs no MIG call (the lent H200 is not).
        mig = gpu.static is not None and gpu.static.mig_mode is True
        read = functools.partial(self.backend.read_gpu, mig=mig) if mig else self.backend.read_gpu
        return f"nvml:gpu{index}", read, (index, static, slow, energy, gpm)

    def _handle_gpu(
        self, ctx: CollectContext, index: int, result: GpuRound | str, out: _Round
    ) -> None:
        gpu = self.gpus[index]
        if isinstance(result, str):
            labels = gpu.labels(index)
            # Still hung: reported when that call timed out, by this collector or the one a
            # reload replaced (it shares the caller, and so its table of hung calls).
            state = "unresponsive" if result == "still_unresponsive" else result
            self._adopt_held(index, gpu, labels["uuid"])
            if gpu.error != state and result != "still_unresponsive":
                event = self._gpu_error_event(labels, state)
                out.events.append(event)
                if event.subject not in gpu.error_subjects:
                    gpu.error_subjects += (event.subject,)
            gpu.error = state
            gpu.gpm = gpu.gpm_at = gpu.gpm_samples = None  # the backend dropped its sample
            gpu.mig_gpm = {}
            gpu.processes = ()
            out.samples.extend(m.state_samples(labels, state))
            return
        if result.static is not None:
            gpu.static, gpu.static_at, gpu.static_samples = result.static, ctx.now, None
            gpu.slow_samples = gpu.recovery_samples = None  # labels come from the identity
            identity = result.static.identity
            if identity.pci_bus_id:
                self.correlator.set_identity(identity.pci_bus_id, identity.labels())
                # An Xid judged under its address before now may have recurred (_repair.py).
                out.events.extend(self.recurrence.learn(identity.pci_bus_id, identity.labels()))
            self._identities_unsaved.add(index)
        if result.slow is not None:
            gpu.slow, gpu.slow_at, gpu.slow_samples = result.slow, ctx.now, None
        self._keep_readings(gpu, result, ctx.now)
        labels = gpu.labels(index)
        if index in self._identities_unsaved and gpu.static is not None:
            self._remember(index, labels)
        self._adopt_held(index, gpu, labels["uuid"])
        if gpu.error is not None:
            for subject in gpu.error_subjects or (labels["uuid"],):
                out.events.append(
                    Event(
                        source=SOURCE,
                        kind="gpu_recovered",
                        severity=Severity.INFO,
                        repair_action=RepairAction.NONE,
                        clears=HELD_KINDS,
                        subject=subject,
                        attributes=dict(labels),
                        message=f"{where(labels)} answers NVML again (was {gpu.error})",
                    )
                )
            gpu.error, gpu.error_subjects = None, ()
        out.samples.extend(m.state_samples(labels, None, gpu.memo))
        out.samples.extend(m.reading_samples(labels, result.reading, gpu.energy_joules, gpu.memo))
        # The recovery action rarely changes: its samples (one per action) and its conditions
        # are made again only when it does, as are the static and slow samples.
        action = result.reading.recovery_action
        recovery_new = gpu.recovery_samples is None or action != gpu.recovery_seen
        recovery = (
            tuple(m.recovery_samples(labels, action)) if recovery_new else gpu.recovery_samples
        )
        out.samples.extend(recovery or ())
        errors = self._kept_samples(gpu, labels, result, out)
        out.samples.extend(m.error_samples(labels, errors))
        if not labels["uuid"]:
            return  # without a UUID there is no stable key for counters and conditions
        out.events.extend(counter_events(self.counters, labels, result.reading, FAST_COUNTERS))
        if result.slow is not None:
            out.events.extend(counter_events(self.counters, labels, result.slow, SLOW_COUNTERS))
        inputs = condition_inputs(gpu.static, result.reading, gpu.slow, recovery=recovery_new)
        out.events.extend(
            condition_events(
                self.conditions,
                labels,
                inputs,
                {"pcie_link_degraded": _link_detail(gpu.static, result)},
            )
        )
        # Only now: a condition the store could not take is tried again next round.
        gpu.recovery_samples, gpu.recovery_seen = recovery, action

    def _kept_samples(
        self, gpu: _Gpu, labels: dict[str, str], result: GpuRound, out: _Round
    ) -> dict[str, str]:
        """Samples of the readings kept from their own intervals, and MIG's; the field errors
        of them all."""
        errors = dict(result.reading.errors)
        if gpu.static is not None:
            out.samples.extend(gpu.cached_static_samples(labels, gpu.static))
            errors.update(gpu.static.errors)
        if gpu.slow is not None:
            out.samples.extend(gpu.cached_slow_samples(labels, gpu.slow))
            errors.update(gpu.slow.errors)
        if gpu.gpm is not None:
            out.samples.extend(gpu.cached_gpm_samples(labels, gpu.gpm))
            errors.update(gpu.gpm.errors)
        if result.mig is not None:
            out.samples.extend(m.mig_samples(labels, _mig_instances(gpu, result)))
            errors.update(result.mig.errors)
        else:
            gpu.mig_gpm = {}
        self._share_mig_profiles(gpu, labels, result)
        return errors

    def _share_mig_profiles(self, gpu: _Gpu, labels: dict[str, str], result: GpuRound) -> None:
        """Tell the Xid correlator the profile of each GPU instance, when that changed."""
        mig = result.mig
        profiles = {} if mig is None else {i.gpu_instance: i.profile for i in mig.instances}
        if profiles != gpu.mig_profiles and labels["pci_bus_id"]:
            self.correlator.set_mig_profiles(labels["pci_bus_id"], profiles)
            gpu.mig_profiles = profiles

    # -- who uses the GPUs -----------------------------------------------------------------------

    async def _process_samples(self, ctx: CollectContext, out: _Round) -> None:
        """A series per top process, with its owner. Owners are read (one blocking call for
        all new pids) only for pids not on a GPU last round: a steady round reads no /proc."""
        pids = {p.pid for g in self.gpus.values() for p in g.processes}
        self.owners = {pid: o for pid, o in self.owners.items() if pid in pids}
        new = sorted(pids - set(self.owners))
        if new:
            try:
                found = await ctx.call("procfs:owners", _read_owners, self.settings.proc_root, new)
            except (CallTimedOut, CallStillHung):
                found = {}  # /proc itself hangs: pids without owners this round, retried next
            self.owners.update(found)
        for index, gpu in self.gpus.items():
            if not gpu.processes or gpu.error is not None:
                continue
            labels = gpu.labels(index)
            for process in gpu.processes:
                owner = self.owners.get(process.pid)
                assert process.used_memory_bytes is not None  # _top keeps only known sizes
                out.samples.append(
                    m.process_sample(
                        labels, process.used_memory_bytes, *_owner_labels(process.pid, owner)
                    )
                )

    # -- a GPU that never enumerated ----------------------------------------------------------

    def _scan_pci(self, ctx: CollectContext) -> None:
        if (
            self.pci_read_at is not None
            and ctx.now - self.pci_read_at < self.settings.slow_interval
        ):
            return
        self.pci_read_at = ctx.now
        # On the loop, not through ctx.call: vendor, class and device in sysfs are the kernel's
        # copies in struct pci_dev, never a device access, so they cannot hang (0.3 ms for an
        # HGX tree here), and a thread hand-off would cost more than the reads.
        try:
            self.pci = scan_pci(Path(self.settings.sysfs_root))
        except OSError:
            self.pci = None  # no sysfs here (a container without /sys): unknown, not 0

    def _pci_samples(self) -> tuple[Sample, ...]:
        """Made once per scan (every slow_interval), not every round."""
        scan = self.pci
        if scan is None:
            return ()
        if self._pci_samples_of is not None and self._pci_samples_of[0] is scan:
            return self._pci_samples_of[1]
        passed = sum(1 for f in scan.gpus if f.passed_through)
        samples = (
            m.GPUS_PCI.sample(len(scan.gpus) - passed),
            m.GPUS_PCI_PASSTHROUGH.sample(passed),
            m.NVSWITCHES_PCI.sample(len(scan.nvswitches)),
        )
        self._pci_samples_of = (scan, samples)
        return samples

    def _compare_pci(self, out: _Round) -> None:
        """Name each GPU on the bus that NVML does not list, once while it lasts. Only when
        every NVML GPU is identified: one never read has no known address to rule out."""
        scan, count = self.pci, self.count
        if scan is None or count is None:
            return
        known = set()
        for index in range(count):
            address = self.gpus[index].labels(index)["pci_bus_id"] if index in self.gpus else ""
            if not address:
                return
            known.add(address)
        missing = {
            f.address: f for f in scan.gpus if not f.passed_through and f.address not in known
        }
        for function in missing.values():
            out.samples.append(m.PCI_NOT_VISIBLE.sample(1, function.address, function.driver))
        prefix = "not_enumerated:"
        active = {
            n[len(prefix) :] for n in self.conditions.active(HOST_SUBJECT) if n.startswith(prefix)
        }
        visible_on_bus = len(scan.gpus) - sum(1 for f in scan.gpus if f.passed_through)
        for address in sorted(active | set(missing)):
            started = self.conditions.update(HOST_SUBJECT, prefix + address, address in missing)
            if started is None:
                continue
            out.events.append(
                _not_enumerated_event(missing[address], visible_on_bus, count)
                if started
                else Event(
                    source=SOURCE,
                    kind="gpu_not_enumerated_cleared",
                    severity=Severity.INFO,
                    repair_action=RepairAction.NONE,
                    clears=("gpu_not_enumerated",),
                    subject=address,
                    attributes={"pci_bus_id": address},
                    message=f"the GPU at {address} is visible to NVML again",
                )
            )

    def _keep_readings(self, gpu: _Gpu, result: GpuRound, now: float) -> None:
        """The parts read on their own intervals, kept until read again."""
        if result.energy_read:
            gpu.energy_joules, gpu.energy_at = result.reading.energy_joules, now
        if result.gpm_read:  # a reading, or None for a GPU without GPM
            gpu.gpm, gpu.gpm_at, gpu.gpm_samples = result.gpm, now, None
        gpu.processes = _top(result.reading.processes, self.settings.top_processes)

    # -- identity across reloads and restarts -------------------------------------------------

    def _stored_identities(self) -> dict[str, Any]:
        if self._stored is None:
            try:
                self._stored = dict(self.deps.state.items(IDENTITY_NAMESPACE))
            except Exception:  # a store that cannot be read: nothing remembered, not a failure
                self._stored = {}
        return self._stored

    def _remembered(self, index: int, count: int) -> dict[str, str] | None:
        """The stored identity of this index, if stored this boot with this many GPUs:
        another count may mean other indexes (a GPU gone, the driver reloaded)."""
        if self.boot_id is None:
            return None
        record = self._stored_identities().get(str(index))
        if not isinstance(record, dict):
            return None
        labels = record.get("labels")
        if (
            record.get("boot") != self.boot_id
            or record.get("count") != count
            or not isinstance(labels, dict)
            or set(labels) != {"gpu", "uuid", "pci_bus_id", "model"}
            or not all(isinstance(v, str) for v in labels.values())
            or labels["gpu"] != str(index)
        ):
            return None
        return {str(k): str(v) for k, v in labels.items()}

    def _stored_this_boot(self) -> dict[str, dict[str, str]]:
        """uuid -> labels of the GPUs an earlier agent stored this boot: what a collector that
        has read nothing yet (paused before its first round, after a restart) compares the
        GPUs after the pause with."""
        out: dict[str, dict[str, str]] = {}
        for index, record in self._stored_identities().items():
            count = record.get("count") if isinstance(record, dict) else None
            if index.isdigit() and isinstance(count, int):
                labels = self._remembered(int(index), count)
                if labels is not None and labels["uuid"]:
                    out[labels["uuid"]] = labels
        return out

    def _remember(self, index: int, labels: dict[str, str]) -> None:
        """Store who the GPU at `index` is, when that changed. Best effort: a failed write is
        tried again next round, and costs only the name of a GPU that hangs before it is read."""
        if self.boot_id is None or not labels["uuid"]:
            self._identities_unsaved.discard(index)
            return
        record = {"boot": self.boot_id, "count": self.count, "labels": labels}
        stored = self._stored_identities()
        if stored.get(str(index)) != record:
            try:
                self.deps.state.put(IDENTITY_NAMESPACE, str(index), record)
            except Exception:  # the runtime reports a store that cannot write
                return
            stored[str(index)] = record
        self._identities_unsaved.discard(index)

    def _adopt_held(self, index: int, gpu: _Gpu, uuid: str) -> None:
        """Take over what an earlier instance (before a reload or a restart) raised for this
        GPU and the ledger still holds: its error state, so that the GPU that still does not
        answer is no news, and the one that answers again gets its gpu_recovered. Held
        under its UUID, or under its index where it was never read."""
        if self._held is None:
            self._held = {
                subject: "lost" if "gpu_lost" in kinds else "unresponsive"
                for subject, kinds in self.deps.held_by(SOURCE, HELD_KINDS).items()
            }
        if not self._held:
            return
        for subject in (uuid, str(index)):
            state = self._held.pop(subject, None) if subject else None
            if state is None:
                continue
            gpu.error = gpu.error or state
            if subject not in gpu.error_subjects:
                gpu.error_subjects += (subject,)

    def _gpu_error_event(self, labels: Mapping[str, str], state: str) -> Event:
        if state == "lost":
            return Event(
                source=SOURCE,
                kind="gpu_lost",
                severity=Severity.CRITICAL,
                repair_action=RepairAction.REBOOT_NODE,
                subject=labels["uuid"] or labels["gpu"],
                attributes=dict(labels),
                message=f"{where(labels)} is lost: NVML says the GPU has fallen off the bus or "
                "needs a reset",
                action="drain the node; look for Xid 79 in the kernel log; reboot the host. "
                "If it returns after a reboot, have the GPU and its slot inspected",
            )
        return Event(
            source=SOURCE,
            kind="gpu_unresponsive",
            severity=Severity.CRITICAL,
            repair_action=RepairAction.RESET_GPU,
            subject=labels["uuid"] or labels["gpu"],
            attributes=dict(labels),
            message=f"{where(labels)} does not answer NVML within "
            f"{self.settings.timeout:g} s; it is not asked again until the call returns",
            action="look for Xid errors and NVRM messages in the kernel log; drain the node and "
            "reset the GPU or reboot if it stays unresponsive",
        )

    def _count_changed(self, count: int, out: _Round) -> None:
        previous = self.count
        expected = self.settings.expected_gpus
        if not self._start_count_checked:
            # The highest count ever seen, not the last one: storing the current count made a
            # lost GPU silent from the second restart on. Only expected_gpus lowers it (a GPU
            # removed on purpose); while it is set, gpus_missing reports a shortfall instead.
            stored = self.deps.state.get(STATE_NAMESPACE, "count_at_start")
            highest = stored if isinstance(stored, int) else None
            self.deps.state.put(
                STATE_NAMESPACE, "count_at_start", expected or max(count, highest or 0)
            )
            self._start_count_checked = True
            if not expected and highest is not None and count < highest:
                out.events.append(
                    Event(
                        source=SOURCE,
                        kind="gpu_count_dropped",
                        severity=Severity.CRITICAL,
                        repair_action=RepairAction.REBOOT_NODE,
                        subject=HOST_SUBJECT,
                        attributes={"visible": count, "before": highest},
                        message=f"{count} GPUs visible, {highest} at an earlier start of the agent",
                        action="look for Xid 79 / 'fallen off the bus' in the kernel log and for GPUs "
                        "missing from lspci; reboot; if still missing, inspect the hardware; "
                        "if it was removed on purpose, set [collectors.gpu] expected_gpus",
                    )
                )
        self.count = count
        for index in [i for i in self.gpus if i >= count]:
            del self.gpus[index]
        if previous is not None and count < previous:
            out.events.append(
                Event(
                    source=SOURCE,
                    kind="gpu_count_dropped",
                    severity=Severity.CRITICAL,
                    repair_action=RepairAction.REBOOT_NODE,
                    subject=HOST_SUBJECT,
                    attributes={"visible": count, "before": previous},
                    message=f"{count} GPUs visible, {previous} a round ago",
                    action="look for Xid 79 / 'fallen off the bus' in the kernel log; drain and reboot",
                )
            )
        if expected:
            started = self.conditions.update(HOST_SUBJECT, "gpus_missing", count < expected)
            if started is not None:
                out.events.append(
                    Event(
                        source=SOURCE,
                        kind="gpus_missing" if started else "gpus_missing_cleared",
                        severity=Severity.CRITICAL if started else Severity.INFO,
                        repair_action=RepairAction.REBOOT_NODE if started else RepairAction.NONE,
                        clears=() if started else ("gpus_missing", "gpu_count_dropped"),
                        subject=HOST_SUBJECT,
                        attributes={"visible": count, "expected": expected},
                        message=f"{count} GPUs visible, {expected} expected"
                        if started
                        else f"all {expected} expected GPUs are visible again",
                        action="look for Xid 79 / 'fallen off the bus' in the kernel log and for GPUs "
                        "missing from lspci; reboot; if still missing, inspect the hardware"
                        if started
                        else "",
                    )
                )

    # -- the event thread ---------------------------------------------------------------------

    def _identities(self) -> dict[str, dict[str, str]]:
        return {
            g.static.identity.pci_bus_id: g.static.identity.labels()
            for g in list(self.gpus.values())
            if g.static is not None
        }

    def _check_event_thread(self, now: float, out: _Round) -> None:
        """Start the thread if there is none; restart it if it died (NVML error, registration
        failure, a bug in a handler), at most once per nvml_retry_interval so that a thread
        that dies at once is not restarted every round."""
        thread = self.events_thread
        if thread is not None and thread.running:
            if thread.registered:
                self.events_down_reason = None  # registered and waiting: healthy again
            return
        if thread is not None and self.events_down_reason is None:
            reason = thread.error or "the thread ended"
            self.events_down_reason = reason
            out.events.append(
                Event(
                    source=SOURCE,
                    kind="nvml_event_thread_stopped",
                    severity=Severity.WARNING,
                    repair_action=RepairAction.NONE,
                    subject=HOST_SUBJECT,
                    attributes={"reason": reason},
                    message=f"the NVML event thread stopped ({reason}): Xid and ECC events are "
                    "not seen as they happen until it runs again",
                    action=f"gpuwarden restarts it every {self.settings.nvml_retry_interval:g} s; "
                    "if it keeps stopping, check the agent's log and the kernel log",
                )
            )
        if thread is None or now - self.events_started_at >= self.settings.nvml_retry_interval:
            self._restart_event_thread(now)

    def _restart_event_thread(self, now: float) -> None:
        self._stop_event_thread()
        if not self.settings.event_thread:
            return
        gpus = [
            (i, g.static.supported_event_types)
            for i, g in self.gpus.items()
            if g.static is not None and g.error is None
        ]
        if not gpus:
            return
        thread = GpuEventThread(
            self.backend,
            self.correlator,
            self._emit_escalated,
            gpus,
            self._identities,
            wait_ms=self.settings.event_wait_ms,
            record_xid=self._record_xid,
        )
        thread.start()
        self.events_thread = thread
        self.events_started_at = now

    def _stop_event_thread(self) -> None:
        thread, self.events_thread = self.events_thread, None
        if thread is not None:
            thread.request_stop()  # it ends within one wait; never join on the event loop

    async def close(self) -> None:
        self.correlator.detach(self)
        if self._unstopped is not None:
            self._unstopped.request_stop()  # stuck in the driver: not joined here
        thread, self.events_thread = self.events_thread, None
        if thread is not None:
            await asyncio.to_thread(thread.stop)

    # -- pause and resume (agent/contracts/pause.py) -------------------------------------------

    async def pause(self) -> Released:
        """Let go of NVML: no round from now on calls it; the round in flight ends first
        (NVML is never shut down under a call), then the event thread is stopped and joined,
        NVML shut down and held shut for the whole process, and this process's NVIDIA device
        files counted (none may be left for `nvidia-smi -r`)."""
        again = self.paused  # the same pause asked again: what held on before is asked again
        self.paused = True
        async with self._round_lock:
            # The running thread, and one an earlier pause could not stop (still in the
            # driver, or ended since: then stop() says so at once).
            threads = [t for t in (self.events_thread, self._unstopped) if t is not None]
            self.events_thread = None
            if threads:
                self._unstopped = threads[-1]  # known until it has ended, cancelled or not
                wait = self.settings.event_wait_ms / 1000.0 + 5.0
                for thread in threads:
                    thread.request_stop()  # all at once: each ends within one wait
                alive = [t for t in threads if not await asyncio.to_thread(t.stop, wait)]
                if alive:
                    self._unstopped = alive[0]
                    self.backend.hold("gpuwarden pause", 0.0)  # no new call, nothing shut
                    return Released(
                        self.name,
                        False,
                        f"the NVML event thread did not stop within {wait:g} s (a call into "
                        "the driver that does not return); NVML stays initialised: stop the "
                        "agent to release the GPUs",
                    )
                self._unstopped = None
            if not (again and self._before_pause):  # asked again, the readings are gone
                self._before_pause = {
                    g.static.identity.uuid: g.static.identity.labels()
                    for g in self.gpus.values()
                    if g.static is not None and g.static.identity.uuid
                } or self._stored_this_boot()
            was_up = self.backend.up
            wait = self.settings.timeout + 1.0
            if not await asyncio.to_thread(self.backend.hold, "gpuwarden pause", wait):
                # nvmlShutdown under a call that never returned could wedge the process.
                return Released(
                    self.name,
                    False,
                    f"an NVML call has not returned within {wait:g} s; NVML is not shut down "
                    "under it (no new call is made): stop the agent to release the GPUs",
                )
            left = await asyncio.to_thread(
                open_files, Path(self.settings.proc_root), "self", self.backend.device_prefix
            )
            self._forget_readings()
            if left:
                return Released(
                    self.name,
                    False,
                    "NVML is shut down, but the agent still holds " + ", ".join(left),
                )
            done = (
                "NVML shut down"
                if was_up
                else "NVML stays shut down"
                if again
                else "NVML was not initialised"
            )
            return Released(
                self.name, True, f"{done}, event thread stopped, no NVIDIA device file open"
            )

    async def resume(self) -> None:
        """Lift the hold: the next round initialises NVML, reads every GPU afresh (static
        facts, slow readings, energy, GPM), starts the event thread again and reports a GPU
        that did not come back."""
        async with self._round_lock:
            self.backend.release()
            self.next_init_at = 0.0
            self.count_read_at = float("-inf")
            self.paused = False

    def _forget_readings(self) -> None:
        """Nothing read before the pause is kept: a reset or a MIG change may have changed it.
        The count stays, so that fewer GPUs after the pause is a drop; so do each GPU's error
        state (one lost before is lost or recovered after, never news twice) and who it was (a
        GPU that hangs at once is still named)."""
        self.gpus = {
            index: _Gpu(
                error=gpu.error,
                error_subjects=gpu.error_subjects,
                remembered=gpu.labels(index) if gpu.static else gpu.remembered,
            )
            for index, gpu in self.gpus.items()
        }
        self.owners.clear()
        self.pci = None
        self.pci_read_at = None

    def _check_returned(self, out: _Round) -> None:
        """After a pause: each GPU listed before it that NVML does not list now is lost (the
        reset failed, or the GPU fell off the bus). Lost at its index is reported by the GPU's
        own read; this is the GPU that is not enumerated at all."""
        if not self._before_pause:
            return
        before, self._before_pause = self._before_pause, {}
        # A GPU that did not answer this round is reported by its own read, under the name
        # it had before the pause.
        accounted = {g.labels(i)["uuid"] for i, g in self.gpus.items()}
        for uuid, labels in sorted(before.items()):
            if uuid in accounted:
                continue
            out.events.append(
                Event(
                    source=SOURCE,
                    kind="gpu_lost",
                    severity=Severity.CRITICAL,
                    repair_action=RepairAction.REBOOT_NODE,
                    subject=uuid,
                    attributes={**labels, "after_pause": True},
                    message=f"{where(labels)} did not come back after the pause: NVML no "
                    "longer lists it (a GPU reset or MIG change that failed?)",
                    action="look for Xid 79 and NVRM errors in the kernel log and for the GPU "
                    "in lspci; drain the node and reboot it",
                )
            )


def _boot_id() -> str | None:
    """This boot's id, which tells volatile counters (restarted at 0 by a reboot) apart from
    the last boot's; None where /proc does not have it."""
    try:
        return read_boot_id(Path("/proc"))
    except OSError:
        return None


def _not_enumerated_event(function: Any, on_bus: int, visible: int) -> Event:
    driver = (
        f"bound to the {function.driver} driver"
        if function.driver
        else "no driver bound: the NVIDIA driver did not probe it"
    )
    return Event(
        source=SOURCE,
        kind="gpu_not_enumerated",
        severity=Severity.CRITICAL,
        repair_action=RepairAction.REBOOT_NODE,  # a GPU missing from NVML
        subject=function.address,
        attributes={
            "pci_bus_id": function.address,
            "driver": function.driver,
            "on_bus": on_bus,
            "visible": visible,
        },
        message=f"the GPU at {function.address} is on the PCI bus but NVML does not see it "
        f"({driver}); {on_bus} NVIDIA GPUs on the bus, {visible} visible to NVML",
        action=f"look for NVRM errors naming {function.address} in the kernel log "
        "(RmInitAdapter failed, fallen off the bus); reboot; if it does not come up again, "
        "have the GPU and its slot inspected",
    )


def _mig_instances(gpu: _Gpu, result: GpuRound) -> list[MigInstance]:
    """This round's MIG instances, each with its GPM: read this round, or the last reading
    of the same instance between GPM reads."""
    assert result.mig is not None
    keyed = {
        (i.gpu_instance, tuple(d.uuid for d in i.compute_instances)): i
        for i in result.mig.instances
    }
    if result.gpm_read:
        gpu.mig_gpm = {key: i.gpm for key, i in keyed.items() if i.gpm is not None}
        return list(keyed.values())
    gpu.mig_gpm = {key: g for key, g in gpu.mig_gpm.items() if key in keyed}
    return [dataclasses.replace(i, gpm=gpu.mig_gpm.get(key)) for key, i in keyed.items()]


def _top(processes: tuple[GpuProcess, ...] | None, limit: int) -> tuple[GpuProcess, ...]:
    """The `limit` largest by memory; a process whose memory NVML cannot tell is counted
    (gpuwarden_gpu_compute_processes) but has no series: it has no value to give."""
    if not processes or limit <= 0:
        return ()
    known = [p for p in processes if p.used_memory_bytes is not None]
    known.sort(key=lambda p: (-(p.used_memory_bytes or 0.0), p.pid))
    return tuple(known[:limit])


def _read_owners(proc_root: str, pids: list[int]) -> dict[int, ProcessOwner | None]:
    root = Path(proc_root)
    return {pid: read_owner(root, pid) for pid in pids}


def _owner_labels(pid: int, owner: ProcessOwner | None) -> tuple[str, ...]:
    """The PROCESS_LABELS values; only the pid where /proc does not have the process (it
    left, or it lives in another pid namespace than the agent)."""
    if owner is None:
        return (str(pid), "", "", "", "", "")
    c = owner.cgroup
    return (str(pid), owner.name, owner.user, c.unit, c.container_id, c.pod_uid)


def _link_detail(static: GpuStatic | None, result: GpuRound) -> str:
    r = result.reading
    if static is None:
        return ""
    return (
        f" (generation {r.pcie_generation} of {static.pcie_generation_max}, "
        f"width x{r.pcie_width} of x{static.pcie_width_max})"
    )


SPEC = CollectorSpec(
    name="gpu",
    description="NVIDIA GPUs through NVML: telemetry, ECC, row remapping, PCIe, NVLink, Xid events",
    settings_type=GpuSettings,
    factory=GpuCollector,
)
