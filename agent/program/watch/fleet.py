"""The watcher's state machine: pure, clock-injected (every call takes `now`), no I/O.

A node is
- **online**: its status says online and its heartbeat is fresh;
- **stale**: online, but its last heartbeat is older than k × its own announced interval
  (a hung agent whose connection is still up: the broker sees keepalives, so no Will comes);
- **dead**: its Will (offline, with the current birth number) arrived;
- **stopped**: it published offline itself on a clean stop (`"reason": "shutdown"`), most
  likely on purpose: a warning, not a page;
- **missing**: in the inventory and never seen.

Birth numbers: an offline with a bdseq older than the last online is a Will of an earlier
connection delivered late, and is ignored; so is a birth older than the current one (an agent
counts up on every connection, so only a replay or a forgery goes back). Only status messages
change online/offline; heartbeats only refresh the age.

Nodes are forgotten, not paged for, when nothing says they exist any more: a node known only
through heartbeats (no status: a decommissioned node's leftover retained heartbeat, or an
invented id) raises no alert and is forgotten once silent; a node offline and silent for
`forget_offline_after` seconds is forgotten. With an inventory, nodes outside it are counted
and never enter the table. The table is bounded (`max_nodes`); when full, a newcomer with a
birth takes the place of the least believable nodes (heartbeat-only, then long offline, then
born but never beating): a node that is born and beating is never pushed out, so junk cannot
keep a real node out.

Broker-level silence is one alert, not N: while the watcher has no broker the node alerts are
frozen as they were (a silent broker says nothing about the nodes) and `broker_unreachable`
is raised after a grace. After a reconnection, the nodes not yet heard again keep their
alerts as they were for up to `reconnect_grace` seconds (they are reconnecting too, with their
own backoff), and `broker_unreachable` stays raised until they are back or the grace is over:
an outage and its aftermath are one alert. When every node still alive falls silent within
`quiet_window` seconds of the others, their stale and dead alerts are replaced by one
`fleet_quiet` alert.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from agent.contracts.model import RepairAction, Severity
from agent.program.watch import payloads
from agent.program.watch.payloads import Heartbeat, Malformed, Status

OVERDUE_INTERVALS = 1.5
"""A node that missed a beat (silent for 1.5 intervals) counts as silent for the fleet check."""
SETTLE_SECONDS = 3.0
"""After (re)connecting, retained messages arrive within milliseconds; wait a little anyway."""
BROKER_KEY = ("broker_unreachable", "")
NODE_KINDS = ("node_dead", "node_stopped", "node_missing", "node_stale", "node_unhealthy")
ALERT_KINDS = (*NODE_KINDS, "broker_unreachable", "fleet_quiet")
"""Every kind of alert the watcher raises (the Alertmanager alertnames follow from them)."""
DISPROVED_BY_ARRIVAL = re.compile(r"sink mqtt has not delivered\b")
"""A heartbeat's problem that its own arrival disproves: it came through the MQTT sink. The
heartbeats an agent queued while its broker was away all say so, and are delivered after the
reconnection; the agent's health itself clears at the next one (agent/runtime/core.py)."""
OUTAGE_WILL_SECONDS = 5.0
"""Wills that arrive this close before the watcher loses the broker are the broker's own
going: mosquitto publishes every client's Will as it shuts down, then closes the watcher's
connection too. They are judged after the reconnection, like the nodes' silence."""
EVICT_FRACTION = 100
"""A full table makes room for 1/100 of its size at once: one scan per that many newcomers."""


class State(enum.StrEnum):
    ONLINE = "online"
    STALE = "stale"
    DEAD = "dead"
    STOPPED = "stopped"
    MISSING = "missing"


