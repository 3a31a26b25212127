"""What `gpuwarden check` reports: one finding per line, each with a status and an action."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
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


@dataclass(frozen=True, slots=True)
class Finding:
    area: str
    """gpu, driver, torch, kernel, host, network, state, io, bench"""
    name: str
    status: Status
    detail: str
    action: str = ""
    repair_action: RepairAction = RepairAction.NONE
    """As data, as on the event the finding comes from (agent/contracts/model.py)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "area": self.area,
            "name": self.name,
            "status": self.status.value,
            "detail": self.detail,
            "action": self.action,
            "repair_action": self.repair_action.value,
        }


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
