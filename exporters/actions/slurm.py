"""Drain this node in Slurm on a node-class finding, and resume it when the finding clears.

Slurm's controller is the engine: the agent only runs `scontrol` for its own node. A finding
qualifies when its repair action takes a GPU or the node out of service (`drain_on`: a reset,
a reboot, an inspection), at `min_severity` or worse, and it is not an application fault. The
repair ledger (agent/runtime/repairs.py) says which are active; this module makes Slurm agree.

- drain: `scontrol update nodename=<node> state=drain reason="gpuwarden: <finding>"`, unless
  the node is already drained for another reason (a person's: it is not ours to take over);
- resume (`resume = "when_cleared"`): when no qualifying finding is left, and only if the node
  is drained with our own reason, as gpuwarden drained it: `scontrol show node` is read first,
  so a node a person drained, or re-drained with their own reason, is never resumed;
- a failed scontrol is retried with a growing wait, counted, and reported once per streak;
- scontrol runs as a child process without a shell and with a timeout: the loop never waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import structlog

from agent.contracts.model import (
    ActiveRepair,
    Event,
    MetricFamily,
    MetricType,
    RepairAction,
    Sample,
    Severity,
)
from agent.contracts.sink import SinkContext
from exporters.actions import process
from exporters.actions.settings import SlurmSettings

log = structlog.get_logger(component="slurm")

SOURCE: Final = "actions"
REASON_PREFIX: Final = "gpuwarden: "
REASON_LIMIT: Final = 120
STATE_NAMESPACE: Final = "actions.slurm"

DRAINED = MetricFamily(
    "gpuwarden_slurm_drained",
    MetricType.GAUGE,
    "1 while gpuwarden holds this node drained in Slurm",
    ("node",),
)
OPERATIONS = MetricFamily(
    "gpuwarden_slurm_operations_total",
    MetricType.COUNTER,
    "scontrol runs by the Slurm action, by operation and outcome",
    ("operation", "outcome"),
)


@dataclass(frozen=True, slots=True)
class NodeState:
    state: str
    reason: str

    @property
    def drained(self) -> bool:
        return "DRAIN" in self.state.upper()


_STATE = re.compile(r"\bState=(\S+)")
_REASON = re.compile(r"^\s*Reason=(.*?)(?:\s+\[[^\]]*\])?\s*$", re.MULTILINE)


def parse_show_node(text: str) -> NodeState:
    """`scontrol show node <name>`: its State= and Reason= (without the `[user@time]`)."""
    state = _STATE.search(text)
    reason = _REASON.search(text)
    if state is None:
        raise ValueError(f"no State= in scontrol's answer: {text.strip()[:200]!r}")
    value = reason.group(1).strip() if reason else ""
    return NodeState(state.group(1), "" if value == "(null)" else value)


def qualifies(repair: ActiveRepair, settings: SlurmSettings) -> bool:
    return (
        repair.action.value in settings.drain_on
        and repair.severity >= settings.severity
        and repair.fault != "application"
        and repair.action is not RepairAction.RESTART_APPLICATION
    )


def drain_reason(findings: Sequence[ActiveRepair]) -> str:
    """`gpuwarden: Xid 79 (GPU has fallen off the bus) on GPU 0000:3b:00.0 [reboot_node]`:
    the first finding's own words up to its first colon, short enough for sinfo -R."""
    first = findings[0]
    head = first.message.split(": ", 1)[0].strip() or first.kind
    more = f" (+{len(findings) - 1} more)" if len(findings) > 1 else ""
    tail = f" [{first.action.value}]{more}"
    room = REASON_LIMIT - len(REASON_PREFIX) - len(tail)
    if len(head) > room:
        head = head[: room - 1].rstrip() + "…"
    # scontrol takes the reason as one argument; a double quote would confuse a person's shell
    # that copies it from sinfo, not scontrol, but keep it plain all the same.
    return REASON_PREFIX + head.replace('"', "'") + tail


def default_node_name() -> str:
    return socket.gethostname().split(".")[0]