@dataclass(slots=True)
class Node:
    # slots: a fleet holds up to max_nodes of these (bench/watch_fleet.py).
    node: str
    in_inventory: bool = False
    online: bool | None = None
    """None: no status seen yet."""
    bdseq: int | None = None
    clean_stop: bool = False
    version: str = ""
    born_at: float | None = None
    offline_at: float | None = None
    heartbeat_at: float | None = None
    """When the watcher got the last heartbeat, on its own clock."""
    heard_at: float | None = None
    outage_will: bool = False
    """Its Will came as the broker went away (OUTAGE_WILL_SECONDS): not yet a death."""
    """When the watcher last heard the node itself: a new heartbeat or a live status."""
    heartbeat_ts: float | None = None
    """That heartbeat's `ts`, on the node's clock: with `seq`, it names the beat."""
    seq: int | None = None
    interval: float | None = None
    health_ok: bool | None = None
    problems: tuple[str, ...] = ()
    paused: tuple[str, ...] = ()
    """Collectors whose GPUs the node let go of on request (its last heartbeat)."""

    @property
    def heartbeat_only(self) -> bool:
        """Known from heartbeats alone: no status says the node exists."""
        return self.online is None and not self.in_inventory

    def last_sign(self) -> float | None:
        times = [t for t in (self.heartbeat_at, self.born_at) if t is not None]
        return max(times) if times else None


@dataclass(frozen=True)
class Alert:
    kind: str
    node: str
    """"" for broker-level alerts."""
    severity: Severity
    message: str
    action: str
    since: float
    repair_action: RepairAction = RepairAction.INVESTIGATE
    """Every watcher alert is a silence or a delivery failure: no remedy is known from here,
    someone has to look (agent/contracts/model.py)."""

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.node)

    def to_dict(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "node": self.node,
            "severity": self.severity.label,
            "message": self.message,
            "action": self.action,
            "repair_action": self.repair_action.value,
            "since": self.since,
        }


@dataclass(frozen=True)
class AlertChange:
    raised: bool
    """True: the alert starts; False: it clears."""
    alert: Alert
    at: float

    def to_dict(self) -> dict[str, object]:
        return {"event": "raise" if self.raised else "clear", "at": self.at, **self.alert.to_dict()}


@dataclass
class Counters:
    messages: dict[str, int] = field(default_factory=lambda: {"status": 0, "heartbeat": 0})
    malformed: dict[str, int] = field(default_factory=dict)
    ignored_old_births: int = 0
    """Offline messages (Wills) older than the current birth: `stale_wills` in /metrics."""
    ignored: dict[str, int] = field(default_factory=dict)
    """Messages not taken, by reason: old_birth, outside_inventory, node_limit."""
    forgotten: dict[str, int] = field(default_factory=dict)
    """Nodes dropped from the table, by reason: cleared, heartbeat_only, offline_silent, evicted."""


@dataclass(frozen=True)
class NodeView:
    node: str
    state: State
    heartbeat_age: float | None
    interval: float
    bdseq: int | None


