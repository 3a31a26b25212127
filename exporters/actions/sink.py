"""The `[actions]` sink: the Slurm drain and the exec hook, each only when configured.

A sink because that is what an action is to the runtime: it is told of each event (after the
event is stored and the repair ledger took it in), runs as one supervised task and shows its
own series and problems. It sees the runtime only as a SinkContext.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from agent.contracts.model import MetricFamily, Sample
from agent.contracts.sink import SinkContext, SinkSpec
from exporters.actions.exec_hook import ExecHook
from exporters.actions.settings import ActionsSettings
from exporters.actions.slurm import SlurmAction


class ActionsSink:
    name = "actions"
    expected_interval: float | None = None

    def __init__(self, settings: ActionsSettings, context: SinkContext) -> None:
        self.settings = settings
        self.context = context
        self.slurm = SlurmAction(settings.slurm, context) if settings.slurm.enabled else None
        self.exec = ExecHook(settings.exec, context) if settings.exec.enabled else None
        for part in (self.slurm, self.exec):
            if part is not None:
                context.subscribe(part.on_event)

    def families(self) -> Sequence[MetricFamily]:
        out: list[MetricFamily] = []
        for part in (self.slurm, self.exec):
            if part is not None:
                out.extend(part.families())
        return out

    def samples(self) -> Sequence[Sample]:
        out: list[Sample] = []
        for part in (self.slurm, self.exec):
            if part is not None:
                out.extend(part.samples())
        return out

    def problems(self) -> Sequence[str]:
        return self.slurm.problems() if self.slurm is not None else []

    async def start(self) -> None:
        return None

    async def run(self) -> None:
        tasks = [
            asyncio.create_task(part.run(), name=f"actions:{label}")
            for label, part in (("slurm", self.slurm), ("exec", self.exec))
            if part is not None
        ]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*tasks, return_exceptions=True)

    async def stop(self) -> None:
        return None  # run()'s cancellation kills running hooks and scontrol (process groups)


SPEC = SinkSpec(
    name="actions",
    description="drain the node in Slurm, run a hook program",
    settings_type=ActionsSettings,
    factory=ActionsSink,
)
