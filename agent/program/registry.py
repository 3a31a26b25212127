"""What the agent is made of: every collector, sink and settings section, one line each.

Plain imports: a command that needs the whole agent (`run`, `check`, `diag`, `config`) imports
this module; a command that needs one piece (`scan`, `bench`, `watch`) imports that piece and
never this module, so the watcher loads neither NVML nor a collector. A new collector is one
module exporting `SPEC` and one line below (docs/ARCHITECTURE.md, "Adding a collector").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from agent.contracts.collector import CollectorSpec
from agent.contracts.config import TOP_LEVEL_TABLES
from agent.contracts.heartbeat import HeartbeatSettings
from agent.contracts.pause import PauseSettings
from agent.contracts.sink import SinkSpec
from agent.program.config_loader import Schema
from agent.program.watch.settings import WatchSettings
from collectors import io_probe, processes, system
from collectors.benchmark import collector as benchmark
from collectors.checkpoints import spec as checkpoints
from collectors.disk import collector as disk
from collectors.gpu import collector as gpu
from collectors.kernel_log import collector as kernel_log
from exporters import mqtt_spec, prometheus
from exporters.actions import sink as actions

COLLECTORS: Final[Mapping[str, CollectorSpec[Any]]] = {
    spec.name: spec
    for spec in (
        system.SPEC,
        gpu.SPEC,
        disk.SPEC,
        processes.SPEC,
        io_probe.SPEC,
        kernel_log.SPEC,
        benchmark.SPEC,
        checkpoints.SPEC,
    )
}

SINKS: Final[Mapping[str, SinkSpec[Any]]] = {
    spec.name: spec for spec in (prometheus.SPEC, mqtt_spec.SPEC, actions.SPEC)
}

SECTIONS: Final[Mapping[str, type[Any]]] = {
    # top-level tables that are not sinks
    "heartbeat": HeartbeatSettings,
    "pause": PauseSettings,
    "watch": WatchSettings,
}

SCHEMA: Final = Schema(
    sections={**{name: spec.settings_type for name, spec in SINKS.items()}, **SECTIONS},
    collectors=COLLECTORS,
)
"""The whole agent's configuration: agent/program/config_file.py judges a file against it."""

assert set(SCHEMA.sections) | {"collectors"} == set(TOP_LEVEL_TABLES), (
    "agent.contracts.config.TOP_LEVEL_TABLES must name every section of the registry"
)


def collector_spec(name: str) -> CollectorSpec[Any]:
    """The `CollectorSpec` for a registered collector name."""
    return COLLECTORS[name]


def sink_spec(name: str) -> SinkSpec[Any]:
    return SINKS[name]


def section_type(name: str) -> type[Any]:
    return SCHEMA.sections[name]