class Fleet:
    """Every node the watcher knows, and the alerts that follow from them."""

    def __init__(
        self,
        *,
        prefix: str = "gpuwarden/v1",
        stale_after_intervals: float = 3.0,
        default_interval: float = 15.0,
        quiet_window: float = 30.0,
        quiet_min_nodes: int = 2,
        broker_grace: float = 10.0,
        max_payload_bytes: int = 65536,
        max_nodes: int = 100_000,
        reconnect_grace: float = 90.0,
        forget_offline_after: float = 7 * 86400.0,
        inventory: Iterable[str] = (),
        now: float = 0.0,
    ) -> None:
        self.prefix = prefix
        self.k = stale_after_intervals
        self.default_interval = default_interval
        self.quiet_window = quiet_window
        self.quiet_min_nodes = quiet_min_nodes
        self.broker_grace = broker_grace
        self.max_payload_bytes = max_payload_bytes
        self.max_nodes = max_nodes
        self.reconnect_grace = reconnect_grace
        self.forget_offline_after = forget_offline_after
        self.started_at = now
        self.nodes: dict[str, Node] = {}
        self.counters = Counters()
        self.active: dict[tuple[str, str], Alert] = {}
        self.connected = False
        self.disconnected_since: float | None = now
        self.connected_at: float | None = None
        self._quiet_members: set[str] = set()
        self._recovering: dict[str, float] = {}
        """Members of a fleet silence that ended: no node alert for them until this time."""
        for node in inventory:
            self.nodes[node] = Node(node, in_inventory=True)
        self.has_inventory = bool(self.nodes)

    def shift(self, delta: float) -> None:
        """The watcher's wall clock stepped by `delta` seconds: move every time held on it by
        as much, so that each age and deadline goes on where it was and what is reported
        (an alert's `since`) reads on the clock as it is now. A heartbeat's `ts` is the
        node's clock and stays."""
        for node in self.nodes.values():
            for name in ("born_at", "offline_at", "heartbeat_at", "heard_at"):
                value = getattr(node, name)
                if value is not None:
                    setattr(node, name, value + delta)
        self.started_at += delta
        if self.disconnected_since is not None:
            self.disconnected_since += delta
        if self.connected_at is not None:
            self.connected_at += delta
        self._recovering = {name: until + delta for name, until in self._recovering.items()}
        self.active = {
            key: dataclasses.replace(alert, since=alert.since + delta)
            for key, alert in self.active.items()
        }

    # -- input ------------------------------------------------------------------------------

    def ingest(self, topic: str, payload: bytes, retained: bool, now: float) -> bool:
        """One message. False if it was malformed (counted) or ignored."""
        where = payloads.parse_topic(topic, self.prefix)
        if where is None:
            return False
        if isinstance(where, Malformed):
            return self._malformed(where)
        self.counters.messages[where.kind] += 1
        node = self.nodes.get(where.node)
        if not payload:
            # An empty retained status is how an operator removes a decommissioned node (an
            # empty heartbeat, how an agent clears its own on a clean stop: nothing to do).
            if where.kind == "status" and node is not None:
                self._forget(node, "cleared")
            return False
        parsed: Status | Heartbeat | Malformed
        if where.kind == "status":
            parsed = payloads.parse_status(payload, self.max_payload_bytes)
        else:
            parsed = payloads.parse_heartbeat(payload, self.max_payload_bytes)
        if isinstance(parsed, Malformed):
            return self._malformed(parsed)
        if node is None and self.has_inventory:
            return self._ignore("outside_inventory")  # counted, never in the table
        if node is None:
            if len(self.nodes) >= self.max_nodes and not self._make_room(parsed):
                return self._ignore("node_limit")
            node = self.nodes[where.node] = Node(where.node)
        if isinstance(parsed, Status):
            return self._status_message(node, parsed, retained, now)
        return self._heartbeat_message(node, parsed, retained, now)

    def _status_message(self, node: Node, status: Status, retained: bool, now: float) -> bool:
        # A retained status is as old as its `ts` says (bounded by now: a node's clock ahead
        # of ours must not make it look younger than fresh); a live message is as old as now.
        at = min(now, status.ts) if retained and status.ts is not None else now
        if not self._status(node, status, at):
            return False
        if not retained:
            node.heard_at = now
        return True

    def _heartbeat_message(self, node: Node, parsed: Heartbeat, retained: bool, now: float) -> bool:
        if retained and self._held(node, parsed):
            return True  # sent again on resubscription: its age runs on from when we got it
        # A retained heartbeat new to us is dated on arrival, not by its `ts`: a node whose
        # clock is behind ours by k intervals would otherwise be stale from the start until
        # its next live beat. A node that really fell silent is then stale k intervals later,
        # on our clock: the most a retained beat can buy.
        self._heartbeat(node, parsed, now)
        return True

    def _malformed(self, bad: Malformed) -> bool:
        self.counters.malformed[bad.reason] = self.counters.malformed.get(bad.reason, 0) + 1
        return False

    def _ignore(self, reason: str) -> bool:
        self.counters.ignored[reason] = self.counters.ignored.get(reason, 0) + 1
        return False

    def _forget(self, node: Node, reason: str) -> None:
        self.counters.forgotten[reason] = self.counters.forgotten.get(reason, 0) + 1
        if node.in_inventory:
            self.nodes[node.node] = Node(node.node, in_inventory=True)
        else:
            del self.nodes[node.node]

    def _make_room(self, parsed: Status | Heartbeat) -> bool:
        """The table is full. Only a birth may push others out (a heartbeat-only newcomer
        could not raise an alert anyway, and the node's birth comes first): the oldest
        heartbeat-only nodes, then those offline longest, then those born and never beating.
        A batch at a time, so that a flood costs one scan per batch, not one per message."""
        if not isinstance(parsed, Status):
            return False
        candidates: list[tuple[int, float, str]] = []
        for node in self.nodes.values():
            if node.in_inventory:
                continue
            if node.heartbeat_only:
                candidates.append((0, node.heard_at or 0.0, node.node))
            elif node.online is False:
                candidates.append((1, node.offline_at or 0.0, node.node))
            elif node.heartbeat_at is None:
                candidates.append((2, node.born_at or 0.0, node.node))
        if not candidates:
            return False
        for _, _, name in heapq.nsmallest(max(1, self.max_nodes // EVICT_FRACTION), candidates):
            self._forget(self.nodes[name], "evicted")
        return True

    def _status(self, node: Node, status: Status, at: float) -> bool:
        if status.online:
            # An agent counts its births up and never repeats one after its Will or clean
            # stop: a birth that goes back is a replay or a forgery (counted, not believed).
            if node.bdseq is not None and (
                status.bdseq < node.bdseq or (status.bdseq == node.bdseq and node.online is False)
            ):
                return self._ignore("old_birth")
            node.online, node.bdseq, node.born_at = True, status.bdseq, at
            node.outage_will = False
            node.version, node.clean_stop, node.offline_at = status.version, False, None
            return True
        if node.bdseq is not None and status.bdseq < node.bdseq:
            self.counters.ignored_old_births += 1
            return False
        node.online, node.bdseq, node.offline_at = False, status.bdseq, at
        node.clean_stop = status.clean_stop
        return True

    @staticmethod
    def _held(node: Node, beat: Heartbeat) -> bool:
        """The beat we hold, or an earlier one (a restarted node counts from seq 0 again)."""
        if node.seq is None or node.heartbeat_ts is None:
            return False
        return beat.seq <= node.seq and beat.ts <= node.heartbeat_ts

    def _heartbeat(self, node: Node, beat: Heartbeat, at: float) -> None:
        node.heartbeat_at, node.heard_at, node.heartbeat_ts = at, at, beat.ts
        node.seq, node.interval = beat.seq, beat.interval_s
        # A paused collector's problem is the pause's doing (an operator resetting the GPU),
        # not the node's: no alert for it while the node says it is paused.
        paused = tuple(f"collector {name} " for name in beat.paused)
        problems = tuple(
            p
            for p in beat.problems
            if not DISPROVED_BY_ARRIVAL.match(p) and not any(p.startswith(q) for q in paused)
        )
        node.paused = beat.paused
        healthy = beat.health_ok is False and bool(beat.problems) and not problems
        node.health_ok, node.problems = (True if healthy else beat.health_ok), problems

    def broker_connected(self, now: float) -> None:
        self.connected, self.connected_at, self.disconnected_since = True, now, None

    def broker_disconnected(self, now: float) -> None:
        if self.connected:
            for node in self.nodes.values():
                if (
                    node.online is False
                    and not node.clean_stop
                    and node.offline_at is not None
                    and now - node.offline_at <= OUTAGE_WILL_SECONDS
                ):
                    node.outage_will = True
        if self.connected or self.disconnected_since is None:
            self.disconnected_since = now
        self.connected = False

    # -- state ------------------------------------------------------------------------------

    def interval_of(self, node: Node) -> float:
        return node.interval if node.interval is not None else self.default_interval

    def state_of(self, node: Node, now: float) -> State:
        if node.online is False:
            return State.STOPPED if node.clean_stop else State.DEAD
        last = node.last_sign()
        if last is None:
            return State.MISSING
        if now - last > self.k * self.interval_of(node):
            return State.STALE
        return State.ONLINE

    def views(self, now: float) -> list[NodeView]:
        return [
            NodeView(
                n.node,
                self.state_of(n, now),
                None if n.heartbeat_at is None else max(0.0, now - n.heartbeat_at),
                self.interval_of(n),
                n.bdseq,
            )
            for n in self.nodes.values()
        ]

    # -- alerts -----------------------------------------------------------------------------

    def evaluate(self, now: float) -> list[AlertChange]:
        """Compare what should be alerting now with what is, and return the differences."""
        if self._settled(now):
            self._sweep(now)
        desired = self._desired(now)
        changes: list[AlertChange] = []
        for key, alert in desired.items():
            if key not in self.active:
                self.active[key] = alert
                changes.append(AlertChange(True, alert, now))
        for key in [k for k in self.active if k not in desired]:
            changes.append(AlertChange(False, self.active.pop(key), now))
        return changes

    def _settled(self, now: float) -> bool:
        return (
            self.connected
            and self.connected_at is not None
            and now - self.connected_at >= SETTLE_SECONDS
        )

    def _sweep(self, now: float) -> None:
        """Forget the nodes nothing says exist any more (their alerts clear with them)."""
        gone = [
            (node, why) for node in self.nodes.values() if (why := self._forgettable(node, now))
        ]
        for node, why in gone:
            self._forget(node, why)

    def _forgettable(self, node: Node, now: float) -> str:
        if node.in_inventory:
            return ""
        if node.heartbeat_only:
            # Its own interval is the sender's say: a junk id announcing a day must not stay
            # a day. A real node is heartbeat-only only until its status arrives.
            interval = min(self.interval_of(node), self.default_interval)
            last = node.heard_at or node.heartbeat_at or now
            return "heartbeat_only" if now - last > self.k * interval else ""
        if node.online is False:
            last = max(node.offline_at or now, node.heard_at or 0.0)
            return "offline_silent" if now - last >= self.forget_offline_after else ""
        return ""

    def _waiting(self, node: Node) -> bool:
        """Born (or dead only by the outage's Will), and not heard since the watcher's
        reconnection: probably reconnecting too."""
        since = self.connected_at or 0.0
        alive = node.online is True or node.outage_will
        return alive and (node.heard_at is None or node.heard_at < since)

    def _aftermath(self, now: float) -> bool:
        """The time after a reconnection while some nodes have not come back yet."""
        if self.connected_at is None or now >= self.connected_at + self.reconnect_grace:
            return False
        return any(self._waiting(node) for node in self.nodes.values())

    def _unsettled(self, now: float) -> dict[tuple[str, str], Alert]:
        """Nothing can be learnt about nodes now: keep their alerts as they were."""
        out = {k: a for k, a in self.active.items() if k != BROKER_KEY}
        down = self.disconnected_since
        if down is not None and now - down >= self.broker_grace:
            alert = _broker_alert(down, now)
            out[alert.key] = alert
        elif BROKER_KEY in self.active:
            out[BROKER_KEY] = self.active[BROKER_KEY]  # back, still settling
        return out

    def _node_alerts(self, now: float, aftermath: bool) -> dict[tuple[str, str], Alert]:
        out: dict[tuple[str, str], Alert] = {}
        for node in self.nodes.values():
            if aftermath and self._waiting(node):
                # Silent since before the outage: no news, so its alerts stay as they were.
                for kind in NODE_KINDS:
                    if (kind, node.node) in self.active:
                        out[(kind, node.node)] = self.active[(kind, node.node)]
                continue
            node_alert = self._node_alert(node, now)
            if node_alert is not None:
                out[node_alert.key] = node_alert
        return out

    def _desired(self, now: float) -> dict[tuple[str, str], Alert]:
        if not self._settled(now):
            return self._unsettled(now)
        aftermath = self._aftermath(now)
        out = self._node_alerts(now, aftermath)
        if aftermath:
            # The outage's one alert lasts until the fleet is back; no fleet verdict meanwhile.
            for key in (BROKER_KEY, ("fleet_quiet", "")):
                if key in self.active:
                    out[key] = self.active[key]
            return self._spare(out, (), now)
        quiet = self._quiet_group(now)
        if quiet:
            self._quiet_members, self._recovering = set(quiet), {}
            alert = _fleet_alert(sorted(quiet), len(self.nodes), now)
            out[alert.key] = alert
        elif self._quiet_members:
            # The fleet talks again, but its members come back one by one: give the others
            # one more stale period before each counts as hung or dead on its own.
            for name in self._quiet_members:
                if name in self.nodes:
                    self._recovering[name] = now + self.k * self.interval_of(self.nodes[name])
            self._quiet_members = set()
        return self._spare(out, quiet, now)

    def _spare(
        self, out: dict[tuple[str, str], Alert], names: Iterable[str], now: float
    ) -> dict[tuple[str, str], Alert]:
        """No stale or dead alert for members of a fleet silence, or those coming back."""
        self._recovering = {n: t for n, t in self._recovering.items() if now < t}
        for name in [*names, *self._recovering]:
            out.pop(("node_stale", name), None)
            out.pop(("node_dead", name), None)
        return out

    def _quiet_group(self, now: float) -> list[str]:
        """Nodes that fell silent together, if no live node is left talking; else []."""
        silent: list[tuple[float, str, State]] = []
        for node in self.nodes.values():
            if node.heartbeat_only:
                continue  # not a member: its silence, or its talk, proves nothing
            state = self.state_of(node, now)
            last = node.last_sign()
            if state in (State.STOPPED, State.MISSING) or last is None:
                continue
            overdue = now - last > OVERDUE_INTERVALS * self.interval_of(node)
            if state is State.ONLINE and not overdue:
                return []  # someone is still talking: the path to the broker works
            silent.append((last, node.node, state))
        if not silent:
            return []
        latest = max(last for last, _, _ in silent)
        group = [
            (name, state) for last, name, state in silent if last >= latest - self.quiet_window
        ]
        if len(group) < self.quiet_min_nodes:
            return []
        if not any(state in (State.STALE, State.DEAD) for _, state in group):
            return []
        return [name for name, _ in group]

    def _node_alert(self, node: Node, now: float) -> Alert | None:
        if node.heartbeat_only:
            return None  # nothing says this node exists: forgotten once silent, never paged
        state = self.state_of(node, now)
        name = node.node
        if state is State.DEAD:
            return Alert(
                "node_dead",
                name,
                Severity.CRITICAL,
                f"{name}: the agent's connection died (MQTT Will, birth {node.bdseq})",
                f"check that {name} is up and gpuwarden.service runs on it: "
                "systemctl status gpuwarden; journalctl -u gpuwarden",
                node.offline_at or now,
            )
        if state is State.STOPPED:
            return Alert(
                "node_stopped",
                name,
                Severity.WARNING,
                f"{name}: the agent was stopped cleanly and has not come back",
                f"if the stop was not planned: systemctl start gpuwarden on {name}; "
                "to retire the node, clear its retained status topic",
                node.offline_at or now,
            )
        if state is State.MISSING:
            return Alert(
                "node_missing",
                name,
                Severity.WARNING,
                f"{name}: in the inventory but never heard from",
                f"install and start gpuwarden on {name}, check its broker URL and "
                "credentials, or remove it from the inventory",
                self.started_at,
            )
        if state is State.STALE:
            interval = self.interval_of(node)
            last = node.last_sign() or now
            return Alert(
                "node_stale",
                name,
                Severity.CRITICAL,
                f"{name}: no heartbeat for {now - last:.0f} s (interval {interval:g} s) "
                "while its connection is up: the agent is hung",
                f"on {name}: systemctl status gpuwarden; py-spy dump or restart it",
                last + self.k * interval,
            )
        if node.health_ok is False:
            problems = "; ".join(node.problems) or "unhealthy"
            return Alert(
                "node_unhealthy",
                name,
                Severity.WARNING,
                f"{name}: the agent reports problems: {problems}"[:500],
                f"on {name}: curl the agent's /healthz and read its log",
                node.heartbeat_at or now,
            )
        return None


def _broker_alert(since: float, now: float) -> Alert:
    return Alert(
        "broker_unreachable",
        "",
        Severity.CRITICAL,
        f"the watcher has had no broker connection for {now - since:.0f} s: "
        "no node can be seen, and node alerts are frozen as they were",
        "check the broker (systemctl status mosquitto), the network and the "
        "watcher's [watch] url and credentials",
        since,
    )


def _fleet_alert(nodes: list[str], total: int, now: float) -> Alert:
    shown = ", ".join(nodes[:10]) + (" ..." if len(nodes) > 10 else "")
    return Alert(
        "fleet_quiet",
        "",
        Severity.CRITICAL,
        f"{len(nodes)} of {total} nodes went silent together ({shown}): the broker, "
        "a bridge or the network between the nodes and the broker is the likely cause",
        "check the broker's log and its listeners, bridges and the network path from "
        "the nodes; a node-by-node search will not help",
        now,
    )
