"""Payloads of the MQTT topics: status (birth and Will), heartbeat and metric snapshots.

The heartbeat is the off-node watcher's view of the node's own health: a sequence number, the
interval to expect the next one in, when each collector last succeeded, when each sink last
confirmed a delivery (so the MQTT heartbeat says when Prometheus last scraped), the outbox
depth and drops, the overall health with its problems, notices (a configuration change
pending restart: shown, not a failure), and whether the GPUs are paused (`gpu`, `paused`). Ages are seconds at `ts`; a
timestamp that never happened is null, never 0.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from agent import __version__
from agent.contracts.sink import SinkContext


def encode(payload: Mapping[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":"), sort_keys=True).encode()


def status_payload(state: str, bdseq: int, ts: float, reason: str = "") -> bytes:
    """The status topic's payload. `reason` tells a deliberate stop ("shutdown") from the
    broker's Will (no reason), so the watcher does not page for a planned stop."""
    payload: dict[str, object] = {
        "state": state,
        "bdseq": bdseq,
        "ts": round(ts, 3),
        "version": __version__,
    }
    if reason:
        payload["reason"] = reason
    return encode(payload)


def _rounded(age: float | None) -> float | None:
    """An age as the heartbeat reports it (measured on a clock that does not step)."""
    return None if age is None else round(max(0.0, age), 3)


def heartbeat_payload(
    runtime: SinkContext,
    *,
    seq: int,
    bdseq: int,
    now: float,
    outbox_depth: Mapping[str, int],
    outbox_dropped: Mapping[str, int],
) -> bytes:
    health = runtime.health(now)
    paused = runtime.pause_state()
    collectors = {
        name: {
            "ok": status.success,
            "last_success_ts": status.last_success,
            "last_success_age_s": _rounded(status.last_success_age(now)),
            "interval_s": status.settings.interval,
            "paused": status.paused,
        }
        for name, status in sorted(runtime.collectors.items())
    }
    sinks = {
        name: {
            "up": entry.up,
            "last_delivery_ts": entry.last_delivery,
            "last_delivery_age_s": _rounded(entry.delivery_age(now)),
            "failures": entry.failures,
        }
        for name, entry in sorted(runtime.ledger.items())
    }
    prometheus = runtime.ledger.get("prometheus")
    return encode(
        {
            "seq": seq,
            "bdseq": bdseq,
            "ts": round(now, 3),
            "interval_s": runtime.heartbeat_settings.interval,
            "node": runtime.node_id,
            "version": __version__,
            "health": "ok" if health.ok else list(health.problems),
            # Not problems (the watcher does not alert on them): where the running agent
            # differs from its file, e.g. a change pending restart (agent.runtime.Health).
            "notices": list(health.notices),
            "collectors": collectors,
            "sinks": sinks,
            "prometheus_last_scrape_ts": None if prometheus is None else prometheus.last_delivery,
            "outbox": {"depth": dict(outbox_depth), "dropped": dict(outbox_dropped)},
            # The GPUs let go of on request (gpuwarden pause): no GPU is watched until
            # until_ts, and the watcher does not alert on this node's GPUs meanwhile.
            "gpu": "paused" if paused is not None else "active",
            "paused": None
            if paused is None
            else {
                **paused.to_dict(),
                "collectors": sorted(n for n, c in runtime.collectors.items() if c.paused),
            },
        }
    )


def metrics_payload(runtime: SinkContext, now: float) -> bytes:
    """The current samples, compactly: one entry per family, label names once.

    {"ts": ..., "node": ..., "metrics": {name: {"labels": [...], "series": [[v1, ..., value]]}}}
    """
    families: dict[str, dict[str, Any]] = {}
    for sample in runtime.samples():
        family = families.setdefault(
            sample.family.name, {"labels": list(sample.family.labels), "series": []}
        )
        family["series"].append([*sample.label_values, sample.value])
    return encode({"ts": round(now, 3), "node": runtime.node_id, "metrics": families})


# -- payloads cut to a broker's maximum packet size ---------------------------------------------
#
# A broker ends the connection of a client that sends a packet larger than its Maximum Packet
# Size (exporters/mqtt_client.py, PacketTooLarge). What is too large for it is cut to fit here,
# keeping what consumers act on, and says so: `"truncated"` in the payload. The whole event
# stays in the node's own history (the state store; `gpuwarden diag` packs it).

EVENT_KEPT = ("id", "time", "node", "source", "kind", "severity", "subject", "repair_action")
"""An event's fields a cut keeps whole: what it is, about what, and what must be done."""
MARK = "…"
CUTTABLE = ("message", "action", "clears", "aliases", "attributes")


def _size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":")).encode())


def _cut_text(text: str, room: int) -> str:
    """The longest head of `text` (with MARK) whose JSON string takes at most `room` bytes."""
    if _size(text) <= room:
        return text
    low, high = 0, len(text)
    while low < high:  # the longest prefix that fits, by bisection
        middle = (low + high + 1) // 2
        if _size(text[:middle] + MARK) <= room:
            low = middle
        else:
            high = middle - 1
    return text[:low] + MARK if low else ""


