"""Freed heap goes back to the kernel (agent/runtime/memory.py): for real in a child process
on this glibc, as a no-op where the C library cannot, and from the runtime after the first
round and then every TRIM_INTERVAL."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agent.program import config_file as config
from agent.program import registry
from agent.runtime import core, memory
from agent.runtime.core import Runtime
from agent.runtime.memory import HeapTrimmer
from agent.runtime.state import StateStore
from collectors._nvml import NvmlBackend
from collectors.gpu.collector import GpuSettings
from tests.support.nvml import fake_gpus
from tests.support.nvml_fake import FakeNvml
from tests.support.waiting import until

pytestmark = pytest.mark.skipif(
    not HeapTrimmer().available, reason="this C library has no malloc_trim"
)


def test_a_fragmented_heap_shrinks_in_a_real_process() -> None:
    """Many C-allocator blocks (strings over 512 bytes), most freed, the survivors spread
    over the heap: the freed pages stay resident until the trim gives them back."""
    code = textwrap.dedent(
        """
        import json
        from agent.runtime.memory import HeapTrimmer

        def rss_kb():
            for line in open("/proc/self/status"):
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])

        blocks = ["x" * (600 + i % 300) for i in range(150_000)]
        survivors = blocks[::50]
        del blocks
        before = rss_kb()
        trimmer = HeapTrimmer()
        gave_back = trimmer.trim()
        print(json.dumps([before, rss_kb(), gave_back, trimmer.trims, len(survivors)]))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[1],
    )
    before, after, gave_back, trims, _ = json.loads(out.stdout)
    assert gave_back is True and trims == 1
    assert before - after > 20_000, (before, after)  # about 100 MB were freed


def test_where_the_c_library_cannot_trim_nothing_is_done(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_malloc_trim", lambda: None)
    trimmer = HeapTrimmer()
    assert not trimmer.available
    assert trimmer.trim() is False
    assert trimmer.trims == 0


async def test_the_runtime_trims_after_the_first_round_then_every_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[bool] = []
    cfg = config.parse(
        {
            "prometheus": {"enabled": False},
            "state_dir": str(tmp_path),
            "heartbeat": {"interval": 0.4},
        }
    )
    gpu = GpuSettings(interval=0.1, event_thread=False, sysfs_root="/nonexistent")
    cfg = dataclasses.replace(cfg, collectors={"gpu": gpu})
    runtime = Runtime(
        cfg, StateStore.open(tmp_path), collectors=registry.COLLECTORS, sinks=registry.SINKS
    )
    fake = FakeNvml(fake_gpus(1))
    runtime.shared.put(NvmlBackend, NvmlBackend(fake))

    def counting(pad: int) -> int:
        calls.append(runtime.first_round.is_set())
        return 1

    runtime.heap = HeapTrimmer(counting)
    monkeypatch.setattr(core, "TRIM_INTERVAL", 0.5)
    await runtime.start()
    try:
        await until(lambda: len(calls) >= 3, timeout=10, what="three trims")
    finally:
        await runtime.stop()
    assert all(calls), "a trim before the first round ended"
    assert runtime.heap.trims == len(calls)
