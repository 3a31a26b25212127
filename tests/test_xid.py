"""The Xid catalog, PCI id normalisation and the correlator that makes one event of two sources."""

from __future__ import annotations

import json
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.contracts.model import Event, Severity
from collectors._xid import (
    XidCorrelator,
    XidObservation,
    XidSource,
    build_xid_event,
    normalize_pci_bus_id,
)
from collectors._xid_catalog import CATALOG_PATH, catalog_source, known_codes, lookup, lookup_sxid

PCI = "0000:3b:00.0"
IDENTITY = {
    "gpu": "3",
    "uuid": "GPU-5b3c1d2e",
    "pci_bus_id": "00000000:3B:00.0",
    "model": "NVIDIA H200",
}


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def obs(
    source: XidSource, at: float, code: int = 79, pci: str = PCI, predates: bool = False
) -> XidObservation:
    return XidObservation(
        source=source,
        pci_bus_id=pci,
        code=code,
        time=at,
        text=f"{source} text",
        predates_agent=predates,
    )


class TestCatalog:
    """The catalog is data with a source; every entry is complete; unknown codes stay visible."""

    def test_entries_are_complete(self) -> None:
        """Every entry has a name, meaning, fault, severity and action."""
        data = json.loads(CATALOG_PATH.read_text())
        assert "NVIDIA" in data["source"]
        assert catalog_source() == data["source"]
        for code in known_codes():
            info = lookup(code)
            assert info.known
            assert info.name
            assert info.meaning
            assert info.action
            # Codes only the driver's header names (173-176) have no published fault yet.
            allowed = ("application", "node", "either")
            assert info.fault in allowed or info.source == "open-gpu-kernel-modules"

    def test_field_notes_codes_are_present(self) -> None:
        """The codes operators act on (docs/MEASUREMENTS.md) are all in the catalog."""
        for code in (
            13,
            31,
            43,
            45,
            46,
            48,
            54,
            62,
            63,
            64,
            74,
            79,
            92,
            94,
            95,
            109,
            110,
            119,
            120,
            136,
            140,
            143,
            *range(144, 152),
            154,
            155,
            156,
            158,
        ):
            assert lookup(code).known, code

    def test_application_faults_are_not_critical(self) -> None:
        """13, 31, 43, 45 are usually the application's fault: at most a warning."""
        for code in (13, 31, 43, 45):
            assert lookup(code).fault == "application"
            assert lookup(code).severity <= Severity.WARNING
        assert lookup(79).severity is Severity.CRITICAL

    def test_unknown_code(self) -> None:
        """An unknown code is reported as unknown, with a way forward."""
        info = lookup(31337)
        assert (info.known, info.fault, info.severity) == (False, "unknown", Severity.WARNING)
        assert "31337" in info.meaning
        assert "31337" in info.action

    def test_sxid_fatal_from_text(self) -> None:
        """SXid severity follows the fatal / non-fatal word in the text."""
        assert lookup_sxid(1, "Fatal, Link 2").severity is Severity.CRITICAL
        assert lookup_sxid(1, "Non-fatal, Link 2").severity is Severity.WARNING
        assert lookup_sxid(1, "Severity 0 Engine").severity is Severity.WARNING


