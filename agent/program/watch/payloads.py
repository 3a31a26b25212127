"""Parsing what arrives on the status and heartbeat topics. Input is hostile until proven not.

Every rejection is a `Malformed` with a short reason (a metric label), never an exception: the
watcher counts it and carries on. Checks happen cheapest first: topic shape, size, then JSON,
then the fields. Times are wall-clock seconds since the epoch (the agents' `ts`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Literal

from agent.contracts.config import NODE_ID

# NODE_ID (agent.config): the ids an agent accepts for itself are the ids the watcher accepts;
# `_`-led levels (like `_watch`) are the watcher's own namespace.

MAX_SEQ = 2**63 - 1
"""seq and bdseq are at most a signed 64-bit integer; anything larger is garbage."""
MAX_TS = 32503680000.0
"""Year 3000: a later timestamp is garbage, not a clock skew."""
MAX_INTERVAL = 86400.0
SHUTDOWN_REASONS = frozenset({"shutdown", "stop", "stopped", "clean"})
"""`reason` values of an offline status published by the agent itself on a clean stop."""

Reason = Literal[
    "bad_topic",
    "bad_node_id",
    "too_large",
    "not_utf8",
    "not_json",
    "duplicate_key",
    "not_object",
    "bad_field",
]
Kind = Literal["status", "heartbeat"]


@dataclass(frozen=True)
class Malformed:
    reason: Reason
    detail: str


@dataclass(frozen=True)
class Topic:
    node: str
    kind: Kind


@dataclass(frozen=True)
class Status:
    online: bool
    bdseq: int
    ts: float | None
    version: str
    clean_stop: bool
    """An offline the agent published on purpose (`"reason": "shutdown"`), not its Will."""


@dataclass(frozen=True)
class Heartbeat:
    seq: int
    ts: float
    interval_s: float
    health_ok: bool | None
    problems: tuple[str, ...]
    paused: tuple[str, ...] = ()
    """Collectors the node has let go of the GPUs for (`gpuwarden pause`): their problems are
    not the node's while it lasts."""


_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")
"""A collector's name, as the registry spells them."""


def parse_topic(topic: str, prefix: str) -> Topic | Malformed | None:
    """None for the reserved `<prefix>/_name/...` levels (the watcher's own status)."""
    head = prefix + "/"
    if not topic.startswith(head):
        return Malformed("bad_topic", "outside the prefix")
    node, sep, kind = topic[len(head) :].partition("/")
    if node.startswith("_") and "/" not in kind:
        return None
    if not sep or kind not in ("status", "heartbeat"):
        return Malformed("bad_topic", "not <prefix>/<node>/status or heartbeat")
    if not NODE_ID.fullmatch(node):
        return Malformed("bad_node_id", "node id with characters outside [A-Za-z0-9._:-]")
    return Topic(node, "status" if kind == "status" else "heartbeat")


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """object_pairs_hook: a key given twice is refused. With the last one winning, a payload
    could say one thing to this parser and another to a first-wins one on the way."""
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise _DuplicateKey(key)
        data[key] = value
    return data


def _text(payload: bytes) -> str | Malformed:
    """The payload as UTF-8 (RFC 8259 says JSON between systems is UTF-8). json.loads(bytes)
    would also take UTF-16 and UTF-32 and skip a BOM: one document, several spellings."""
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError as exc:
        return Malformed("not_utf8", f"not UTF-8 at byte {exc.start} (UTF-16 or UTF-32?)")
    if text.startswith("\ufeff"):
        return Malformed("not_utf8", "starts with a byte order mark")
    if "\x00" in text:
        return Malformed("not_utf8", "NUL characters (UTF-16 or UTF-32 without a BOM?)")
    return text


def _load_object(payload: bytes, limit: int) -> dict[str, Any] | Malformed:
    if len(payload) > limit:
        return Malformed("too_large", f"{len(payload)} bytes > {limit}")
    text = _text(payload)
    if isinstance(text, Malformed):
        return text
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as exc:
        return Malformed("duplicate_key", f"key {str(exc)[:64]!r} given twice")
    except (ValueError, RecursionError) as exc:
        # ValueError covers bad JSON and integers past Python's digit limit;
        # RecursionError, nesting deeper than the parser's stack.
        return Malformed("not_json", type(exc).__name__)
    if not isinstance(data, dict):
        return Malformed("not_object", type(data).__name__)
    return data


def _int(data: dict[str, Any], key: str) -> int | None:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEQ:
        return None
    return value


def _float(data: dict[str, Any], key: str, high: float) -> float | None:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    if not math.isfinite(number) or not 0.0 < number <= high:
        return None
    return number


def parse_status(payload: bytes, limit: int = 65536) -> Status | Malformed:
    data = _load_object(payload, limit)
    if isinstance(data, Malformed):
        return data
    state = data.get("state")
    if state not in ("online", "offline"):
        return Malformed("bad_field", "state is not 'online' or 'offline'")
    bdseq = _int(data, "bdseq")
    if bdseq is None:
        return Malformed("bad_field", "bdseq is not a non-negative 64-bit integer")
    ts = _float(data, "ts", MAX_TS) if "ts" in data else None
    if "ts" in data and ts is None:
        return Malformed("bad_field", "ts is not a positive finite number")
    version = data.get("version", "")
    version = version[:64] if isinstance(version, str) else ""
    reason = data.get("reason")
    clean = state == "offline" and isinstance(reason, str) and reason.lower() in SHUTDOWN_REASONS
    return Status(state == "online", bdseq, ts, version, clean)


def _problems(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value[:200],)
    if isinstance(value, list):
        return tuple(str(item)[:200] for item in value[:10] if isinstance(item, str))
    return ()


def parse_heartbeat(payload: bytes, limit: int = 65536) -> Heartbeat | Malformed:
    data = _load_object(payload, limit)
    if isinstance(data, Malformed):
        return data
    seq = _int(data, "seq")
    if seq is None:
        return Malformed("bad_field", "seq is not a non-negative 64-bit integer")
    ts = _float(data, "ts", MAX_TS)
    if ts is None:
        return Malformed("bad_field", "ts is not a positive finite number")
    interval = _float(data, "interval_s", MAX_INTERVAL)
    if interval is None:
        return Malformed("bad_field", "interval_s is not a number in (0, 86400]")
    # "health": "ok" or a list of problems (docs/ARCHITECTURE.md); a bool or an object with "ok"
    # is tolerated so that the watcher does not depend on one spelling.
    health = data.get("health")
    health_ok: bool | None = None
    problems: tuple[str, ...] = ()
    if health == "ok" or health is True:
        health_ok = True
    elif isinstance(health, dict):
        ok = health.get("ok")
        health_ok = ok if isinstance(ok, bool) else None
        problems = _problems(health.get("problems"))
    elif health is not None:
        health_ok = False
        problems = _problems(health)
    return Heartbeat(seq, ts, interval, health_ok, problems, _paused(data))


def _paused(data: dict[str, Any]) -> tuple[str, ...]:
    """`"gpu": "paused"` with `"paused": {"collectors": [...]}`; anything else: not paused."""
    paused = data.get("paused")
    if data.get("gpu") != "paused" or not isinstance(paused, dict):
        return ()
    names = paused.get("collectors")
    if not isinstance(names, list):
        return ()
    return tuple(n for n in names[:32] if isinstance(n, str) and _NAME.fullmatch(n))
