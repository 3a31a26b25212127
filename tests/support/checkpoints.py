"""Real checkpoints for the checkpoint tests, written by torch (CPU) and by safetensors, and a
harness that runs the checkpoints collector round by round on a real thread pool."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from agent.contracts.collector import CollectContext, CollectorDeps, MemoryKeyValueStore
from agent.contracts.collector import SharedServices as Shared
from agent.contracts.model import Collection, Event
from agent.runtime.blocking import PooledCaller
from collectors.checkpoints.collector import CheckpointCollector
from collectors.checkpoints.settings import CheckpointSettings, LocationSettings

HOUR = 3600.0


def tensors(seed: int = 0, rows: int = 64) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "layer.weight": torch.randn(rows, 32, generator=generator),
        "layer.bias": torch.randn(32, generator=generator),
        "embed": torch.randint(0, 100, (rows, 4), generator=generator),
    }


def write_safetensors(path: Path, seed: int = 0, rows: int = 64) -> Path:
    save_file(tensors(seed, rows), str(path))
    return path


def write_torch(path: Path, seed: int = 0, rows: int = 64, step: int = 0) -> Path:
    torch.save({"model": tensors(seed, rows), "step": step}, path)
    return path


def write_hf(directory: Path, step: int, rows: int = 64) -> Path:
    """What transformers' Trainer writes: weights, optimizer and scheduler, trainer state."""
    directory.mkdir(parents=True)
    write_safetensors(directory / "model.safetensors", step, rows)
    torch.save({"state": {0: {"exp_avg": torch.zeros(rows, 32)}}}, directory / "optimizer.pt")
    torch.save({"last_epoch": step}, directory / "scheduler.pt")
    (directory / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return directory


def write_dcp(directory: Path, seed: int = 0) -> Path:
    import warnings

    from torch.distributed.checkpoint.state_dict_saver import save

    with warnings.catch_warnings():  # "torch.distributed is disabled": one process, on purpose
        warnings.simplefilter("ignore", UserWarning)
        save({"model": tensors(seed)}, checkpoint_id=str(directory))
    return directory


def write_sidecar(path: Path, digest: str | None = None) -> Path:
    digest = digest or hashlib.sha256(path.read_bytes()).hexdigest()
    sidecar = Path(f"{path}.sha256")
    sidecar.write_text(f"{digest}  {path.name}\n")
    return sidecar


def age(path: Path, seconds: float, now: float | None = None) -> None:
    """Set the modification time of `path` (and everything below it) `seconds` in the past."""
    stamp = (now or time.time()) - seconds
    targets = [path, *path.rglob("*")] if path.is_dir() else [path]
    sidecar = Path(f"{path}.sha256")
    if sidecar.exists():
        targets.append(sidecar)
    for target in targets:
        os.utime(target, (stamp, stamp))


def location(path: Path, **changes: Any) -> LocationSettings:
    return LocationSettings(path=path, name="train", **changes)


class Harness:
    """The collector, built as the runtime builds it, with rounds run on a real pool."""

    def __init__(self, settings: CheckpointSettings, state: MemoryKeyValueStore | None = None):
        self.executor = concurrent.futures.ThreadPoolExecutor(4)
        self.state = state or MemoryKeyValueStore()
        deps = CollectorDeps("node", Path("/nonexistent"), self.state, Shared(), self._emit)
        self.collector = CheckpointCollector(settings, deps)
        self.caller = PooledCaller(self.executor, settings.timeout)
        self.rounds = 0
        self.emitted: list[Event] = []

    def _emit(self, event: Event) -> None:
        self.emitted.append(event)

    async def round(self, now: float | None = None) -> Collection:
        ctx = CollectContext(self.caller, time.time() if now is None else now, self.rounds)
        self.rounds += 1
        return await self.collector.collect(ctx)

    def close(self) -> None:
        self.executor.shutdown(wait=True)


def values(collection: Collection, name: str) -> dict[tuple[str, ...], float]:
    return {s.label_values: s.value for s in collection.samples if s.family.name == name}


def kinds(collection: Collection) -> list[str]:
    return [e.kind for e in collection.events]
