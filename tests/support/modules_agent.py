"""`gpuwarden` as a real process on the fake NVML that says which modules it has loaded:
`python -m tests.support.modules_agent DEVICE_DIR GPUS DUMP run --config ...`.

The agent runs as tests/support/fake_nvml_agent.py runs it. Each time the file DUMP appears, the
process writes the names in its `sys.modules` (one JSON list) to `dumped(DUMP)` and removes
DUMP, so a caller that has seen the rounds it wants asks, then reads what those rounds loaded.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

from agent.program.cli import main
from tests.support.fake_nvml_agent import _install


def dumped(request: Path) -> Path:
    return request.with_name(f"{request.name}.json")


def ask(request: Path, timeout: float = 20.0) -> list[str]:
    """From the caller's side: the modules the agent holds now."""
    answer = dumped(request)
    answer.unlink(missing_ok=True)
    request.touch()
    deadline = time.monotonic() + timeout
    while not answer.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the agent wrote no {answer} within {timeout} s")
        time.sleep(0.05)
    names: list[str] = json.loads(answer.read_text())
    return names


def _serve(request: Path) -> None:
    while True:
        if request.exists():
            names = sorted(name for name, module in list(sys.modules.items()) if module)
            tmp = request.with_name(f"{request.name}.tmp")
            tmp.write_text(json.dumps(names))
            request.unlink()
            os.replace(tmp, dumped(request))  # whole, or not there: the caller polls for it
        time.sleep(0.05)


if __name__ == "__main__":
    directory, gpus, request, *rest = sys.argv[1:]
    _install(Path(directory), int(gpus))
    threading.Thread(target=_serve, args=(Path(request),), daemon=True).start()
    sys.exit(main(rest))
