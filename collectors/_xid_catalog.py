"""What an Xid (and an NVSwitch SXid) code means, and what to do about it: data, not code.

The table lives in _xid_catalog.json beside this module, with its source: NVIDIA's Xid catalog
(docs.nvidia.com/deploy/xid-errors) as summarised in docs/MEASUREMENTS.md. Sources disagree at the
edges, so the table is data a site can review; the choices made are noted in it. An unknown
code is reported as unknown, never dropped.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from agent.contracts.model import Severity

CATALOG_PATH: Final = Path(__file__).with_name("_xid_catalog.json")

Fault = Literal["application", "node", "either", "unknown"]


@dataclass(frozen=True, slots=True)
class XidInfo:
    code: int
    name: str
    meaning: str
    fault: Fault
    """Who usually caused it: the application, the node (GPU, board, link), either."""
    severity: Severity
    action: str
    known: bool = True


@functools.cache
def _load() -> tuple[str, dict[int, XidInfo]]:
    data: dict[str, Any] = json.loads(CATALOG_PATH.read_text(encoding="utf-8"))
    table: dict[int, XidInfo] = {}
    for code_text, entry in data["xid"].items():
        code = int(code_text)
        table[code] = XidInfo(
            code=code,
            name=entry["name"],
            meaning=entry["meaning"],
            fault=entry["fault"],
            severity=Severity.parse(entry["severity"]),
            action=entry["action"],
        )
    return str(data["source"]), table


def catalog_source() -> str:
    return _load()[0]


def known_codes() -> list[int]:
    return sorted(_load()[1])


def lookup(code: int) -> XidInfo:
    """The catalog entry for an Xid code; an `unknown` entry (warning) for codes not in it."""
    info = _load()[1].get(code)
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
    )


# NVSwitch SXids: the driver writes whether the error was fatal into the text after the code
# (`..., Fatal, Link 32 ...` / `..., Non-fatal, ...`). Fatal SXids take the switch's links
# down for every GPU behind it.
_NON_FATAL = re.compile(r"\bnon[- ]?fatal\b", re.IGNORECASE)
_FATAL = re.compile(r"\bfatal\b", re.IGNORECASE)


def lookup_sxid(code: int, text: str) -> XidInfo:
    """Meaning of an NVSwitch SXid: fatal or not as its text says; unknown severity: warning."""
    if _NON_FATAL.search(text):
        return XidInfo(
            code=code,
            name="NVSwitch non-fatal error",
            fault="node",
            severity=Severity.WARNING,
            meaning=f"NVSwitch SXid {code}: a non-fatal error on an NVSwitch port (the text "
            "names the link); traffic continues",
            action="watch for repeats on the same link; if they continue, follow NVIDIA's "
            "NVSwitch workflow and check the link's cabling or tray",
        )
    if _FATAL.search(text):
        return XidInfo(
            code=code,
            name="NVSwitch fatal error",
            fault="node",
            severity=Severity.CRITICAL,
            meaning=f"NVSwitch SXid {code}: a fatal error on an NVSwitch; the GPUs behind it "
            "lose NVLink connectivity",
            action="drain the node, reset the NVSwitch and GPUs (or restart the machine) and "
            "check the fabric manager log; repeated: inspect the switch tray",
        )
    return XidInfo(
        code=code,
        name="NVSwitch error",
        fault="node",
        severity=Severity.WARNING,
        meaning=f"NVSwitch SXid {code}: an NVSwitch error (the text does not say if fatal)",
        action="check the fabric manager log and NVIDIA's SXid catalog for this code",
    )
