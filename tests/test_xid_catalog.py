"""The Xid and SXid catalog as data (NVIDIA's Xid Catalog, the driver's own names, the Fabric
Manager guide), and severity that follows the driver's own words on each line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agent.contracts.model import Severity
from collectors._xid import XidCorrelator, XidObservation, build_xid_event
from collectors._xid_catalog import (
    BUCKETS,
    CATALOG_PATH,
    CatalogError,
    catalog,
    known_codes,
    known_sxid_codes,
    load_catalog,
    lookup,
    lookup_event,
    lookup_sxid,
)
from collectors.kernel_log.matchers import Finding, MatcherSet
from collectors.kernel_log.parse import LogRecord

# The seven codes gpuwarden's catalog carried that NVIDIA's catalog marks "Unused".
MARKED_UNUSED = (56, 57, 61, 73, 81, 122, 123)
NVLINK5 = range(144, 151)
FAULTS = ("application", "node", "either", "unknown")


def raw() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(CATALOG_PATH.read_text(encoding="utf-8"))
    return data


def scan(*messages: str) -> list[Finding]:
    records = [LogRecord(message=m, line=i) for i, m in enumerate(messages, 1)]
    return list(MatcherSet().scan(records))


class TestCatalogData:
    """Every entry is complete, names its source, and has one of a small fixed set of buckets."""

    def test_buckets_are_the_fixed_set(self) -> None:
        """The data's buckets are exactly the set the code knows, each with a severity, a
        meaning, an action and the NVIDIA bucket names it stands for."""
        buckets = raw()["buckets"]
        assert set(buckets) == set(BUCKETS)
        for name, bucket in buckets.items():
            Severity.parse(bucket["severity"])
            assert bucket["meaning"] and bucket["action"], name
            assert isinstance(bucket["nvidia"], list), name

    @pytest.mark.parametrize("table", ["xid", "sxid"])
    def test_every_entry_is_complete(self, table: str) -> None:
        """Name, meaning, mnemonic, a known bucket, a fault flag and a known source per code;
        the severity is the bucket's (before any per-event words)."""
        data = raw()
        entries = data[table]
        assert entries
        cat = catalog()
        for code_text, entry in entries.items():
            code = int(code_text)
            info = cat.xid[code] if table == "xid" else cat.sxid[code]
            where = f"{table} {code}"
            assert info.known, where
            assert info.name and info.meaning and info.action and info.mnemonic, where
            assert info.bucket in BUCKETS, where
            assert info.fault in FAULTS, where
            assert entry["source"] in data["sources"], where
            assert info.severity is cat.buckets[info.bucket].severity, where

    def test_sources_have_version_and_date(self) -> None:
        """Each source says which version was read, and when; the catalog has a version."""
        data = raw()
        assert data["version"] == catalog().version
        assert "NVIDIA" in data["source"]
        for name, source in data["sources"].items():
            assert source["url"].startswith("https://"), name
            assert source["version"], name
            assert "20" in source["read"], name

    def test_nvidia_in_use_codes_are_all_there(self) -> None:
        """Every code 1-172 of NVIDIA's catalog is present; 109 of them in use, as NVIDIA's
        Applies-to columns say."""
        cat = catalog()
        from_catalog = [i for i in cat.xid.values() if i.source == "nvidia-xid-catalog"]
        assert sorted(i.code for i in from_catalog) == list(range(1, 173))
        assert sum(1 for i in from_catalog if i.in_use) == 109

    @pytest.mark.parametrize("code", range(159, 174))
    def test_newest_codes_are_present(self, code: int) -> None:
        """159-172 from NVIDIA's catalog, 173 from the driver's own header; all in use."""
        info = lookup(code)
        assert info.known and info.in_use
        assert info.source == ("open-gpu-kernel-modules" if code > 172 else "nvidia-xid-catalog")
        assert info.mnemonic

    def test_newest_codes_have_nvidia_buckets(self) -> None:
        """Where NVIDIA gives a bucket the data uses it; where it gives none, it says so."""
        assert lookup(159).bucket == "check_uvm"
        assert lookup(159).mnemonic == "ROBUST_CHANNEL_CHI_NON_DATA_ERROR"
        assert lookup(160).bucket == lookup(161).bucket == "ignore"
        for code in range(162, 174):
            assert lookup(code).bucket == "not_given", code
            assert lookup(code).note, code

    def test_codes_nvidia_marks_unused_are_marked(self) -> None:
        """Kept, so a line with one is still named, but marked unused and said so."""
        for code in MARKED_UNUSED:
            info = lookup(code)
            assert info.known and not info.in_use, code
            assert "unused" in info.meaning, code
        assert not set(MARKED_UNUSED) & set(known_codes(in_use_only=True))

    def test_nvidia_buckets_are_followed(self) -> None:
        """Where gpuwarden's earlier catalog differed, NVIDIA's bucket wins and a note says so."""
        for code, bucket in (
            (38, "ignore"),
            (43, "ignore"),
            (63, "ignore"),
            (80, "restart_application"),
        ):
            info = lookup(code)
            assert info.bucket == bucket, code
            assert "NVIDIA" in info.note, code
        assert lookup(79).bucket == "reboot_node"
        assert lookup(48).bucket == "workflow_xid48"
        assert lookup(46).severity is Severity.CRITICAL
        assert lookup(63).severity is Severity.INFO

    def test_application_versus_node_fault(self) -> None:
        """The flag follows NVIDIA's words: 13/31 the application, 32 the PCIe link, 79 the node."""
        assert [lookup(c).fault for c in (13, 31, 43, 32, 48, 79)] == [
            "application",
            "application",
            "application",
            "node",
            "node",
            "node",
        ]

    def test_unknown_code_is_still_named(self) -> None:
        """A code beyond the catalog is a warning that carries its number."""
        info = lookup(177)
        assert (info.known, info.fault, info.severity) == (False, "unknown", Severity.WARNING)
        assert "177" in info.meaning and "177" in info.action


