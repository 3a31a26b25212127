"""Where the runtime finds collectors, sinks and settings sections: one line each.

A collector module exports `SPEC` (a `CollectorSpec`); a sink module exports `SPEC` (a
`SinkSpec`); a settings section is a frozen dataclass. Entries are import paths, so a command
that needs one component does not import the others.
"""

from __future__ import annotations

import importlib
from typing import Any, Final

COLLECTORS: Final[dict[str, str]] = {
    # name in [collectors.<name>] -> module exporting SPEC
    "system": "collectors.system",
    "gpu": "collectors.gpu.collector",
    "disk": "collectors.disk.collector",
    "processes": "collectors.processes",
    "io_probe": "collectors.io_probe",
    "kernel_log": "collectors.kernel_log.collector",
    "benchmark": "collectors.benchmark.collector",
}

SINKS: Final[dict[str, str]] = {
    # name of the top-level table -> module exporting SPEC
    "prometheus": "exporters.prometheus",
    "mqtt": "exporters.mqtt",
}

SECTIONS: Final[dict[str, str]] = {
    # top-level tables that are not sinks -> "module:SettingsClass"
    "heartbeat": "agent.contracts.heartbeat:HeartbeatSettings",
    "watch": "agent.program.watch.settings:WatchSettings",
}


def _import(path: str, default_attr: str) -> Any:
    module_name, _, attr = path.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attr or default_attr)


def collector_spec(name: str) -> Any:
    """The `CollectorSpec` for a registered collector name."""
    return _import(COLLECTORS[name], "SPEC")


def sink_spec(name: str) -> Any:
    return _import(SINKS[name], "SPEC")


def section_type(name: str) -> Any:
    if name in SINKS:
        return sink_spec(name).settings_type
    return _import(SECTIONS[name], "")
