"""A runtime with no collectors and its control socket, as `gpuwarden run` serves it, on a
real state store: for the tests of the commands that talk to the running agent."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

from agent.program import config_file as config
from agent.program import registry
from agent.program.control import ControlServer
from agent.program.control_client import socket_path
from agent.runtime.core import Runtime
from agent.runtime.state import StateStore


@contextlib.asynccontextmanager
async def started_runtime(state_dir: Path) -> AsyncIterator[Runtime]:
    """A runtime with no collectors on a real state store in `state_dir` (made here), started;
    stopped after."""
    state_dir.mkdir(mode=0o700)
    cfg = config.parse({"prometheus": {"enabled": False}})
    cfg = dataclasses.replace(
        cfg, core=dataclasses.replace(cfg.core, state_dir=state_dir), collectors={}
    )
    store = StateStore.open(state_dir)
    runtime = Runtime(cfg, store, collectors={}, sinks=registry.SINKS, boot_id="boot-a")
    await runtime.start()
    try:
        yield runtime
    finally:
        await runtime.stop()
        store.close()


@contextlib.asynccontextmanager
async def controlled_runtime(state_dir: Path) -> AsyncIterator[Runtime]:
    """Started, with its control socket at `socket_path(state_dir)`; stopped after."""
    async with started_runtime(state_dir) as runtime:
        control = ControlServer(runtime, socket_path(state_dir))
        await control.start()
        try:
            yield runtime
        finally:
            await control.stop()
