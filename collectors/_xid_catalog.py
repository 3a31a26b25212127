"""What an Xid (and an NVSwitch SXid) code means, and what to do about it: data, not code.

The table lives in _xid_catalog.json beside this module, with its sources and their versions:
NVIDIA's Xid Catalog (every code 1-172, its resolution buckets), the driver's own headers in
open-gpu-kernel-modules (names of the newest Xids and of every SXid, the words the drivers
print) and the Fabric Manager user guide (guidance for the SXids it lists).

Every code has one of a small fixed set of buckets (`BUCKETS`), NVIDIA's recommended action
in gpuwarden's words; the bucket gives the code's severity. Some lines say more than their
code: NVLink5 Xids 144-150 say `Fatal` or `Nonfatal`, Xid 154 names the recovery action it
moved to, SXid lines say `Fatal`, `Non-fatal` or `Correctable`. `lookup_event` and
`lookup_sxid` read those words, so the severity is the driver's own. A code not in the
catalog is still reported, with its number, as unknown.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final, Literal, NoReturn, cast

from agent.contracts.errors import GpuwardenError, ModelError
from agent.contracts.model import AttributeValue, Severity

CATALOG_PATH: Final = Path(__file__).with_name("_xid_catalog.json")
FORMAT: Final = 2
"""The layout of the file this code reads (format 1 had one severity per code and no buckets)."""

# The fixed set of action buckets. The data describes each (severity, meaning, action and the
# NVIDIA bucket names it stands for) and must describe exactly these: the code below gives two
# of them a per-event reading of the line.
BUCKETS: Final = (
    "ignore",
    "restart_application",
    "restart_vm",
    "reset_gpu",
    "reboot_node",
    "reset_fabric",
    "hardware_inspection",
    "check_cooling",
    "update_software",
    "check_uvm",
    "contact_support",
    "workflow_xid45",
    "workflow_xid48",
    "workflow_nvlink",
    "workflow_nvlink5",
    "recovery_action",
    "not_given",
)
NVLINK5_BUCKET: Final = "workflow_nvlink5"
RECOVERY_BUCKET: Final = "recovery_action"

Fault = Literal["application", "node", "either", "unknown"]
FAULTS: Final[tuple[Fault, ...]] = ("application", "node", "either", "unknown")


class CatalogError(GpuwardenError):
    """The catalog file is not what this code expects. `str()` gives `file: key: message`."""

    def __init__(self, file: Path, key: str, message: str) -> None:
        super().__init__(f"{file}: {key}: {message}" if key else f"{file}: {message}")


@dataclass(frozen=True, slots=True)
class Bucket:
    name: str
    severity: Severity
    meaning: str
    action: str
    nvidia: tuple[str, ...]
    """NVIDIA's resolution-bucket names this bucket stands for (empty: none of NVIDIA's)."""


@dataclass(frozen=True, slots=True)
class Source:
    name: str
    label: str
    """Short: what it is and which version (for --help and check)."""
    title: str
    url: str
    version: str
    read: str


@dataclass(frozen=True, slots=True)
class RecoveryAction:
    """One of the recovery actions Xid 154 names (the driver's NV2080_CTRL_GPU_RECOVERY_ACTION)."""

    code: int
    name: str
    severity: Severity
    meaning: str
    action: str


@dataclass(frozen=True, slots=True)
class XidInfo:
    code: int
    name: str
    meaning: str
    fault: Fault
    """Who usually caused it: the application, the node (GPU, board, link), either, unknown."""
    severity: Severity
    action: str
    known: bool = True
    bucket: str = "not_given"
    mnemonic: str = ""
    in_use: bool = True
    """False for codes NVIDIA marks unused on current GPUs (kept so a line is still named)."""
    source: str = ""
    note: str = ""
    section: str = ""
    """SXids: the Fabric Manager guide's table (`D.4 non-fatal` ...); empty otherwise."""
    basis: str = ""
    """Why this severity: the bucket's, or the driver's word on the line."""
    details: tuple[tuple[str, str], ...] = ()
    """What the line itself said (driver_severity, recovery_action, ...)."""

    def attributes(self) -> dict[str, AttributeValue]:
        """The catalog's judgement as event/finding attributes."""
        out: dict[str, AttributeValue] = {
            "bucket": self.bucket,
            "severity_basis": self.basis,
            "in_use": self.in_use,
        }
        if self.mnemonic:
            out["mnemonic"] = self.mnemonic
        if self.note:
            out["catalog_note"] = self.note
        out.update(self.details)
        return out


@dataclass(frozen=True)
class Catalog:
    path: Path
    version: str
    source: str
    sources: Mapping[str, Source]
    buckets: Mapping[str, Bucket]
    recovery_actions: Mapping[int, RecoveryAction]
    xid: Mapping[int, XidInfo]
    sxid: Mapping[int, XidInfo]

    def describe(self) -> str:
        """One line for --help and check: the version and the version of every source."""
        labels = "; ".join(s.label for s in self.sources.values())
        return f"Xid catalog {self.version} ({labels})"

    def info(self) -> dict[str, Any]:
        """The version and the sources, for JSON output."""
        return {
            "version": self.version,
            "file": str(self.path),
            "sources": {
                s.name: {"title": s.title, "url": s.url, "version": s.version, "read": s.read}
                for s in self.sources.values()
            },
        }


class _Loader:
    """Reads the JSON, checking every key it uses; an error names the file and the key."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, key: str, message: str) -> CatalogError:
        return CatalogError(self.path, key, message)

    def table(self, data: Mapping[str, Any], key: str) -> dict[str, Any]:
        value = data.get(key)
        if not isinstance(value, dict) or not value:
            self._bad(key, "expected a non-empty object")
        for name, entry in value.items():
            if not isinstance(entry, dict):
                self._bad(f"{key}.{name}", "expected an object")
        return value

    def text(
        self, entry: Mapping[str, Any], key: str, where: str, *, optional: bool = False
    ) -> str:
        value = entry.get(key, "" if optional else None)
        if not isinstance(value, str) or (not optional and not value):
            self._bad(f"{where}.{key}", "expected a non-empty string")
        return value

    def severity(self, entry: Mapping[str, Any], where: str) -> Severity:
        text = self.text(entry, "severity", where)
        try:
            return Severity.parse(text)
        except ModelError as exc:
            raise self.fail(f"{where}.severity", str(exc)) from None

    def choice(self, entry: Mapping[str, Any], key: str, where: str, allowed: Sequence[str]) -> str:
        value = self.text(entry, key, where)
        if value not in allowed:
            self._bad(f"{where}.{key}", f"expected one of {', '.join(allowed)}, got {value!r}")
        return value

    def code(self, text: str, where: str) -> int:
        if not text.isdigit():
            self._bad(where, f"expected a decimal code, got {text!r}")
        return int(text)

    def _bad(self, key: str, message: str) -> NoReturn:
        raise self.fail(key, message)


def load_catalog(path: Path = CATALOG_PATH) -> Catalog:
    """Read and check a catalog file. Raises CatalogError naming the file and the key."""
    loader = _Loader(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise loader.fail("", f"cannot read the catalog: {exc}") from None
    if not isinstance(data, dict):
        raise loader.fail("", "expected a JSON object")
    if data.get("format") != FORMAT:
        raise loader.fail("format", f"expected {FORMAT}, got {data.get('format')!r}")
    sources = _sources(loader, data)
    buckets = _buckets(loader, data)
    return Catalog(
        path=path,
        version=loader.text(data, "version", "catalog"),
        source=loader.text(data, "source", "catalog"),
        sources=sources,
        buckets=buckets,
        recovery_actions=_recovery_actions(loader, data),
        xid=_entries(loader, data, "xid", sources, buckets),
        sxid=_entries(loader, data, "sxid", sources, buckets),
    )


def _sources(loader: _Loader, data: Mapping[str, Any]) -> dict[str, Source]:
    out = {}
    for name, entry in loader.table(data, "sources").items():
        where = f"sources.{name}"
        keys = ("label", "title", "url", "version", "read")
        fields = [loader.text(entry, key, where) for key in keys]
        out[name] = Source(name, *fields)
    return out


def _buckets(loader: _Loader, data: Mapping[str, Any]) -> dict[str, Bucket]:
    table = loader.table(data, "buckets")
    if set(table) != set(BUCKETS):
        missing, extra = set(BUCKETS) - set(table), set(table) - set(BUCKETS)
        raise loader.fail(
            "buckets",
            f"expected exactly {', '.join(BUCKETS)}; missing "
            f"{sorted(missing) or 'none'}, unexpected {sorted(extra) or 'none'}",
        )
    out = {}
    for name, entry in table.items():
        where = f"buckets.{name}"
        nvidia = entry.get("nvidia")
        if not isinstance(nvidia, list) or not all(isinstance(n, str) for n in nvidia):
            raise loader.fail(f"{where}.nvidia", "expected a list of NVIDIA bucket names")
        out[name] = Bucket(
            name=name,
            severity=loader.severity(entry, where),
            meaning=loader.text(entry, "meaning", where),
            action=loader.text(entry, "action", where),
            nvidia=tuple(nvidia),
        )
    return out


def _recovery_actions(loader: _Loader, data: Mapping[str, Any]) -> dict[int, RecoveryAction]:
    out = {}
    for code_text, entry in loader.table(data, "recovery_actions").items():
        where = f"recovery_actions.{code_text}"
        code = loader.code(code_text, where)
        out[code] = RecoveryAction(
            code=code,
            name=loader.text(entry, "name", where),
            severity=loader.severity(entry, where),
            meaning=loader.text(entry, "meaning", where),
            action=loader.text(entry, "action", where),
        )
    return out


def _entries(
    loader: _Loader,
    data: Mapping[str, Any],
    table: str,
    sources: Mapping[str, Source],
    buckets: Mapping[str, Bucket],
) -> dict[int, XidInfo]:
    out = {}
    for code_text, entry in loader.table(data, table).items():
        where = f"{table}.{code_text}"
        code = loader.code(code_text, where)
        bucket = buckets[loader.choice(entry, "bucket", where, BUCKETS)]
        in_use = entry.get("in_use", True)
        if not isinstance(in_use, bool):
            raise loader.fail(f"{where}.in_use", "expected true or false")
        out[code] = XidInfo(
            code=code,
            name=loader.text(entry, "name", where),
            meaning=loader.text(entry, "meaning", where),
            fault=cast(Fault, loader.choice(entry, "fault", where, FAULTS)),
            severity=bucket.severity,
            action=loader.text(entry, "action", where, optional=True) or bucket.action,
            bucket=bucket.name,
            mnemonic=loader.text(entry, "mnemonic", where),
            in_use=in_use,
            source=loader.choice(entry, "source", where, tuple(sources)),
            note=loader.text(entry, "note", where, optional=True),
            section=loader.text(entry, "fm_guide", where, optional=True),
            basis=f"catalog bucket {bucket.name}",
        )
    return out


@functools.cache
def catalog() -> Catalog:
    """The catalog shipped beside this module (read once)."""
    return load_catalog(CATALOG_PATH)


def catalog_version() -> str:
    return catalog().version


def catalog_source() -> str:
    return catalog().source


def known_codes(*, in_use_only: bool = False) -> list[int]:
    """Every Xid code in the catalog (or only those in use on current GPUs)."""
    return sorted(c for c, info in catalog().xid.items() if info.in_use or not in_use_only)


def known_sxid_codes() -> list[int]:
    return sorted(catalog().sxid)


def lookup(code: int) -> XidInfo:
    """The catalog entry for an Xid code; an `unknown` entry (warning) for codes not in it."""
    info = catalog().xid.get(code)
    if info is not None:
        return info
    return XidInfo(
        code=code,
        name="unknown Xid",
        fault="unknown",
        severity=Severity.WARNING,
        known=False,
        meaning=f"Xid {code} is not in gpuwarden's catalog (a newer driver may define it)",
        action=f"look up Xid {code} in NVIDIA's Xid catalog for this driver version; "
        "reset the GPU if work on it has stopped",
        basis="not in the catalog",
    )


def lookup_event(code: int, text: str) -> XidInfo:
    """The entry for one Xid line: where the driver says how bad this event is (NVLink5
    Fatal/Nonfatal, Xid 154's new recovery action), its words set the severity."""
    info = lookup(code)
    if info.bucket == NVLINK5_BUCKET:
        return _nvlink5_event(info, text)
    if info.bucket == RECOVERY_BUCKET:
        return _recovery_event(info, text)
    return info


# NVLink5 Xids (144-150): `Xid (PCI:...): 149, NETIR_LINK_EVT  Fatal   XC0 i0 Link 01 (...)`.
# The word after the sub-unit is the driver's verdict for this event (NVIDIA's Xid catalog,
# WORKFLOW_NVLINK5_ERR: "<sub component> <fatal vs nonfatal> <Crosscontain> ...").
_NVLINK5_WORD = re.compile(r"\b(?:(?P<nonfatal>non-?fatal)|(?P<fatal>fatal))\b", re.IGNORECASE)


def _nvlink5_event(info: XidInfo, text: str) -> XidInfo:
    match = _NVLINK5_WORD.search(text)
    if match is None:
        return info
    word = match.group(0)
    severity = Severity.CRITICAL if match["fatal"] else Severity.WARNING
    return replace(
        info,
        severity=severity,
        basis=f"the driver's {word!r} on the line",
        details=(("driver_severity", word),),
    )


# Xid 154 (open-gpu-kernel-modules, src/nvidia/src/kernel/gpu/gpu.c): "GPU recovery action
# changed from 0x%x (%s) to 0x%x (%s)". Either the number or the name names the new action.
_RECOVERY = re.compile(
    r"\bfrom\s+(?P<old>0x[0-9a-f]+|\d+)?\s*(?:\((?P<old_name>[^)]*)\))?\s*"
    r"to\s+(?P<new>0x[0-9a-f]+|\d+)?\s*(?:\((?P<new_name>[^)]*)\))?",
    re.IGNORECASE,
)


def _recovery_action(number: str | None, name: str | None) -> tuple[str, RecoveryAction | None]:
    """(the name to show, the catalog's action) for a number and/or name on the line."""
    actions = catalog().recovery_actions
    if name:
        for action in actions.values():
            if action.name.lower() == name.strip().lower():
                return action.name, action
    found = (
        actions.get(int(number, 16 if number.lower().startswith("0x") else 10)) if number else None
    )
    if found is not None:
        return found.name, found
    return (name or number or "").strip(), None


def _recovery_event(info: XidInfo, text: str) -> XidInfo:
    match = _RECOVERY.search(text)
    if match is None or not (match["new"] or match["new_name"]):
        return info
    new_name, new = _recovery_action(match["new"], match["new_name"])
    old_name, _ = _recovery_action(match["old"], match["old_name"])
    details = (("recovery_action", new_name), ("recovery_action_from", old_name))
    if new is None:
        return replace(
            info,
            basis=f"recovery action {new_name!r} is not in the catalog",
            details=details,
        )
    return replace(
        info,
        severity=new.severity,
        meaning=f"the GPU's recovery action changed from {old_name or '?'} to {new.name}: "
        f"{new.meaning}",
        action=new.action,
        basis=f"the recovery action the driver moved to ({new.name})",
        details=details,
    )


# NVSwitch SXid lines (open-gpu-kernel-modules, src/common/nvswitch/kernel/inc/
# intr_nvswitch.h): `..., Fatal, Link 44 ...`, `..., Non-fatal, Link 32 ...`, `...,
# Correctable, Link ...`; a record's follow-up line says `Severity N Engine instance ...`
# (0 non-fatal, 1 fatal: error_nvswitch.c).
_SXID_WORD = re.compile(
    r"\b(?:(?P<nonfatal>non-?fatal)|(?P<fatal>fatal)|(?P<correctable>correctable)|"
    r"severity (?P<level>\d+))\b",
    re.IGNORECASE,
)


def _unknown_sxid(code: int) -> XidInfo:
    bucket = catalog().buckets["not_given"]
    return XidInfo(
        code=code,
        name="unknown SXid",
        fault="node",
        severity=bucket.severity,
        known=False,
        bucket=bucket.name,
        meaning=f"NVSwitch SXid {code} is not in gpuwarden's catalog (a newer driver may "
        "define it)",
        action=f"look up SXid {code} in NVIDIA's Fabric Manager user guide and check the "
        "fabric manager log",
        basis="not in the catalog",
    )


def lookup_sxid(code: int, text: str) -> XidInfo:
    """An NVSwitch SXid line: the catalog's entry, with the severity the driver's word gives."""
    info = catalog().sxid.get(code) or _unknown_sxid(code)
    match = _SXID_WORD.search(text)
    if match is None:
        return info
    word = match.group(0)
    level = match["level"]
    if match["fatal"] or level == "1":
        severity = Severity.CRITICAL
    elif match["nonfatal"] or level == "0":
        # Non-fatal is at worst a warning; where NVIDIA says no action is needed, info.
        severity = min(Severity.WARNING, catalog().buckets[info.bucket].severity)
    elif match["correctable"]:
        severity = Severity.INFO
    else:
        return info  # a severity level the driver does not define
    return replace(
        info,
        severity=severity,
        basis=f"the driver's {word!r} on the line",
        details=(("driver_severity", word),),
    )
