"""The checkpoints collector as the registry sees it: its settings and a factory that imports
the collector (collectors/checkpoints/collector.py, with its judge, checksums and off-node copy)
only when `[collectors.checkpoints]` is enabled.

It is off in the embedded defaults, and a module the daemon imports stays resident for its
life: about 0.3 MB (traced) in a daemon that watches no checkpoint (docs/MEASUREMENTS.md,
"What the daemon loads"). Enabled at start or by a reload, the first factory call imports it.
"""

from __future__ import annotations

from agent.contracts.collector import Collector, CollectorDeps, CollectorSpec
from collectors.checkpoints.settings import CheckpointSettings


def create(settings: CheckpointSettings, deps: CollectorDeps) -> Collector:
    from collectors.checkpoints.collector import (  # noqa: PLC0415 - when enabled: see above
        CheckpointCollector,
    )

    return CheckpointCollector(settings, deps)


SPEC = CollectorSpec(
    name="checkpoints",
    description="checkpoints you can restart from: freshness, integrity, the off-node copy",
    settings_type=CheckpointSettings,
    factory=create,
    default_settings=CheckpointSettings(enabled=False, interval=60.0, timeout=30.0),
)