class TestNormalize:
    """Any PCI address form becomes `0000:3b:00.0`."""

    @pytest.mark.parametrize(
        ("text", "expected"),
        [
            ("PCI:0000:3b:00", "0000:3b:00.0"),
            ("0000:3B:00", "0000:3b:00.0"),
            ("00000000:3B:00.0", "0000:3b:00.0"),
            ("3b:00.1", "0000:3b:00.1"),
            ("0001:0a:1f.7", "0001:0a:1f.7"),
        ],
    )
    def test_forms(self, text: str, expected: str) -> None:
        """Kernel, NVML and short forms agree."""
        assert normalize_pci_bus_id(text) == expected

    @pytest.mark.parametrize(
        ("domain", "linux"),
        [
            ("", "0000"),  # no domain: 0
            ("0000", "0000"),
            ("00000000", "0000"),
            ("abcd", "abcd"),
            ("ABCD", "abcd"),
            ("0000abcd", "abcd"),
            ("10000", "10000"),  # Intel VMD's first domain (drivers/pci/controller/vmd.c)
            ("1000A", "1000a"),
            ("00010000", "10000"),  # NVML's 8 digits of the same domain
            ("7870f", "7870f"),
            ("fffffffe", "fffffffe"),
            ("FFFFFFFF", "ffffffff"),
        ],
    )
    @pytest.mark.parametrize("prefix", ["", "PCI:", "pci:"])
    @pytest.mark.parametrize(
        ("bdf", "tail"), [("3b:00", ".0"), ("3B:1F.7", ".7"), ("3b:00.0", ".0")]
    )
    def test_any_domain_width(
        self, domain: str, linux: str, prefix: str, bdf: str, tail: str
    ) -> None:
        """A domain of 4 to 8 hex digits (Linux writes `%04x`, NVML `%08X`), either case, with
        and without the function: the Linux form, the same for the kernel's and NVML's text."""
        text = f"{prefix}{domain}:{bdf}" if domain else f"{prefix}{bdf}"
        expected = f"{linux}:{bdf.lower()[:5]}{tail}"
        assert normalize_pci_bus_id(text) == expected
        assert normalize_pci_bus_id(expected) == expected

    @pytest.mark.parametrize(
        "text", ["100000000:3b:00.0", "000:3b:00.0", "1:3b:00.0", "10000:3b:0.0", "10000:3b:00.8"]
    )
    def test_not_an_address(self, text: str) -> None:
        """More than 8 or fewer than 4 domain digits, a short device or a function past 7."""
        with pytest.raises(ValueError, match="not a PCI address"):
            normalize_pci_bus_id(text)

    @given(st.text(max_size=30))
    def test_any_text(self, text: str) -> None:
        """Anything else raises ValueError; a result is always in the canonical form."""
        try:
            out = normalize_pci_bus_id(text)
        except ValueError:
            return
        assert normalize_pci_bus_id(out) == out