class SlurmAction:
    """One node's drain state, reconciled with the active findings after every event."""

    def __init__(self, settings: SlurmSettings, context: SinkContext) -> None:
        self.settings = settings
        self.context = context
        self.node = settings.node_name or default_node_name()
        self.counts: dict[tuple[str, str], int] = {}
        self._wake = asyncio.Event()
        self._retry_delay = 0.0
        self._failing = False
        self._foreign_reason = ""
        self.ours: dict[str, object] | None = None
        """What gpuwarden drained the node with: its reason and the findings (ledger keys);
        read from the state store when run() starts (off the loop)."""

    # -- events ------------------------------------------------------------------------------

    def on_event(self, event: Event) -> None:
        if event.source != SOURCE:
            self._wake.set()

    def wanted(self) -> list[ActiveRepair]:
        return [r for r in self.context.repairs() if qualifies(r, self.settings)]

    async def run(self) -> None:
        stored = await self.context.in_store_thread(
            self.context.state.get, STATE_NAMESPACE, self.node
        )
        self.ours = stored if isinstance(stored, dict) else None
        self._wake.set()  # findings raised before a restart are still active: look at once
        while True:
            timeout = self._retry_delay if self._failing else None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
            self._wake.clear()
            await self.reconcile()

    async def reconcile(self) -> None:
        wanted = self.wanted()
        if wanted:
            keys = sorted(r.key for r in wanted)
            held = self.ours.get("findings") if self.ours else None
            if isinstance(held, list) and set(keys) <= set(held):
                return  # drained for these already
            await self._drain(wanted, keys)
        elif self.ours is not None and self.settings.resume == "when_cleared":
            await self._resume()
        else:
            self._succeeded()

    # -- scontrol ----------------------------------------------------------------------------

    async def _scontrol(self, operation: str, *args: str) -> process.Outcome:
        outcome = await process.run([self.settings.scontrol, *args], self.settings.timeout)
        key = (operation, "ok" if outcome.ok else "failed")
        self.counts[key] = self.counts.get(key, 0) + 1
        if outcome.ok:  # the ledger's "actions" entry: up, and when it last worked
            self.context.record_delivery("actions")
        return outcome

    async def _show(self) -> NodeState | None:
        outcome = await self._scontrol("show", "show", "node", self.node)
        if not outcome.ok:
            self._failed("show", outcome.describe())
            return None
        try:
            return parse_show_node(outcome.stdout)
        except ValueError as exc:
            self._failed("show", str(exc))
            return None

    async def _drain(self, wanted: Sequence[ActiveRepair], keys: list[str]) -> None:
        node = await self._show()
        if node is None:
            return
        reason = drain_reason(wanted)
        if node.drained and not node.reason.startswith(REASON_PREFIX):
            # Someone else's drain: the node takes no work already, and the reason is theirs.
            if node.reason != self._foreign_reason:
                log.warning(
                    "node already drained by someone else; not touched",
                    node=self.node,
                    reason=node.reason,
                    finding=reason,
                )
                self._foreign_reason = node.reason
            self._succeeded()
            return
        outcome = await self._scontrol(
            "drain", "update", f"nodename={self.node}", "state=drain", f"reason={reason}"
        )
        if not outcome.ok:
            self._failed("drain", outcome.describe(), reason)
            return
        self._remember({"reason": reason, "findings": keys, "at": time.time()})
        log.warning("node drained in Slurm", node=self.node, reason=reason)
        self.context.emit(
            Event(
                source=SOURCE,
                kind="slurm_node_drained",
                severity=Severity.WARNING,
                repair_action=RepairAction.NONE,
                subject=self.node,
                message=f"Slurm node {self.node} drained: {reason}",
                action="the node takes no new jobs; do the repair it names, then "
                + (
                    "gpuwarden resumes it when the finding clears"
                    if self.settings.resume == "when_cleared"
                    else f"resume it: scontrol update nodename={self.node} state=resume"
                ),
                attributes={"node": self.node, "reason": reason},
            )
        )
        self._succeeded()

    async def _resume(self) -> None:
        node = await self._show()
        if node is None:
            return
        reason = str(self.ours.get("reason", "")) if self.ours else ""
        if not node.drained or not node.reason.startswith(REASON_PREFIX):
            # A person resumed it, or drained it again with their own reason: theirs now.
            log.info(
                "node no longer drained by gpuwarden; not resumed",
                node=self.node,
                state=node.state,
                reason=node.reason,
            )
            self._remember(None)
            self._succeeded()
            return
        outcome = await self._scontrol("resume", "update", f"nodename={self.node}", "state=resume")
        if not outcome.ok:
            self._failed("resume", outcome.describe())
            return
        self._remember(None)
        log.info("node resumed in Slurm: its findings cleared", node=self.node, reason=reason)
        self.context.emit(
            Event(
                source=SOURCE,
                kind="slurm_node_resumed",
                severity=Severity.INFO,
                repair_action=RepairAction.NONE,
                subject=self.node,
                message=f"Slurm node {self.node} resumed: the findings that drained it "
                f"cleared ({node.reason})",
                attributes={"node": self.node, "reason": node.reason},
            )
        )
        self._succeeded()

    def _remember(self, value: dict[str, object] | None) -> None:
        self.ours = value
        try:
            if value is None:
                self.context.state.delete(STATE_NAMESPACE, self.node)
            else:
                self.context.state.put(STATE_NAMESPACE, self.node, value)
        except Exception as exc:  # held in memory; a restart may then drain once more
            log.warning("Slurm drain state not stored", error=str(exc))

    # -- failures ----------------------------------------------------------------------------

    def _failed(self, operation: str, why: str, reason: str = "") -> None:
        first = not self._failing
        self._failing = True
        s = self.settings
        self._retry_delay = (
            s.retry_initial if first else min(s.retry_max, max(self._retry_delay, 0.1) * 2)
        )
        log.error(
            "scontrol failed; retrying",
            operation=operation,
            error=why,
            retry_in=self._retry_delay,
            node=self.node,
        )
        self.context.record_failure("actions", f"slurm {operation}: {why}")
        if first:  # raised once per streak; the counter and the log have every one
            self.context.emit(
                Event(
                    source=SOURCE,
                    kind="slurm_action_failed",
                    severity=Severity.CRITICAL,
                    repair_action=RepairAction.NONE,
                    subject=self.node,
                    message=f"Slurm {operation} of node {self.node} failed: {why}"
                    + (f" (wanted: {reason})" if reason else ""),
                    action=f"check scontrol on this host (munge, slurm.conf, the controller); "
                    f"gpuwarden retries; meanwhile drain by hand: scontrol update "
                    f'nodename={self.node} state=drain reason="{reason or "gpuwarden"}"',
                    attributes={"node": self.node, "operation": operation, "error": why},
                )
            )

    def _succeeded(self) -> None:
        if self._failing:
            log.info("scontrol works again", node=self.node)
        self._failing = False
        self._retry_delay = 0.0

    # -- metrics -----------------------------------------------------------------------------

    def families(self) -> Sequence[MetricFamily]:
        return (DRAINED, OPERATIONS)

    def samples(self) -> list[Sample]:
        out = [DRAINED.sample(1 if self.ours is not None else 0, self.node)]
        out += [OPERATIONS.sample(n, op, res) for (op, res), n in sorted(self.counts.items())]
        return out

    def problems(self) -> list[str]:
        return [f"Slurm node {self.node}: scontrol failing"] if self._failing else []


