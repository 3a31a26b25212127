"""`[actions.slurm]` and `[actions.exec]`: what the agent may do about a finding by itself.

Both are off by default: an agent that drains nodes or runs programs does so because its
operator wrote it down.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from agent.contracts.model import RepairAction, Severity
from agent.contracts.settings import setting

SeverityName = Literal["info", "warning", "critical", "fatal"]

DRAIN_ACTIONS: Final = (
    "reset_gpu",
    "drain_and_reset",
    "reboot_node",
    "reset_fabric",
    "hardware_inspection",
)
"""The repair actions that take a GPU or the node out of service: a scheduler must stop
sending work here until they are done."""

NEVER_DRAIN: Final = frozenset({RepairAction.NONE.value, RepairAction.RESTART_APPLICATION.value})
"""An application fault is the application's: the node is fine, draining it would punish the
next job for the last one's bug."""


@dataclass(frozen=True)
class SlurmSettings:
    enabled: bool = setting(False, help="drain this node in Slurm on a node-class finding")
    node_name: str = setting(
        "", help="the node's name in Slurm (NodeName); empty: the host's short name"
    )
    resume: Literal["never", "when_cleared"] = setting(
        "never",
        help="never: a person resumes the node; when_cleared: resume it when every finding "
        "that drained it is cleared (only a node gpuwarden drained, with its own reason)",
    )
    drain_on: tuple[str, ...] = setting(
        DRAIN_ACTIONS, help="the repair actions that drain the node (at min_severity or worse)"
    )
    min_severity: SeverityName = setting("critical", help="the least severity that drains")
    scontrol: str = setting("scontrol", path=True, help="the scontrol program (PATH is searched)")
    timeout: float = setting(
        10.0, exclusive_minimum=0, maximum=300, help="seconds per scontrol run"
    )
    retry_initial: float = setting(
        2.0, exclusive_minimum=0, help="first wait before a failed scontrol is retried, seconds"
    )
    retry_max: float = setting(
        120.0, exclusive_minimum=0, help="longest wait between retries, seconds"
    )

    def __post_init__(self) -> None:
        known = {a.value for a in RepairAction}
        for i, name in enumerate(self.drain_on):
            if name not in known:
                raise ValueError(
                    f"drain_on[{i}]: unknown repair action {name!r}; expected one of "
                    + ", ".join(sorted(known - NEVER_DRAIN))
                )
            if name in NEVER_DRAIN:
                raise ValueError(
                    f"drain_on[{i}]: {name!r} never drains a node (an application fault or no "
                    "action at all)"
                )
        if self.retry_max < self.retry_initial:
            raise ValueError("retry_max must be at least retry_initial")

    @property
    def severity(self) -> Severity:
        return Severity.parse(self.min_severity)


@dataclass(frozen=True)
class ExecSettings:
    command: tuple[str, ...] = setting(
        (),
        path=True,
        help="program and arguments run (without a shell) for each new event at min_severity "
        "or worse, the event's JSON on its standard input; empty: off",
    )
    min_severity: SeverityName = setting("critical", help="the least severity that runs it")
    timeout: float = setting(
        30.0, exclusive_minimum=0, maximum=3600, help="seconds before the hook is killed"
    )
    max_concurrent: int = setting(2, minimum=1, maximum=64, help="hooks running at once")
    queue_limit: int = setting(
        1000, minimum=1, help="events waiting for a hook; more are dropped and counted"
    )

    @property
    def enabled(self) -> bool:
        return bool(self.command)

    @property
    def severity(self) -> Severity:
        return Severity.parse(self.min_severity)


@dataclass(frozen=True)
class ActionsSettings:
    slurm: SlurmSettings = setting(factory=SlurmSettings, help="Slurm drain and resume")
    exec: ExecSettings = setting(factory=ExecSettings, help="a program run for each new event")

    @property
    def enabled(self) -> bool:
        return self.slurm.enabled or self.exec.enabled
