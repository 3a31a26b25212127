"""`gpuwarden` as a real process on the fake NVML: `python -m tests.support.fake_nvml_agent
DEVICE_DIR GPUS run --config ...`.

Every `NvmlBackend` the process makes uses one `FakeNvml` with GPUS fake H200s, whose nvmlInit
opens real files in DEVICE_DIR (and nvmlShutdown closes them), so a test reads the agent's
/proc/<pid>/fd as it would read /dev/nvidia* on a GPU host. The fake's library calls, counted by
name, are written as JSON to `calls_path(DEVICE_DIR)` (beside it, not in it) every 0.1 s, for
"no call while paused".
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import collectors._nvml as nvml
from agent.program.cli import main
from tests.support.nvml import fake_gpus
from tests.support.nvml_fake import FakeNvml


def _install(device_dir: Path, count: int) -> FakeNvml:
    fake = FakeNvml(fake_gpus(count), device_dir=device_dir)
    original = nvml.NvmlBackend.__init__

    def backend(self: nvml.NvmlBackend, lib: Any = None) -> None:
        original(self, fake if lib is None else lib)
        self.device_prefix = f"{device_dir}/"

    nvml.NvmlBackend.__init__ = backend  # type: ignore[method-assign]
    return fake


def calls_path(device_dir: Path) -> Path:
    return device_dir.parent / f"{device_dir.name}-nvml-calls"


def _report(fake: FakeNvml, path: Path) -> None:
    while True:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(dict(fake.lib_calls)))
        tmp.replace(path)
        time.sleep(0.1)


if __name__ == "__main__":
    directory, gpus, *rest = sys.argv[1:]
    fake = _install(Path(directory), int(gpus))
    threading.Thread(target=_report, args=(fake, calls_path(Path(directory))), daemon=True).start()
    sys.exit(main(rest))
