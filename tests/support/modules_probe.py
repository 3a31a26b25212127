"""The caller's side of tests/support/modules_agent.py: the configuration of a few fast rounds,
the wait for them, and the question what the agent holds."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from tests.support.agent_proc import AgentProcess, http_get
from tests.support.modules_agent import dumped

FAST: Final = ("system", "gpu", "disk", "processes", "kernel_log")

# The embedded defaults with rounds every second, and a benchmark that tries at once (its child
# fails without a GPU: the failure's path runs, history and events included). The kernel log is
# a file of quiet lines: a test machine's /dev/kmsg may hold the Xids other tests write.
FAST_ROUNDS = (
    "".join(f"[collectors.{name}]\ninterval = 1.0\n" for name in FAST if name != "kernel_log")
    + '[collectors.benchmark]\ninterval = 15.0\nchild_timeout = 10.0\nwhen = "always"\n'
)
QUIET_LOG = "[    1.000000] Linux version 6.1.0\n[    2.000000] usb 1-1: new device\n"


def fast_rounds(kernel_log: Path) -> str:
    """FAST_ROUNDS, and the kernel log read from `kernel_log` (written here)."""
    kernel_log.write_text(QUIET_LOG)
    return f'{FAST_ROUNDS}[collectors.kernel_log]\ninterval = 1.0\npath = "{kernel_log}"\n'


def everything_on(work: Path, broker_port: int) -> str:
    """fast_rounds, with what the embedded defaults leave off turned on, as on the H200 of
    docs/MEASUREMENTS.md: MQTT (to `broker_port`: a broker there or not), the I/O probe (1 MiB
    in `work`/probe) and the checkpoints collector (an empty `work`/checkpoints)."""
    (work / "probe").mkdir(exist_ok=True)
    (work / "checkpoints").mkdir(exist_ok=True)
    return (
        fast_rounds(work / "kern.log")
        + f'[mqtt]\nenabled = true\nurl = "mqtt://127.0.0.1:{broker_port}"\n'
        + f'[collectors.io_probe]\nenabled = true\ndirectories = ["{work / "probe"}"]\n'
        + "size_mib = 1\nfree_margin_mib = 0\n"
        + "[collectors.checkpoints]\nenabled = true\n"
        + f'[[collectors.checkpoints.locations]]\npath = "{work / "checkpoints"}"\n'
    )


def rounds_done(agent: AgentProcess, rounds: int) -> bool:
    """The FAST collectors have started `rounds` rounds, any other at least one; the benchmark
    has run its child."""
    _, text = http_get(agent.metrics_url)
    lines = text.splitlines()
    runs = {
        line.split('collector="', 1)[1].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in lines
        if line.startswith("gpuwarden_collector_runs_total{")
    }
    tried = any(line.startswith("gpuwarden_benchmark_last_run_timestamp") for line in lines)
    fast = [runs.get(name, 0.0) >= rounds for name in FAST]
    return all(fast) and all(n >= 1 for n in runs.values()) and tried


@dataclass(frozen=True)
class Loaded:
    modules: set[str]
    xid_catalog: bool


def ask(request: Path, timeout: float = 20.0) -> Loaded:
    """From the caller's side: what the agent holds now."""
    answer = dumped(request)
    answer.unlink(missing_ok=True)
    request.touch()
    deadline = time.monotonic() + timeout
    while not answer.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the agent wrote no {answer} within {timeout} s")
        time.sleep(0.05)
    held = json.loads(answer.read_text())
    return Loaded(set(held["modules"]), bool(held["xid_catalog"]))
