"""A reload never raises an Xid counter: whichever source saw the Xid (the kernel log, NVML's
event thread) and whichever of its collectors a reload makes again (restarted, or disabled and
enabled again), `gpuwarden_xid_errors_total` still counts it once.

The counters are the process's correlator's. Each source's collector takes over, once per
process, the counts its boot's last life stored (`XidCorrelator.carry_counts`); on a boot with
none stored, the first instance took over nothing and did not say so, and the instance a reload
made took over the snapshot this process itself had stored since: every Xid counted twice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from agent.contracts.collector import CollectorSettings
from agent.runtime.core import CollectorStatus
from tests.support.waiting import until
from tests.test_xid_series import Agent


def kmsg_xid(agent: Agent, code: int) -> None:
    """The driver's line for GPU 0 (NVML's 00000000:18:00.0 is the kernel's 0000:18:00)."""
    domain, bus, device = agent.fake.gpus[0].pci_bus_id.split(".")[0].split(":")
    agent.kmsg.write(f"NVRM: Xid (PCI:{domain[-4:]}:{bus}:{device}): {code}, pid=1, name=job")


def nvml_xid(agent: Agent, code: int) -> None:
    agent.xid(code)


def count(agent: Agent, code: int) -> float:
    return sum(
        s.value
        for s in agent.look()
        if s.family.name == "gpuwarden_xid_errors_total" and s.labels["xid"] == str(code)
    )


def counted(agent: Agent, code: int, at_least: float) -> bool:
    return count(agent, code) >= at_least


def rounds(status: CollectorStatus, at_least: int) -> bool:
    return status.rounds_done >= at_least


async def restart(agent: Agent, name: str) -> None:
    settings = agent.runtime.config.collectors[name]
    await reload_to(agent, name, dataclasses.replace(settings, timeout=settings.timeout + 1))


async def disable_then_enable(agent: Agent, name: str) -> None:
    settings = agent.runtime.config.collectors[name]
    await reload_to(agent, name, dataclasses.replace(settings, enabled=False))
    await reload_to(agent, name, settings)


async def reload_to(agent: Agent, name: str, settings: CollectorSettings) -> None:
    collectors = {**agent.runtime.config.collectors, name: settings}
    await agent.runtime.reload(dataclasses.replace(agent.runtime.config, collectors=collectors))


Reload = Callable[[Agent, str], Awaitable[None]]


@pytest.mark.parametrize("source", [kmsg_xid, nvml_xid], ids=["kernel-log", "nvml"])
@pytest.mark.parametrize("reloaded", ["kernel_log", "gpu"])
@pytest.mark.parametrize("reload", [restart, disable_then_enable], ids=["restart", "disable"])
async def test_a_reload_counts_no_xid_twice(
    tmp_path: Path, source: Callable[[Agent, int], None], reloaded: str, reload: Reload
) -> None:
    agent = Agent(tmp_path, "enabled")
    await agent.start()
    try:
        for seen, code in enumerate((79, 48, 79), start=1):
            expected = 2 if seen == 3 else 1
            source(agent, code)
            await until(functools.partial(counted, agent, code, expected), what=f"Xid {code}")
            assert await agent.runtime.settle()  # its snapshot stored with it
            await reload(agent, reloaded)
            status = agent.runtime.collectors[reloaded]
            done = status.rounds_done
            await until(functools.partial(rounds, status, done + 2), what="rounds after it")
            await asyncio.sleep(0)
            assert count(agent, code) == expected, (code, agent.look())
        assert count(agent, 48) == 1
        agent.assert_once()
    finally:
        await agent.stop()