class TestCorrelator:
    """The same Xid from the kernel log and NVML is one alert: the first sighting's event,
    and a confirmation (tests/test_xid_delivery.py holds the first-sight class)."""

    def test_the_event_names_the_gpu(self) -> None:
        correlator = XidCorrelator(window=5.0, clock=FakeClock(1000.0))
        correlator.set_identity(PCI, IDENTITY)
        event = correlator.observe(obs("nvml", 1000.0))
        assert event is not None
        assert "seen by nvml" in event.message
        assert event.subject == "GPU-5b3c1d2e"
        assert event.attributes["gpu"] == "3"
        assert event.attributes["model"] == "NVIDIA H200"
        assert event.severity is Severity.CRITICAL
        assert event.action == lookup(79).action
        follow = correlator.observe(obs("kmsg", 999.8))
        assert follow is not None and follow.kind == "xid_confirmed"
        assert follow.subject == "GPU-5b3c1d2e"
        assert correlator.counts == {(PCI, 79): 1}

    def test_an_unknown_gpu_is_named_by_its_address(self) -> None:
        correlator = XidCorrelator(window=5.0, clock=FakeClock(1000.0))
        event = correlator.observe(obs("kmsg", 1000.0))
        assert event is not None
        assert event.attributes["gpu"] == ""
        assert event.subject == PCI

    def test_window_expiry_makes_two_incidents(self) -> None:
        """The same code on the same GPU far apart in time is two events."""
        correlator = XidCorrelator(window=5.0, clock=FakeClock(1000.0), holdoff=0.0)
        events = [correlator.observe(obs("kmsg", at)) for at in (1000.0, 1100.0)]
        assert all(e is not None and e.kind == "xid" for e in events)
        assert correlator.counts == {(PCI, 79): 2}

    def test_holdoff_after_an_event(self) -> None:
        """New incidents soon after an event are counted, not raised; the next event says so."""
        correlator = XidCorrelator(window=5.0, clock=FakeClock(1000.0), holdoff=300.0)
        events = [correlator.observe(obs("kmsg", at, code=13)) for at in (1000, 1060, 1120, 1400)]
        raised = [e for e in events if e is not None]
        assert [e.time for e in raised] == [1000.0, 1400.0]
        assert raised[1].attributes["repeats_since_last_event"] == 2
        assert correlator.counts == {(PCI, 13): 4}
        assert correlator.held_back == 2

    def test_a_held_back_incident_confirmed_is_counted_not_raised(self) -> None:
        correlator = XidCorrelator(window=5.0, clock=FakeClock(1000.0), holdoff=300.0)
        assert correlator.observe(obs("kmsg", 1000.0, code=13)) is not None
        assert correlator.observe(obs("kmsg", 1060.0, code=13)) is None
        assert correlator.observe(obs("nvml", 1060.2, code=13)) is None
        assert correlator.confirmations == {(PCI, 13): 1}
        assert correlator.counts == {(PCI, 13): 2}

    def test_a_burst_of_both_sources_counts_the_larger(self) -> None:
        """Three lines and three NVML events of one burst: three Xids, one event."""
        correlator = XidCorrelator(window=5.0, clock=FakeClock(1000.0))
        raised = [
            correlator.observe(obs(source, 1000.0 + offset))
            for source in ("kmsg", "nvml")
            for offset in (0.0, 0.5, 1.0)
        ]
        assert [e.kind for e in raised if e is not None] == ["xid", "xid_confirmed"]
        assert correlator.counts == {(PCI, 79): 3}

    def test_predating_backlog_is_one_event_per_gpu_and_code(self) -> None:
        """500 old lines of the same Xid: one event at once, marked, saying 500."""
        correlator = XidCorrelator(window=5.0, clock=FakeClock(5000.0))
        [event] = correlator.observe_backlog(
            [obs("kmsg", 100.0 + i, code=13, predates=True) for i in range(500)]
        )
        assert event.attributes["predates_agent"] is True
        assert "before the agent started" in event.message
        assert event.attributes["occurrences"] == 500
        assert event.time == 100.0
        assert correlator.counts == {(PCI, 13): 500}

    @pytest.mark.parametrize("lines", [1, 3])
    @pytest.mark.parametrize("source", ["nvml", "kmsg"])
    @pytest.mark.parametrize(
        ("delay", "kind"),
        [(0.2, "twin"), (4.9, "twin"), (5.5, None), (120.0, None), (299.0, None), (301.0, "xid")],
    )
    def test_a_live_sighting_after_a_backlog_event_is_its_twin_or_held_back(
        self, lines: int, source: XidSource, delay: float, kind: str | None
    ) -> None:
        """The backlog's event is an Xid event like any other: the other source's sighting
        within the window of its time (its first line's, as a restart's `seed` reads it back)
        confirms it, the same source's is a repeat, and new incidents within the holdoff
        raise no event. The fault harness found an NVML Xid
        0.7 s after a kernel-log line the restarted agent read as backlog raised a second
        alert (tests/test_chaos.py: a line logged just before a kill -9, read again at start)."""
        correlator = XidCorrelator(window=5.0, clock=FakeClock(2000.0))
        backlog = [obs("kmsg", 1000.0 + i, predates=True) for i in range(lines)]
        [event] = correlator.observe_backlog(backlog)
        live = correlator.observe(obs(source, event.time + delay))
        twin = kind == "twin"
        if twin and source == "nvml":
            assert live is not None and live.kind == "xid_confirmed", live
            assert live.attributes["confirms"] == event.id
        elif kind == "xid":
            assert live is not None and live.kind == "xid", live
        else:  # a repeat of the same source, or an incident the holdoff holds back
            assert live is None, live
        counted = lines + (0 if twin and source == "nvml" else 1)
        assert correlator.counts == {(PCI, 79): counted}
        assert correlator.confirmations == ({(PCI, 79): 1} if twin and source == "nvml" else {})

    def test_custom_builder(self) -> None:
        """set_builder replaces the default; occurrences are still added."""
        correlator = XidCorrelator(window=0.0, clock=FakeClock(0.0))
        correlator.set_builder(
            lambda o, s, i: Event(
                source="t", kind="x", severity=Severity.INFO, message=f"{o.code} {sorted(s)}"
            )
        )
        event = correlator.observe(obs("nvml", 0.0))
        assert event is not None
        assert event.message == "79 ['nvml']"
        assert event.attributes["occurrences"] == 1

    def test_default_builder_unknown_code(self) -> None:
        """An unknown code still gives a full event."""
        event = build_xid_event(obs("kmsg", 0.0, code=4242), frozenset({"kmsg"}), {})
        assert "4242" in event.message
        assert event.attributes["known"] is False

    def test_thread_safety_smoke(self) -> None:
        """Both sources on threads: each Xid is one event and one confirmation, counted once."""
        correlator = XidCorrelator(window=5.0, clock=FakeClock(1000.0))
        codes = range(40)
        events: list[Event] = []
        lock = threading.Lock()

        def observer(source: XidSource) -> None:
            for code in codes:
                event = correlator.observe(obs(source, 1000.0, code=code))
                if event is not None:
                    with lock:
                        events.append(event)

        threads = [threading.Thread(target=observer, args=(s,)) for s in ("kmsg", "nvml")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        kinds = sorted(e.kind for e in events)
        assert kinds == ["xid"] * len(codes) + ["xid_confirmed"] * len(codes)
        assert correlator.counts == {(PCI, code): 1 for code in codes}


RESET_REQUIRED = "154, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)"
BACK_TO_NONE = "154, GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)"


def said(source: XidSource, at: float, text: str, predates: bool = False) -> XidObservation:
    return XidObservation(
        source=source, pci_bus_id=PCI, code=154, time=at, text=text, predates_agent=predates
    )


def ledger_after(events: list[Event | None]) -> list[tuple[str, str]]:
    from agent.contracts.collector import MemoryKeyValueStore
    from agent.runtime.repairs import RepairLedger

    ledger = RepairLedger(MemoryKeyValueStore(), "boot")
    for event in events:
        if event is not None:
            ledger.apply(event)
    return [(r.action.value, r.kind) for r in ledger.active()]


class TestLinesThatSayOtherwise:
    """A line of the same GPU and code is a repeat only if it asks the same: Xid 154 names
    the recovery action it moved to, and the one back to None is the all-clear of the one
    before. Held back as a repeat (within the window or the holdoff) or merged into one
    backlog event, it was lost, and the reset it cleared stayed required until a reboot."""

    @pytest.mark.parametrize("later", [2.0, 60.0], ids=["within-the-window", "in-the-holdoff"])
    def test_the_reset_and_its_all_clear(self, later: float) -> None:
        correlator = XidCorrelator(window=5.0, clock=FakeClock(1000.0), holdoff=300.0)
        raised = correlator.observe(said("kmsg", 1000.0, RESET_REQUIRED))
        cleared = correlator.observe(said("kmsg", 1000.0 + later, BACK_TO_NONE))
        assert raised is not None and raised.repair_action.value == "reset_gpu"
        assert cleared is not None and cleared.clears == ("*",)
        assert ledger_after([raised, cleared]) == []
        assert correlator.counts == {(PCI, 154): 2}

    def test_needed_again_soon_after(self) -> None:
        correlator = XidCorrelator(window=5.0, clock=FakeClock(1000.0), holdoff=300.0)
        events = [
            correlator.observe(said("kmsg", 1000.0, RESET_REQUIRED)),
            correlator.observe(said("kmsg", 1010.0, BACK_TO_NONE)),
            correlator.observe(said("kmsg", 1070.0, RESET_REQUIRED)),
        ]
        assert all(e is not None for e in events)
        assert ledger_after(events) == [("reset_gpu", "xid")]

    def test_the_same_words_again_are_still_a_repeat(self) -> None:
        correlator = XidCorrelator(window=5.0, clock=FakeClock(1000.0), holdoff=300.0)
        assert correlator.observe(said("kmsg", 1000.0, RESET_REQUIRED)) is not None
        assert correlator.observe(said("kmsg", 1001.0, RESET_REQUIRED)) is None
        assert correlator.observe(said("kmsg", 1060.0, RESET_REQUIRED)) is None

    def test_nvml_first_then_the_kernel_logs_words(self) -> None:
        """NVML's event has no words (its event is the code's default); the kernel log's line
        of the same Xid says what it asks, and that is not lost as a mere twin."""
        correlator = XidCorrelator(window=5.0, clock=FakeClock(1000.0), holdoff=300.0)
        first = correlator.observe(said("nvml", 1000.0, "NVML Xid critical error event"))
        words = correlator.observe(said("kmsg", 1000.2, BACK_TO_NONE))
        assert first is not None and first.kind == "xid"
        assert words is not None and words.clears == ("*",)
        assert ledger_after([first, words]) == []
        # and an NVML twin of a line with words is only a confirmation
        line = correlator.observe(said("kmsg", 2000.0, RESET_REQUIRED))
        twin = correlator.observe(said("nvml", 2000.3, "NVML Xid critical error event"))
        assert twin is not None and twin.kind == "xid_confirmed"
        assert ledger_after([line, twin]) == [("reset_gpu", "xid")]

    def test_both_in_the_backlog(self) -> None:
        correlator = XidCorrelator(window=5.0, clock=FakeClock(5000.0))
        events = correlator.observe_backlog(
            [
                said("kmsg", 100.0, RESET_REQUIRED, predates=True),
                said("kmsg", 101.0, RESET_REQUIRED, predates=True),
                said("kmsg", 150.0, BACK_TO_NONE, predates=True),
            ]
        )
        assert [e.attributes["occurrences"] for e in events] == [2, 1]
        assert ledger_after(list(events)) == []
