"""`gpuwarden` as a real process on the fake NVML: `python -m tests.support.fake_nvml_agent
DEVICE_DIR GPUS run --config ...`.

Every `NvmlBackend` the process makes uses one `FakeNvml` with GPUS fake H200s, whose nvmlInit
opens real files in DEVICE_DIR (and nvmlShutdown closes them), so a test reads the agent's
/proc/<pid>/fd as it would read /dev/nvidia* on a GPU host. The fake's library calls, counted by
name, are written as JSON to `calls_path(DEVICE_DIR)` (beside it, not in it) every 0.1 s, for
"no call while paused". An Xid is injected from outside with `inject_xid`: a file in
`inject_dir(DEVICE_DIR)` that the process turns into an NVML Xid event of its fake and then
removes (so a process killed after the removal never gets it again; `injected` says when).
A GPU hangs from outside too: while `hang_gpu` has left a file in `hang_dir(DEVICE_DIR)`, every
call on that GPU blocks (a hung driver), `stuck_calls` says how many calls wait there now, and
`unhang_gpu` lets them return.
"""

from __future__ import annotations

import json
import os
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


def inject_dir(device_dir: Path) -> Path:
    return device_dir.parent / f"{device_dir.name}-nvml-inject"


def inject_xid(device_dir: Path, gpu: int, code: int) -> Path:
    """Ask the running process for an NVML Xid `code` on GPU `gpu`; returns the request's
    file, gone once the process has queued the event (`injected`). Requests are taken in
    the order they were made."""
    folder = inject_dir(device_dir)
    folder.mkdir(exist_ok=True)
    path = folder / f"{time.time_ns():020d}-{os.getpid()}.json"
    tmp = folder / f".{path.name}.tmp"
    tmp.write_text(json.dumps({"gpu": gpu, "xid": code}))
    tmp.replace(path)  # whole or not at all: the process never reads half a request
    return path


def injected(request: Path) -> bool:
    return not request.exists()


def hang_dir(device_dir: Path) -> Path:
    return device_dir.parent / f"{device_dir.name}-nvml-hang"


def hang_gpu(device_dir: Path, gpu: int) -> None:
    """From the process's next look (every 0.02 s), every NVML call on GPU `gpu` blocks."""
    folder = hang_dir(device_dir)
    folder.mkdir(exist_ok=True)
    (folder / str(gpu)).write_text("")


def unhang_gpu(device_dir: Path, gpu: int) -> None:
    (hang_dir(device_dir) / str(gpu)).unlink(missing_ok=True)


def stuck_calls(device_dir: Path, gpu: int) -> int:
    """NVML calls on GPU `gpu` that wait in its hang now (as of the process's last look):
    each is a thread of the agent's stuck there."""
    path = hang_dir(device_dir) / f"stuck-{gpu}"
    return int(path.read_text()) if path.exists() else 0


class _Hang(threading.Event):
    """A GPU's hang that counts the calls waiting in it."""

    def __init__(self) -> None:
        super().__init__()
        self.stuck = 0
        self._count = threading.Lock()

    def wait(self, timeout: float | None = None) -> bool:
        with self._count:
            self.stuck += 1
        try:
            return super().wait(timeout)
        finally:
            with self._count:
                self.stuck -= 1


def _hang(fake: FakeNvml, folder: Path) -> None:
    folder.mkdir(exist_ok=True)
    while True:
        hung = {int(path.name) for path in folder.iterdir() if path.name.isdigit()}
        for index, gpu in enumerate(fake.gpus):
            hang = gpu.hang
            if index in hung and (hang is None or hang.is_set()):
                gpu.hang = hang = _Hang()
            elif index not in hung and hang is not None:
                hang.set()  # kept, set: a call that has just read it must not find None
            stuck = hang.stuck if isinstance(hang, _Hang) else 0
            tmp = folder / f".stuck-{index}.tmp"
            tmp.write_text(str(stuck))
            tmp.replace(folder / f"stuck-{index}")
        time.sleep(0.02)


def _inject(fake: FakeNvml, folder: Path) -> None:
    import pynvml

    folder.mkdir(exist_ok=True)
    while True:
        for path in sorted(folder.glob("*.json")):
            wanted = json.loads(path.read_text())
            gpu = fake.gpus[int(wanted["gpu"])]
            fake.push_event(gpu, pynvml.nvmlEventTypeXidCriticalError, int(wanted["xid"]))
            path.unlink()
        time.sleep(0.02)


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
    threading.Thread(target=_inject, args=(fake, inject_dir(Path(directory))), daemon=True).start()
    threading.Thread(target=_hang, args=(fake, hang_dir(Path(directory))), daemon=True).start()
    sys.exit(main(rest))
