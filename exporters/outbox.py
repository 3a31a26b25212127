"""The durable outbox the MQTT sink drains: bounded, with every drop counted.

Entries live in the state store's outbox table (agent/runtime/state.py), written before any delivery
is tried and deleted only after the broker acknowledged them. Events get there through
`SinkContext.emit`; metric snapshots through `Outbox.put`. Heartbeats are published live and
never queued (exporters/mqtt.py says why); the heartbeat rules below remain for the entries an
older version queued and for callers of `put`.

Bounds (entries, payload bytes, age) are enforced by `enforce()`. Over a size bound, the
cheapest entries go first: metric snapshots (the next one replaces them), then heartbeats other
than the newest (only the newest says anything about now), and events last, oldest first.
A heartbeat also supersedes the undelivered heartbeats before it (the topic is retained, so a
consumer only ever sees the newest): that is not counted as a drop.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from agent.contracts.sink import OutboxEntry, OutboxStore

DROP_ORDER: tuple[tuple[str, int], ...] = (("metrics", 0), ("heartbeat", 1), ("event", 0))
"""(kind, newest entries of that kind kept) in the order entries are dropped when full."""


@dataclass(frozen=True, slots=True)
class OutboxLimits:
    max_entries: int
    max_bytes: int
    max_age: float


class Outbox:
    def __init__(self, store: OutboxStore, limits: OutboxLimits) -> None:
        self.store = store
        self.limits = limits
        self.dropped: Counter[str] = Counter()
        """Entries dropped since start, by kind (metrics, heartbeat, event)."""

    def put(self, kind: str, key: str, payload: bytes, created: float | None = None) -> int:
        if kind == "heartbeat":
            return self.store.outbox_replace(kind, key, payload, created)
        return self.store.outbox_put(kind, key, payload, created)

    def peek(self, limit: int, after_seq: int = 0) -> list[OutboxEntry]:
        return self.store.outbox_peek(limit, after_seq)

    def ack(self, seqs: list[int]) -> None:
        self.store.outbox_ack(seqs)

    def depth(self) -> dict[str, int]:
        return self.store.outbox_depth()

    def enforce(self, now: float | None = None) -> dict[str, int]:
        """Apply the bounds; return what was dropped now, by kind (empty: nothing)."""
        now = time.time() if now is None else now
        dropped: Counter[str] = Counter(self.store.outbox_expire(now - self.limits.max_age))
        entries, size = self.store.outbox_usage()
        excess_entries = entries - self.limits.max_entries
        excess_bytes = size - self.limits.max_bytes
        for kind, keep in DROP_ORDER:
            if excess_entries <= 0 and excess_bytes <= 0:
                break
            # Enough candidates to cover the excess in entries; bytes may need more rounds.
            while excess_entries > 0 or excess_bytes > 0:
                batch = self.store.outbox_oldest(kind, min(max(excess_entries, 256), 10_000), keep)
                if not batch:
                    break
                victims: list[int] = []
                for seq, length in batch:
                    if excess_entries <= 0 and excess_bytes <= 0:
                        break
                    victims.append(seq)
                    excess_entries -= 1
                    excess_bytes -= length
                # What is still there: an entry delivered meanwhile was not dropped.
                dropped[kind] += self.store.outbox_ack(victims).get(kind, 0)
        self.dropped.update(dropped)
        return {kind: count for kind, count in dropped.items() if count}
