"""`gpuwarden` as a real process on the fake NVML that says which modules it has loaded:
`python -m tests.support.modules_agent DEVICE_DIR GPUS DUMP run --config ...`.

The agent runs as tests/support/fake_nvml_agent.py runs it. Each time the file DUMP appears, the
process writes the names in its `sys.modules`, and whether it has read the Xid catalog (held
once read, collectors/_xid_catalog.py), to `dumped(DUMP)` and removes DUMP: a caller that has
seen the rounds it wants asks (tests/support/modules_probe.py), then reads what those rounds
loaded. It imports nothing the agent would not (no HTTP client, no test helper of the caller's).
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


def _held() -> dict[str, object]:
    names = sorted(name for name, module in list(sys.modules.items()) if module)
    xid_catalog = sys.modules.get("collectors._xid_catalog")
    read = xid_catalog is not None and xid_catalog.catalog.cache_info().currsize > 0
    return {"modules": names, "xid_catalog": read}


def _serve(request: Path) -> None:
    while True:
        if request.exists():
            tmp = request.with_name(f"{request.name}.tmp")
            tmp.write_text(json.dumps(_held()))
            request.unlink()
            os.replace(tmp, dumped(request))  # whole, or not there: the caller polls for it
        time.sleep(0.05)


if __name__ == "__main__":
    directory, gpus, request, *rest = sys.argv[1:]
    _install(Path(directory), int(gpus))
    threading.Thread(target=_serve, args=(Path(request),), daemon=True).start()
    sys.exit(main(rest))
