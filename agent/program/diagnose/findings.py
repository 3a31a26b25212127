"""What `gpuwarden check` reports: one finding per line, each with a status and an action."""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.contracts.model import RepairAction, Severity


class Status(enum.Enum):
    """OK, WARN and FAIL judge; N/A says the reading is not supported here (not an error);
    SKIP says the check was not run (an optional test not asked for, or a prerequisite missing)."""

    OK = "OK"
    WARN = "WARN"
    FAIL = "FAIL"
    NA = "N/A"
    SKIP = "SKIP"

    @classmethod
    def from_severity(cls, severity: Severity) -> Status:
        if severity >= Severity.CRITICAL:
            return cls.FAIL
        return cls.WARN if severity is Severity.WARNING else cls.OK


_ID_SHAPE = re.compile(r"[a-z][a-z_]*")
_NOT_ID = re.compile(r"[^a-z]+")


def slug(text: str) -> str:
    """ "state store" -> "state_store": a label without data, as an id."""
    return _NOT_ID.sub("_", text.lower()).strip("_")


@dataclass(frozen=True, slots=True)
class Finding:
    area: str
    """gpu, driver, torch, kernel, host, network, state, io, bench"""
    name: str
    """What a person reads in the table; may name its subject ("disk /", "GPU 0-3 ECC")."""
    status: Status
    detail: str
    action: str = ""
    repair_action: RepairAction = RepairAction.NONE
    """As data, as on the event the finding comes from (agent/contracts/model.py)."""
    check: str = ""
    """The stable id of the check ("disk", "gpu_ecc", "mqtt_broker"): the same for every
    subject, never holding data. Empty: the name is a label without data and gives the id."""
    subject: str = ""
    """What the line is about, as data: a mount point, a directory, an address, GPU indices."""
    data: Mapping[str, Any] = field(default_factory=dict)
    """Further data of the line (an Xid code, GPU indices), for --json."""

    @property
    def id(self) -> str:
        return self.check or slug(self.name)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "area": self.area,
            "name": self.name,
            "subject": self.subject,
            "status": self.status.value,
            "detail": self.detail,
            "action": self.action,
            "repair_action": self.repair_action.value,
        }
        if self.data:
            out["data"] = dict(self.data)
        return out


def valid_id(check_id: str) -> bool:
    """An id is lower-case words joined by `_`: no digits, paths, addresses or names in it."""
    return _ID_SHAPE.fullmatch(check_id) is not None


EXIT_OK = 0
EXIT_WARNINGS = 1
EXIT_FAILURES = 2


def exit_code(findings: Iterable[Finding]) -> int:
    """0: all good (N/A and SKIP count as good), 1: a warning, 2: a failure."""
    statuses = {f.status for f in findings}
    if Status.FAIL in statuses:
        return EXIT_FAILURES
    if Status.WARN in statuses:
        return EXIT_WARNINGS
    return EXIT_OK
