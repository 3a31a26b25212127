"""What the daemon loads at start-up: resident memory on a GPU host is a goal (issue 14:
<= 64 MB on the H200), and every module imported stays resident for the agent's life.

The agent logs JSON (or structlog's plain console renderer) and reads YAML and checks bcrypt
only for the Prometheus endpoint's web config: those libraries must not load until a setting
asks for them. Measured on the H200 (docs/MEASUREMENTS.md): rich and pygments, which
structlog imports whenever they are installed, cost about 4 MB; yaml 1.5 MB."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agent.program import registry
from collectors.checkpoints.collector import CheckpointCollector
from tests.support.agent_proc import AgentProcess
from tests.support.bench import deps
from tests.support.modules_probe import ask, fast_rounds, rounds_done
from tests.support.waiting import wait_until

# Installed in the test environment (rich via import-linter, yaml and bcrypt as dependencies,
# prometheus_client as a test dependency: exporters/exposition.py renders /metrics), so each
# would load if anything imported it.
NOT_AT_START = ("rich", "pygments", "yaml", "bcrypt", "torch", "prometheus_client")

ENTRY_POINTS = (
    "agent.program.cli",  # the `gpuwarden` command
    "agent.program.registry",  # every collector and sink the daemon can start
    "agent.program.commands.watch",  # `gpuwarden watch`, the off-node watcher
)


def start_up(module: str) -> tuple[set[str], set[str]]:
    """In a fresh interpreter: which of NOT_AT_START are installed, and the top-level
    modules loaded after importing `module`."""
    code = (
        "import importlib, importlib.util, json, sys\n"
        f"names = {NOT_AT_START!r}\n"
        "installed = [n for n in names if importlib.util.find_spec(n) is not None]\n"
        f"importlib.import_module({module!r})\n"
        "loaded = sorted({m.split('.')[0] for m in sys.modules if sys.modules[m] is not None})\n"
        "print(json.dumps([installed, loaded]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    installed, loaded = json.loads(out.stdout)
    return set(installed), set(loaded)


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_start_up_loads_none_of_the_optional_libraries(module: str) -> None:
    installed, loaded = start_up(module)
    # Installed here, so the check below can fail (torch is not, in CI's environment).
    assert installed >= {"rich", "pygments", "yaml", "bcrypt", "prometheus_client"}
    assert loaded.isdisjoint(NOT_AT_START), sorted(loaded & set(NOT_AT_START))


def test_web_config_loads_yaml_when_asked(tmp_path: object) -> None:
    """The lazy import still works: parsing a web config brings yaml in."""
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from exporters.web_auth import parse_web_config\n"
        "assert 'yaml' not in sys.modules\n"
        "try:\n"
        "    parse_web_config('[1, 2]\\n', 'web.yml', Path('.'))\n"
        "except Exception as exc:\n"
        "    print('yaml' in sys.modules, type(exc).__name__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.split() == ["True", "UsersFileError"]


# Issue 14, the daemon's own imports: what `gpuwarden run` never runs must not be resident.
# statistics (with fractions and decimal, whose _decimal is a 1.7 MB shared object) came for two
# medians and with the benchmark child's module; zipfile and pickletools read checkpoint files, which
# only the checkpoints collector opens, and only when it finds one; the benchmark child
# (collectors/benchmark/child.py) runs in its own process; the one-shot commands (check, diag
# and its bundle's tarfile, scan, bench, watch, ...) are not the daemon's; the MQTT sink and its
# client libraries, and the checkpoints collector, load only when enabled (both are off in the
# embedded defaults).
NOT_IN_DAEMON = (
    "statistics",
    "fractions",
    "decimal",
    "_decimal",
    "zipfile",
    "pickletools",
    "collectors.benchmark.child",
    "agent.program.commands.check",
    "agent.program.commands.diag",
    "agent.program.commands.scan",
    "agent.program.commands.bench",
    "agent.program.commands.watch",
    "agent.program.diagnose",
    "agent.program.watch.service",
    "tarfile",
    "exporters.mqtt",
    "exporters.mqtt_client",
    "aiomqtt",
    "paho",
    "tenacity",
    "urllib.request",  # with http.client and email: paho's, nothing else of the daemon's
    "http.client",
    "email",
    "collectors.checkpoints.collector",
    "collectors.checkpoints.judge",
    "collectors.checkpoints.offnode",
)


def modules_after(code: str) -> set[str]:
    """Every module a fresh interpreter holds after running `code`."""
    probe = (
        f"{code}\nimport json, sys\n"
        "print(json.dumps(sorted(m for m, v in sys.modules.items() if v is not None)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    names: list[str] = json.loads(out.stdout.splitlines()[-1])
    return set(names)


# The daemon's own (the watcher, another process, publishes with aiomqtt).
DAEMON_ENTRY_POINTS = ("agent.program.cli", "agent.program.registry")


@pytest.mark.parametrize("module", DAEMON_ENTRY_POINTS)
def test_start_up_loads_nothing_the_daemon_never_runs(module: str) -> None:
    loaded = modules_after(f"import {module}")
    assert module in loaded  # the probe sees what the import loaded
    assert loaded.isdisjoint(NOT_IN_DAEMON), sorted(loaded & set(NOT_IN_DAEMON))


def test_the_running_agent_loads_nothing_it_never_runs(tmp_path: Path) -> None:
    """A real `gpuwarden run` on the fake NVML, after 3 rounds of every collector the defaults
    enable and a benchmark attempt: a collector that imports at its first round counts too."""
    devices, request = tmp_path / "dev", tmp_path / "modules"
    devices.mkdir()
    agent = AgentProcess(
        tmp_path / "agent",
        config_text=fast_rounds(tmp_path / "kern.log"),
        entry=["-m", "tests.support.modules_agent", str(devices), "2", str(request)],
    )
    agent.start(timeout=30)
    try:
        wait_until(lambda: rounds_done(agent, 3), timeout=60, what="3 rounds of each collector")
        held = ask(request)
    finally:
        agent.stop()
    # The probe sees what rounds load: the state store, NVML, the benchmark's runner.
    loaded = held.modules
    assert {"sqlite3", "pynvml", "collectors.benchmark.runner", "agent.runtime.core"} <= loaded
    assert loaded.isdisjoint(NOT_IN_DAEMON), sorted(loaded & set(NOT_IN_DAEMON))
    # Read at the first GPU finding (test_the_xid_catalog_is_read_at_the_first_finding).
    assert not held.xid_catalog


def test_the_xid_catalog_is_read_at_the_first_finding() -> None:
    """The kernel log's matchers read the catalog when a GPU falls off the bus, not when they
    are imported, and the finding still carries Xid 79's action."""
    code = (
        "from collectors._xid_catalog import catalog, lookup\n"
        "from collectors.kernel_log.matchers import FallenOffBusMatcher\n"
        "from collectors.kernel_log.parse import LogRecord\n"
        "before = catalog.cache_info().currsize\n"
        "line = LogRecord('NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.')\n"
        "[found] = FallenOffBusMatcher().feed(line)\n"
        "print(before, catalog.cache_info().currsize, found.action == lookup(79).action)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.split() == ["0", "1", "True"]


def test_an_enabled_checkpoints_collector_is_made_through_the_registry(tmp_path: Path) -> None:
    """The registry's factory imports the collector it makes (collectors/checkpoints/spec.py)."""
    spec = registry.collector_spec("checkpoints")
    made = spec.make(spec.defaults(), deps(tmp_path))
    assert isinstance(made, CheckpointCollector)
    names = [f.name for f in made.families()]
    assert names and all(n.startswith("gpuwarden_checkpoint") for n in names), names
