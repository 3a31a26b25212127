"""A real Xid on a real GPU, the agent killed with SIGKILL once it has seen it, and started
again on the same boot: the Xid is delivered once, its count and gpuwarden_events_total stay,
and the kernel log's line of it, read again by the new process, confirms the stored event
instead of raising a second one.

Run on the GPU machine: `python -m pytest -q -m gpu tests/test_xid_real_kill9.py`. It needs
NVML, CuPy (to launch the faulting kernel) and a readable /dev/kmsg, else it skips. The Xid is
application-class: Xid 31, an MMU fault from a write to an address the kernel never mapped,
which ends the faulting process's CUDA context and nothing else (the driver logs
`NVRM: Xid (PCI:...): 31, pid=..., name=python3, ... MMU Fault: ...` and NVML delivers an Xid
event); the GPU needs no reset. One such process per run.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.agent_proc import AgentProcess, http_get
from tests.support.mosquitto import Broker
from tests.support.mqtt import Subscriber
from tests.support.nvml import real_gpu_count
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

# A kernel that writes to an address no CUDA allocation has: the GPU's MMU faults (Xid 31).
FAULT = r"""
import cupy as cp
kernel = cp.RawKernel(
    r'extern "C" __global__ void f(int* p) { *((volatile int*)0x7f0000000000ULL) = 1; }', "f"
)
cell = cp.zeros(1, dtype=cp.int32)
cp.cuda.Device().synchronize()
try:
    kernel((1,), (1,), (cell,))
    cp.cuda.Device().synchronize()
except Exception as exc:
    print("faulted:", str(exc)[:120])
else:
    print("no fault")
"""


@pytest.fixture(scope="module")
def gpus() -> int:
    count = real_gpu_count()
    if importlib.util.find_spec("cupy") is None:
        pytest.skip("no CuPy here to launch the faulting kernel")
    if not os.access("/dev/kmsg", os.R_OK):
        pytest.skip("/dev/kmsg is not readable here")
    return count


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    instance = Broker(tmp_path / "broker").start()
    yield instance
    instance.stop()


def xid_counts(agent: AgentProcess) -> dict[str, float]:
    """gpuwarden_xid_errors_total of code 31, by GPU."""
    _, text = http_get(agent.metrics_url)
    found = {}
    for line in text.splitlines():
        if line.startswith("gpuwarden_xid_errors_total{") and 'xid="31"' in line:
            labels, value = line.rsplit(" ", 1)
            gpu = re.search(r'gpu="([^"]*)"', labels)
            found[gpu[1] if gpu else labels] = float(value)
    return found


def xid_events_total(agent: AgentProcess) -> float:
    _, text = http_get(agent.metrics_url)
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("gpuwarden_events_total{") and 'kind="xid"' in line
    )


def xid31_events(sub: Subscriber) -> list[dict[str, Any]]:
    return [
        e
        for e in (m.json() for m in sub.on("/events"))
        if e.get("kind") == "xid" and e.get("attributes", {}).get("xid") == 31
    ]


def test_a_real_xid_outlives_a_kill(tmp_path: Path, gpus: int, broker: Broker) -> None:
    agent = AgentProcess(
        tmp_path / "agent",
        config_text=(
            f'[mqtt]\nenabled = true\nurl = "{broker.url}"\nreconnect_min = 0.2\n'
            "[heartbeat]\ninterval = 1\n"
            "[collectors.gpu]\ninterval = 1\nevent_wait_ms = 200\n"
            "[collectors.kernel_log]\ninterval = 1\n"
            "[collectors.benchmark]\nenabled = false\n"
        ),
    )
    sub = Subscriber(broker.port).start()
    try:
        agent.start(timeout=60)
        wait_until(lambda: bool(sub.on("/heartbeat")), timeout=30, what="a heartbeat")
        time.sleep(3.0)  # the kernel log's backlog read: an Xid 31 of an earlier run counts there
        earlier = {e["id"] for e in xid31_events(sub)}
        counted = sum(xid_counts(agent).values())
        fault = subprocess.run(
            [sys.executable, "-c", FAULT], capture_output=True, text=True, timeout=120, check=False
        )
        assert "faulted" in fault.stdout, fault.stdout + fault.stderr

        def new_events() -> list[dict[str, Any]]:
            return [e for e in xid31_events(sub) if e["id"] not in earlier]

        wait_until(lambda: new_events() != [], timeout=30, what="the Xid 31 event")
        wait_until(lambda: sum(xid_counts(agent).values()) > counted, timeout=30, what="its count")
        # Both sources saw it (or the window closed): the count is the incident's, once.
        time.sleep(7.0)
        before = xid_counts(agent)
        events_before = xid_events_total(agent)
        assert sum(before.values()) == counted + 1, (before, counted)
        assert events_before >= 1
        [event] = new_events()
        assert "nvml" in str(event["attributes"].get("seen_by", "")) or event["attributes"]

        assert agent.process is not None
        agent.process.send_signal(signal.SIGKILL)
        agent.process.wait(timeout=10)
        agent.start(timeout=60)
        # The new process read the kernel log's backlog again (its cursor aside): long enough
        # for the kernel-log rounds and any confirmation to be over.
        time.sleep(8.0)
        assert xid_counts(agent) == before, agent.log()[-3000:]
        assert xid_events_total(agent) >= events_before
        again = [e for e in new_events() if e["id"] != event["id"]]
        assert again == [], again  # no second alert for the same Xid
    finally:
        sub.stop()
        agent.stop()
