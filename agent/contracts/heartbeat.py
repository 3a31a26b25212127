"""Settings of the heartbeat (the MQTT heartbeat topic and the health rules use them)."""

from __future__ import annotations

from dataclasses import dataclass

from agent.contracts.settings import setting


@dataclass(frozen=True)
class HeartbeatSettings:
    interval: float = setting(15.0, minimum=0.1, maximum=3600.0, help="seconds between heartbeats")
    stale_after_intervals: int = setting(
        3,
        minimum=2,
        maximum=100,
        help="a collector or sink with no success for this many of its intervals is stale",
    )
