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

import pytest

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
