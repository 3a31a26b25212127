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


def _age(now: float, then: float | None) -> float | None:
    return None if then is None else round(max(0.0, now - then), 3)


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
            "last_success_age_s": _age(now, status.last_success),
            "interval_s": status.settings.interval,
            "paused": status.paused,
        }
        for name, status in sorted(runtime.collectors.items())
    }
    sinks = {
        name: {
            "up": entry.up,
            "last_delivery_ts": entry.last_delivery,
            "last_delivery_age_s": _age(now, entry.last_delivery),
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
