"""A reload never forgets a hung call: the collector's thread pool and its table of hung keys
outlive a restart of the collector, so a key that still hangs gets no new thread and no new
stall event (collectors' own stall events: tests/test_reload_gpu_disk.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Any

from agent.contracts.collector import (
    CollectContext,
    CollectorSettings,
    CollectorSpec,
)
from agent.contracts.model import Collection, Event
from agent.program import config_file as config
from agent.program import registry
from agent.runtime.core import Runtime
from agent.runtime.state import StateStore
from tests.support.waiting import announced, until


def kind_of(runtime: Runtime, kind: str) -> list[Event]:
    return [e for e in runtime.recent_events if e.kind == kind]


def runtime_for(collectors: dict[str, CollectorSettings], **specs: Any) -> Runtime:
    """A runtime running `collectors`, with the registry's specs unless `specs` names others."""
    cfg = config.parse({"prometheus": {"enabled": False}})
    cfg = dataclasses.replace(cfg, collectors=collectors)
    return Runtime(
        cfg,
        StateStore.in_memory(),
        collectors={**registry.COLLECTORS, **specs},
        sinks=registry.SINKS,
    )


async def reload_with(runtime: Runtime, name: str, settings: CollectorSettings) -> None:
    """A reload that changes one collector's settings (so it is restarted), and its first
    round under them."""
    await runtime.reload(
        dataclasses.replace(
            runtime.config, collectors={**runtime.config.collectors, name: settings}
        )
    )
    status = runtime.collectors[name]
    assert status.settings == settings
    await until(lambda: status.rounds_done >= 2, what=f"{name}'s rounds after the reload")


class Blocking:
    """Blocks in one call per round (`hang:<key>`) until released; counts every thread that
    entered the call, over all instances."""

    entered = 0
    name = "blocking"

    def __init__(self, release: threading.Event) -> None:
        self.release = release

    def families(self) -> tuple[()]:
        return ()

    def _block(self) -> None:
        Blocking.entered += 1
        self.release.wait(60)

    async def collect(self, ctx: CollectContext) -> Collection:
        await ctx.call("hang:device", self._block)
        return Collection()

    async def close(self) -> None:
        return None


def blocking_spec(release: threading.Event) -> CollectorSpec[Any]:
    return CollectorSpec(
        "blocking", "test", CollectorSettings, lambda settings, deps: Blocking(release)
    )


class TestHungAcrossReloads:
    async def test_no_new_thread_no_new_event(self) -> None:
        Blocking.entered = 0
        release = threading.Event()
        settings = CollectorSettings(interval=0.05, timeout=0.2)
        runtime = runtime_for({"blocking": settings}, blocking=blocking_spec(release))
        await runtime.start()
        try:
            await until(lambda: runtime.hung_calls() == 1, what="the call to hang")
            # Announced means stored: the store thread, started at the first write, exists
            # now, and is not counted as a thread the reloads made.
            await until(lambda: bool(kind_of(runtime, "call_hung")), what="call_hung stored")
            pool = runtime.collectors["blocking"].executor
            threads = threading.active_count()
            for i in range(6):
                await reload_with(runtime, "blocking", settings.replace(interval=0.05 + i / 100))
            assert runtime.collectors["blocking"].executor is pool
            assert Blocking.entered == 1
            assert threading.active_count() <= threads
            assert runtime.hung_calls() == 1
            assert len(kind_of(runtime, "call_hung")) == 1
            status = runtime.collectors["blocking"]
            assert "hung" in status.last_error
            release.set()
            await until(lambda: runtime.hung_calls() == 0, what="the call to return")
            assert len(await announced(runtime, "call_recovered")) == 1
        finally:
            release.set()
            await runtime.stop()

    async def test_a_call_in_flight_at_the_reload_is_not_started_again(self) -> None:
        """The reload cancels the round while its call waits (not timed out yet): the thread
        runs on, and the next instance must wait for it, not start a second one."""
        Blocking.entered = 0
        release = threading.Event()
        settings = CollectorSettings(interval=0.05, timeout=1.0)
        runtime = runtime_for({"blocking": settings}, blocking=blocking_spec(release))
        await runtime.start()
        try:
            await until(lambda: Blocking.entered == 1, what="the first call")
            for i in range(4):  # well inside the 1 s timeout
                await runtime.reload(
                    dataclasses.replace(
                        runtime.config,
                        collectors={"blocking": settings.replace(interval=0.05 + i / 100)},
                    )
                )
                await asyncio.sleep(0.05)
            assert Blocking.entered == 1
            await until(lambda: runtime.hung_calls() == 1, what="the timeout to pass")
            await asyncio.sleep(0.3)
            assert Blocking.entered == 1
            assert len(await announced(runtime, "call_hung")) == 1
            assert runtime.calls_outstanding() == 1
        finally:
            release.set()
            await runtime.stop()

    async def test_disabled_collector_still_counts_its_hung_call(self) -> None:
        """Its thread is still stuck: the exit path must not wait for it (run.exit_now)."""
        Blocking.entered = 0
        release = threading.Event()
        settings = CollectorSettings(interval=0.05, timeout=0.2)
        runtime = runtime_for({"blocking": settings}, blocking=blocking_spec(release))
        await runtime.start()
        try:
            await until(lambda: runtime.hung_calls() == 1, what="the call to hang")
            await runtime.reload(
                dataclasses.replace(
                    runtime.config, collectors={"blocking": settings.replace(enabled=False)}
                )
            )
            assert "blocking" not in runtime.collectors
            assert runtime.hung_calls() == 1
            await runtime.reload(
                dataclasses.replace(runtime.config, collectors={"blocking": settings})
            )
            await until(lambda: runtime.collectors["blocking"].rounds_done >= 2, what="rounds")
            assert Blocking.entered == 1  # enabled again: it still knows the key hangs
        finally:
            release.set()
            await runtime.stop()