class TestSxidCatalog:
    """SXids by number: the driver's names for all, the Fabric Manager guide's guidance where
    it gives one."""

    def test_fabric_manager_codes(self) -> None:
        """Codes of each of the guide's tables are there with its class and source."""
        for code, section in (
            (11004, "D.4"),
            (12028, "D.4"),
            (19084, "D.4"),
            (20034, "D.5"),
            (22003, "D.6"),
            (23001, "D.6"),
            (10003, "D.7"),
        ):
            info = catalog().sxid[code]
            assert info.source == "fabric-manager-guide", code
            assert info.section.startswith(section), code
        assert catalog().sxid[20034].name == "LTSSM Fault Up"
        assert catalog().sxid[22003].bucket == "reboot_node"

    def test_lookup_uses_the_catalog(self) -> None:
        """A known code gets its name and guidance; the driver's word sets the severity."""
        info = lookup_sxid(12028, "Non-fatal, Link 32 egress non-posted PRIV error (First)")
        assert info.known and info.name and "PRIV" in info.mnemonic
        assert info.severity is Severity.WARNING
        assert "VM" in info.action

    def test_every_driver_code_is_named(self) -> None:
        """All of the driver's SXid numbers (open-gpu-kernel-modules) are in the catalog."""
        codes = known_sxid_codes()
        assert len(codes) > 300
        assert {10001, 11004, 20034, 22013, 23017} <= set(codes)

    def test_unknown_sxid_keeps_its_number(self) -> None:
        info = lookup_sxid(99001, "Fatal, Link 01 something new")
        assert not info.known
        assert "99001" in info.meaning
        assert info.severity is Severity.CRITICAL


