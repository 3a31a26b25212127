"""The NVML event thread: Xid and ECC events as they happen, between collection rounds.

One daemon thread waits on an NVML event set (`nvmlEventSetWait_v2` with a timeout, so it sees
its stop flag at least once per timeout). Each GPU registers only the event types it supports
(`nvmlDeviceGetSupportedEventTypes`; the lent H200 answers 0xff9f). Xids go to the shared
`XidCorrelator`: the first sighting of an Xid is an event at once, the kernel log's twin a
confirmation of it. Xid and ECC events go out through the runtime's thread-safe `emit`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import structlog

from agent.contracts.model import AttributeValue, Event, RepairAction, Severity
from collectors._nvml import (
    EVENT_DOUBLE_BIT_ECC,
    EVENT_SINGLE_BIT_ECC,
    EVENT_XID,
    GpuLost,
    NvmlBackend,
    NvmlError,
    NvmlEventRecord,
    NvmlUnavailable,
)
from collectors._xid import XidCorrelator, XidObservation, mig_description

log = structlog.get_logger(component="gpu_events")

WANTED_EVENTS: Final = EVENT_XID | EVENT_SINGLE_BIT_ECC | EVENT_DOUBLE_BIT_ECC
ERROR_BACKOFF_SECONDS: Final = 1.0


class GpuEventThread:
    """Start with `start()`, stop with `stop()` (flag + join) or `request_stop()` (flag only).
    Not restartable: make a new one."""

    def __init__(
        self,
        backend: NvmlBackend,
        correlator: XidCorrelator,
        emit: Callable[[Event], None],
        gpus: Sequence[tuple[int, int | None]],
        identities: Callable[[], Mapping[str, Mapping[str, str]]],
        *,
        wait_ms: int = 1000,
        record_xid: Callable[[Event | None], None] | None = None,
    ) -> None:
        """`gpus`: (index, supported event mask or None when unknown) per GPU.
        `identities`: pci_bus_id -> GPU labels, for ECC event text. `record_xid`: called in
        this thread after every Xid sighting, with its event or None (a repeat, an incident
        the holdoff held back: counted, no event), to store the event with the counts it
        changed; without it an Xid's event goes to `emit` and the counts are not stored."""
        self._record_xid = record_xid
        self._backend = backend
        self._correlator = correlator
        self._emit = emit
        self._gpus = tuple(gpus)
        self._identities = identities
        self._wait_ms = wait_ms
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._event_set: Any = None
        self.registered: dict[int, int] = {}
        """GPU index -> event mask registered."""
        self.error = ""
        self.ready = threading.Event()
        """Set once registration is over (successful or not)."""

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the thread; it creates the event set and registers the GPUs itself, so that a
        GPU that hangs in registration holds this thread, never the event loop."""
        self._thread = threading.Thread(target=self._run, name="gpuwarden-nvml-events", daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """Ask the thread to stop; it ends within one wait timeout and frees its event set."""
        self._stop.set()

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop and join; True when the thread has ended."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def _register(self) -> bool:
        event_set = self._backend.event_set_create()
        if event_set is None:
            self.error = "NVML event sets are not supported"
            return False
        self._event_set = event_set
        for index, supported in self._gpus:
            mask = WANTED_EVENTS & (supported if supported is not None else 0)
            try:
                if mask and self._backend.register_events(index, mask, event_set):
                    self.registered[index] = mask
            except GpuLost:
                continue  # the collector reports the lost GPU
        if not self.registered:
            self.error = "no GPU supports Xid or ECC events"
            return False
        return True

    def _run(self) -> None:
        try:
            if self._register():
                self.ready.set()
                self._loop()
        except NvmlError as exc:
            self.error = f"NVML event thread stopped: {exc}"
            log.warning("NVML event thread stopped", error=self.error)
        except Exception as exc:  # emit or the correlator failed: record why, for the collector
            self.error = f"NVML event thread failed: {type(exc).__name__}: {exc}"
            log.exception("NVML event thread failed")
        finally:
            self.ready.set()
            if self._event_set is not None:
                self._backend.event_set_free(self._event_set)
                self._event_set = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                record = self._backend.wait_event(self._event_set, self._wait_ms)
            except NvmlUnavailable:
                raise
            except NvmlError as exc:  # GpuLost included
                # A lost GPU can make the wait fail; the collector reports it. Do not spin.
                self.error = str(exc)
                self._stop.wait(ERROR_BACKOFF_SECONDS)
                continue
            if record is not None:
                self.handle(record)

    def handle(self, record: NvmlEventRecord) -> None:
        now = time.time()
        if record.event_type & EVENT_XID:
            # Raised at first sight, here and now: nothing waits for the kernel log's twin,
            # which becomes a confirmation of this event if it comes.
            event = self._correlator.observe(
                XidObservation(
                    source="nvml",
                    pci_bus_id=record.pci_bus_id,
                    code=record.data,
                    time=now,
                    text=f"NVML Xid critical error event, Xid {record.data}",
                    details=_instances(record),
                )
            )
            if self._record_xid is not None:  # counted with or without an event
                self._record_xid(event)
            elif event is not None:
                self._emit(event)
        ecc = record.event_type & (EVENT_SINGLE_BIT_ECC | EVENT_DOUBLE_BIT_ECC)
        if ecc:
            self._emit(self._ecc_event(record, now, double=bool(ecc & EVENT_DOUBLE_BIT_ECC)))

    def _ecc_event(self, record: NvmlEventRecord, now: float, double: bool) -> Event:
        labels = dict(self._identities().get(record.pci_bus_id, {}))
        name = f"GPU {labels.get('gpu', '?')} ({record.pci_bus_id})"
        name += mig_description(_instances(record))
        if double:
            return Event(
                source="gpu",
                kind="ecc_double_bit_event",
                severity=Severity.CRITICAL,
                repair_action=RepairAction.RESET_GPU,
                subject=labels.get("uuid", record.pci_bus_id),
                time=now,
                message=f"{name}: NVML reported a double-bit (uncorrectable) ECC error",
                action="restart the job that used this GPU; if it repeats, drain the node and "
                "reset the GPU; check for a pending row remap",
                attributes={**labels, "pci_bus_id": record.pci_bus_id, **_instances(record)},
            )
        return Event(
            source="gpu",
            kind="ecc_single_bit_event",
            severity=Severity.INFO,
            repair_action=RepairAction.NONE,
            subject=labels.get("uuid", record.pci_bus_id),
            time=now,
            message=f"{name}: NVML reported a single-bit (corrected) ECC error",
            action="none needed for single events; watch the rate",
            attributes={**labels, "pci_bus_id": record.pci_bus_id, **_instances(record)},
        )


def _instances(record: NvmlEventRecord) -> dict[str, AttributeValue]:
    """The MIG instances NVML's event data names (gpuInstanceId, computeInstanceId), under
    the attribute names the kernel log's `GPU-I:`/`GPU-CI:` use; none without MIG."""
    out: dict[str, AttributeValue] = {}
    if record.gpu_instance is not None:
        out["gpu_instance"] = record.gpu_instance
    if record.compute_instance is not None:
        out["compute_instance"] = record.compute_instance
    return out
