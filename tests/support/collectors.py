"""Test collectors with scripted behaviour, and a runtime built around them."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from agent.contracts.collector import (
    CollectContext,
    CollectorDeps,
    CollectorSettings,
    CollectorSpec,
)
from agent.contracts.model import Collection, Event, MetricFamily, MetricType, Severity
from agent.program import config_file as config
from agent.program import registry
from agent.runtime.core import Runtime
from agent.runtime.state import StateStore

ROUNDS = MetricFamily(
    "gpuwarden_test_rounds", MetricType.GAUGE, "Rounds seen by a test collector", ("collector",)
)


class ScriptedCollector:
    """mode: ok | raise | hang (blocks in a ctx.call until `release` is set) | slow |
    write (stores its round count in `deps.state`, namespace "test", key its name)."""

    def __init__(self, name: str, mode: str, deps: CollectorDeps) -> None:
        self.name = name
        self.mode = mode
        self.deps = deps
        self.rounds: list[float] = []
        self.release = threading.Event()
        self.calls_started = 0
        self.closed = False

    def families(self) -> Sequence[MetricFamily]:
        return (ROUNDS,)

    def _block(self) -> str:
        self.calls_started += 1
        self.release.wait(30)
        return "released"

    async def collect(self, ctx: CollectContext) -> Collection:
        self.rounds.append(time.monotonic())
        if self.mode == "raise":
            raise RuntimeError("scripted failure")
        if self.mode == "hang":
            await ctx.call("test:block", self._block)
        if self.mode == "slow":
            await ctx.call("test:sleep", time.sleep, 0.2)
        if self.mode == "write":
            self.deps.state.put("test", self.name, len(self.rounds))
        events = []
        if len(self.rounds) == 1:
            events.append(
                Event(
                    source=self.name,
                    kind="first_round",
                    severity=Severity.INFO,
                    message=f"{self.name} ran its first round",
                )
            )
        return Collection(samples=[ROUNDS.sample(len(self.rounds), self.name)], events=events)

    async def close(self) -> None:
        self.closed = True
        self.release.set()


def scripted_runtime(
    modes: Mapping[str, str],
    interval: float = 0.1,
    timeout: float = 0.3,
    store: StateStore | None = None,
    core: Mapping[str, Any] | None = None,
    *,
    boot_id: str = "",
) -> tuple[Runtime, dict[str, ScriptedCollector]]:
    """A runtime whose collectors are ScriptedCollectors; no sinks. `boot_id`: the boot it
    runs in (empty: unknown)."""
    made: dict[str, ScriptedCollector] = {}
    specs: dict[str, CollectorSpec[Any]] = {}
    for name, mode in modes.items():

        def factory(
            settings: CollectorSettings, deps: CollectorDeps, name: str = name, mode: str = mode
        ) -> ScriptedCollector:
            made[name] = ScriptedCollector(name, mode, deps)
            return made[name]

        specs[name] = CollectorSpec(name, "test", CollectorSettings, factory)
    cfg = config.parse({"prometheus": {"enabled": False}, **(core or {})})
    settings = CollectorSettings(interval=interval, timeout=timeout)
    cfg = dataclasses.replace(cfg, collectors=dict.fromkeys(modes, settings))
    runtime = Runtime(
        cfg,
        store or StateStore.in_memory(),
        collectors=specs,
        sinks=registry.SINKS,
        boot_id=boot_id,
    )
    return runtime, made