class TestBadCatalog:
    """A broken catalog file is a clear error naming the file, the key and what was expected."""

    def _write(self, tmp_path: Path, change: Any) -> Path:
        data = raw()
        change(data)
        path = tmp_path / "catalog.json"
        path.write_text(json.dumps(data))
        return path

    def test_unknown_bucket(self, tmp_path: Path) -> None:
        path = self._write(tmp_path, lambda d: d["xid"]["79"].update(bucket="panic"))
        with pytest.raises(CatalogError) as caught:
            load_catalog(path)
        assert str(path) in str(caught.value)
        assert "xid.79.bucket" in str(caught.value)
        assert "reset_gpu" in str(caught.value)

    def test_missing_field(self, tmp_path: Path) -> None:
        path = self._write(tmp_path, lambda d: d["sxid"]["11004"].pop("meaning"))
        with pytest.raises(CatalogError, match=r"sxid\.11004\.meaning"):
            load_catalog(path)

    def test_unknown_source(self, tmp_path: Path) -> None:
        path = self._write(tmp_path, lambda d: d["xid"]["13"].update(source="a blog"))
        with pytest.raises(CatalogError, match=r"xid\.13\.source"):
            load_catalog(path)

    def test_not_json(self, tmp_path: Path) -> None:
        path = tmp_path / "catalog.json"
        path.write_text("{")
        with pytest.raises(CatalogError, match=r"catalog\.json: cannot read"):
            load_catalog(path)


def nvlink5_line(code: int, word: str) -> str:
    return (
        f"NVRM: Xid (PCI:0000:04:00): {code}, SAW_MVB {word} XC0 i0 Link 00 "
        "(0x00000001 0x00000002 0x00000000 0x00000000 0x00000000 0x00000000)"
    )


def xid154_line(old: str, new: str) -> str:
    return f"NVRM: Xid (PCI:0000:3b:00): 154, GPU recovery action changed from {old} to {new}"


class TestDriverWords:
    """Severity follows what the driver wrote on the line (class 4)."""

    @pytest.mark.parametrize("code", NVLINK5)
    @pytest.mark.parametrize(
        ("word", "severity"),
        [("Fatal", Severity.CRITICAL), ("Nonfatal", Severity.WARNING)],
    )
    def test_nvlink5_fatal_or_not(self, code: int, word: str, severity: Severity) -> None:
        """Xid 144-150: `Fatal` is critical, `Nonfatal` a warning, whatever the code."""
        [finding] = scan(nvlink5_line(code, word))
        assert (finding.code, finding.severity) == (code, severity)
        assert finding.attributes["driver_severity"] == word
        assert lookup_event(code, nvlink5_line(code, word)).severity is severity

    def test_nvlink5_real_lines(self) -> None:
        """Lines as the driver prints them (spacing, sub-unit names) from public reports."""
        found = scan(
            "NVRM: Xid (PCI:0009:01:00): 149, NETIR_LINK_EVT  Fatal   XC0 i0 Link 01 "
            "(0x021425c6 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)",
            "NVRM: Xid (PCI:0000:5f:00): 145, RLW_REMAP Nonfatal XC0 i0 Link 02",
            "NVRM: Xid (PCI:0018:01:00): 149, NETIR_BER_EVENT Nonfatal XC0 i0 Link 03 "
            "(0x00086226 0x00000001 0x00000000 0x00000000 0x00000000 0x00000000)",
        )
        assert [f.severity for f in found] == [
            Severity.CRITICAL,
            Severity.WARNING,
            Severity.WARNING,
        ]

    def test_nvlink5_without_a_word(self) -> None:
        """No Fatal/Nonfatal on the line: the bucket's severity, and the finding says why."""
        [finding] = scan("NVRM: Xid (PCI:0000:04:00): 147, TREX")
        assert finding.severity is lookup(147).severity
        assert "bucket" in str(finding.attributes["severity_basis"])

    @pytest.mark.parametrize(
        ("new", "severity"),
        [
            ("0x0 (None)", Severity.INFO),
            ("0x1 (GPU Reset Required)", Severity.CRITICAL),
            ("0x2 (Node Reboot Required)", Severity.CRITICAL),
            ("0x4 (Drain and Reset)", Severity.CRITICAL),
            ("0x3 (Drain P2P)", Severity.WARNING),
            ("0x5 (Recover IMEX Domain)", Severity.WARNING),
        ],
    )
    def test_xid154_follows_the_new_action(self, new: str, severity: Severity) -> None:
        """Xid 154 is as bad as the action it moved to; to None is the all-clear."""
        old = "0x1 (GPU Reset Required)" if new.startswith("0x0") else "0x0 (None)"
        [finding] = scan(xid154_line(old, new))
        assert finding.severity is severity
        assert finding.attributes["recovery_action"] == new.split("(")[1].rstrip(")")
        assert finding.attributes["recovery_action_from"] == old.split("(")[1].rstrip(")")

    def test_xid154_number_without_name(self) -> None:
        """The action's number alone is enough; an unreadable line is the bucket's warning."""
        assert lookup_event(154, "changed from 0x0 to 0x2").severity is Severity.CRITICAL
        assert lookup_event(154, "GPU recovery action changed").severity is Severity.WARNING

    @pytest.mark.parametrize(
        ("text", "severity"),
        [
            ("Fatal, Link 44 LTSSM Fault Up", Severity.CRITICAL),
            ("Non-fatal, Link 44 LTSSM Fault Up", Severity.WARNING),
            ("Correctable, Link 44 LTSSM Fault Up", Severity.INFO),
            ("Severity 1 Engine instance 44 Sub-engine instance 00", Severity.CRITICAL),
            ("Severity 0 Engine instance 44 Sub-engine instance 00", Severity.WARNING),
        ],
    )
    def test_sxid_words(self, text: str, severity: Severity) -> None:
        """The NVSwitch driver's Fatal / Non-fatal / Correctable (and its Severity N)."""
        line = f"nvidia-nvswitch3: SXid (PCI:0000:c7:00.0): 20034, {text}"
        [finding] = scan(line)
        assert finding.severity is severity
        assert finding.name == "LTSSM Fault Up"

    def test_sxid_without_a_word(self) -> None:
        """No word: the catalog's bucket (an always-fatal SXid is critical)."""
        [finding] = scan("nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 22003, Minion Halt")
        assert finding.severity is Severity.CRITICAL

    def test_non_fatal_with_no_impact_is_info(self) -> None:
        """A non-fatal single-bit ECC SXid the guide says has no impact: info, not a warning."""
        text = "Non-fatal, Link 02 ingress header ECC limit (First)"
        assert lookup_sxid(11012, text).severity is Severity.INFO