# -- gpuwarden check as Slurm's HealthCheckProgram ---------------------------------------------

CHECK_PREFIX: Final = REASON_PREFIX + "check: "
"""The reason `check --slurm` drains with: its own, so it resumes only what it drained."""


def check_reason(failures: Sequence[tuple[str, str, str]]) -> str:
    """One line for scontrol from (name, detail, repair action) of the failed findings."""
    name, detail, repair = failures[0]
    more = f" (+{len(failures) - 1} more)" if len(failures) > 1 else ""
    tail = f" [{repair}]{more}" if repair and repair != "none" else more
    head = f"{name}: {detail}".replace('"', "'").replace("\n", " ")
    room = REASON_LIMIT - len(CHECK_PREFIX) - len(tail)
    if len(head) > room:
        head = head[: room - 1].rstrip() + "…"
    return CHECK_PREFIX + head + tail


async def health_check(settings: SlurmSettings, reason: str | None) -> str:
    """Drain the node with `reason` (a failed check), or resume it when the check passed
    (`reason` None), `resume = "when_cleared"`, and the drain is the check's own. Returns what
    was done, for the log line; raises RuntimeError when scontrol fails."""
    node = settings.node_name or default_node_name()
    shown = await process.run([settings.scontrol, "show", "node", node], settings.timeout)
    if not shown.ok:
        raise RuntimeError(f"scontrol show node {node}: {shown.describe()}")
    state = parse_show_node(shown.stdout)
    if reason is not None:
        if state.drained and not state.reason.startswith(REASON_PREFIX):
            return f"already drained by someone else ({state.reason}); not touched"
        if state.drained:  # by gpuwarden (the daemon or an earlier check): leave its reason
            return f"already drained ({state.reason})"
        done = await process.run(
            [settings.scontrol, "update", f"nodename={node}", "state=drain", f"reason={reason}"],
            settings.timeout,
        )
        if not done.ok:
            raise RuntimeError(f"scontrol update nodename={node} state=drain: {done.describe()}")
        return f"drained {node}"
    if settings.resume != "when_cleared" or not (
        state.drained and state.reason.startswith(CHECK_PREFIX)
    ):
        return "nothing to do"
    done = await process.run(
        [settings.scontrol, "update", f"nodename={node}", "state=resume"], settings.timeout
    )
    if not done.ok:
        raise RuntimeError(f"scontrol update nodename={node} state=resume: {done.describe()}")
    return f"resumed {node}"