class _Budget:
    """Bytes left for the parts of a cut payload; compact JSON sizes add up exactly."""

    def __init__(self, left: int) -> None:
        self.left = left

    def text(self, text: str, entry: int) -> str | None:
        """The longest head of `text` that fits after `entry` bytes of key; None: no room."""
        if self.left < entry + _size(""):
            return None
        value = _cut_text(text, self.left - entry)
        self.left -= entry + _size(value)
        return value

    def names(self, names: list[str], entry: int) -> list[str] | None:
        """As many of `names` as fit in a list after `entry` bytes of key; None: no room."""
        if self.left < entry + 2:
            return None
        self.left -= entry + 2
        kept: list[str] = []
        for name in names:
            cost = _size(name) + (1 if kept else 0)
            if cost > self.left:
                break
            kept.append(name)
            self.left -= cost
        return kept

    def mapping(self, items: dict[str, Any], entry: int) -> dict[str, Any] | None:
        """The items that fit in an object after `entry` bytes of key, the smallest first."""
        if self.left < entry + 2:
            return None
        self.left -= entry + 2
        chosen: dict[str, Any] = {}
        for name, value in sorted(items.items(), key=_size):
            cost = _size(name) + 1 + _size(value) + (1 if chosen else 0)
            if cost > self.left:
                break
            chosen[name] = value
            self.left -= cost
        return chosen


def _entry(key: str) -> int:
    """Bytes of `,"key":` in an object that already has an entry."""
    return 1 + _size(key) + 1


def cut_event(payload: bytes, room: int) -> bytes | None:
    """The event in `payload` cut to at most `room` bytes, or None when not even its kept
    fields fit. Kept whole: EVENT_KEPT; then, as room allows, `message` (never empty) and
    `action` cut short with MARK, `clears` and `aliases` (as many names as fit), and the
    attributes, the smallest first. `"truncated"` says how large the event was and what was
    left out or cut."""
    data = json.loads(payload)
    attributes: dict[str, Any] = dict(data.get("attributes") or {})
    cut: dict[str, Any] = {key: data[key] for key in EVENT_KEPT if key in data}
    # The note at its largest (every part named, every attribute left out): what it will say
    # can only be shorter. The message is never empty (an event needs one): MARK at least.
    largest = {"bytes": len(payload), "cut": list(CUTTABLE), "attributes_left_out": len(attributes)}
    budget = _Budget(room - _size({**cut, "truncated": largest, "message": MARK}))
    if budget.left < 0:
        return None
    budget.left += _entry("message") + _size(MARK)
    parts: dict[str, Any] = {}
    parts["message"] = budget.text(str(data.get("message", "")), _entry("message")) or MARK
    parts["action"] = budget.text(str(data.get("action", "")), _entry("action"))
    for key in ("clears", "aliases"):
        names = [str(name) for name in data.get(key) or ()]
        if names or key == "clears":
            parts[key] = budget.names(names, _entry(key))
    parts["attributes"] = budget.mapping(attributes, _entry("attributes"))
    sent = {key: _EMPTY[key] if parts.get(key) is None else parts[key] for key in CUTTABLE}
    shortened = [key for key in CUTTABLE if sent[key] != (data.get(key) or _EMPTY[key])]
    cut.update((key, value) for key, value in parts.items() if value is not None)
    left_out = len(attributes) - len(cut.get("attributes", ()))
    cut["truncated"] = {"bytes": len(payload), "cut": shortened, "attributes_left_out": left_out}
    out = encode(cut)
    return out if len(out) <= room else None


_EMPTY: dict[str, Any] = {
    "message": "",
    "action": "",
    "clears": [],
    "aliases": [],
    "attributes": {},
}
"""What a part of an event is when the event has none."""


HEARTBEAT_KEPT = ("seq", "ts", "interval_s", "health", "truncated")
"""What the watcher needs of a heartbeat (agent/program/watch/payloads.py), kept to the last."""
HEARTBEAT_OPTIONAL = ("gpu", "paused", "bdseq", "node", "version", "outbox", "notices")
"""Kept after those, as room allows, in this order."""


def compact_heartbeat(payload: bytes, room: int) -> bytes | None:
    """The heartbeat in `payload` in at most `room` bytes, or None. It leaves out the
    per-collector and per-sink detail, keeps as many problems (each cut to 200 characters, as
    the watcher reads them) as fit, then the fields of HEARTBEAT_OPTIONAL that fit; marked
    `"truncated": true`."""
    data = json.loads(payload)
    health = data.get("health")
    compact: dict[str, Any] = {"seq": data["seq"], "ts": data["ts"]}
    compact["interval_s"] = data["interval_s"]
    compact["truncated"] = True
    compact["health"] = [] if isinstance(health, list) else health
    if _size(compact) > room:
        return None
    if isinstance(health, list):
        left = room - _size(compact)
        for problem in health[:10]:
            text = str(problem)[:200]
            if _size(text) + 1 > left:
                break
            compact["health"].append(text)
            left -= _size(text) + 1
        if not compact["health"]:
            compact["health"] = "unhealthy"
    for key in HEARTBEAT_OPTIONAL:
        if key in data:
            trial = {**compact, key: data[key]}
            if _size(trial) <= room:
                compact = trial
    out = encode(compact)
    return out if len(out) <= room else None