class TestDaemonEvents:
    """The correlated event (kernel log and NVML) carries the same driver-word severity."""

    def test_event_from_kernel_text(self) -> None:
        obs = XidObservation(
            "kmsg", "0000:3b:00.0", 154, 1.0, text=xid154_line("0x1", "0x0 (None)")
        )
        event = build_xid_event(obs, frozenset({"kmsg"}), {})
        assert event.severity is Severity.INFO
        assert event.attributes["recovery_action"] == "None"

    def test_nvml_first_then_kernel_words(self) -> None:
        """NVML's event carries no words; the kernel line that joins it decides the severity."""
        correlator = XidCorrelator(window=5.0, clock=lambda: 100.0)
        pci = "0000:04:00.0"
        first = correlator.observe(XidObservation("nvml", pci, 149, 100.0, text="NVML Xid event"))
        event = correlator.observe(
            XidObservation("kmsg", pci, 149, 100.1, text=nvlink5_line(149, "Fatal"))
        )
        assert first is not None and event is not None
        assert event.kind == "xid_escalated"
        assert event.attributes["confirms"] == first.id
        assert event.severity is Severity.CRITICAL
        assert event.attributes["sources"] == "kmsg,nvml"

    def test_worst_words_of_a_burst(self) -> None:
        """Nonfatal then Fatal for the same GPU and code in one window: the event is critical."""
        correlator = XidCorrelator(window=5.0, clock=lambda: 100.0)
        pci = "0000:04:00.0"
        events = [
            correlator.observe(XidObservation("kmsg", pci, 145, at, text=nvlink5_line(145, word)))
            for at, word in ((100.0, "Nonfatal"), (100.5, "Fatal"))
        ]
        assert [(e.kind, e.severity) for e in events if e is not None] == [
            ("xid", Severity.WARNING),
            ("xid_escalated", Severity.CRITICAL),
        ]
