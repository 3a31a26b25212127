"""Checkpoint verification: hashing throughput (limited and not) and the collector's cost per
round with 1,000 checkpoints in a location.

1. Throughput on one safetensors file of --size-mib MiB with its .sha256 sidecar: the structure
   read (header only), the collector's HashJob without a limit and at the default 50 MiB/s,
   and `sha256sum` beside them. The file was just written, so the reads are from the page
   cache unless --drop-caches (root) empties it before each run: the figures say which.
2. Cost per round: --checkpoints files (safetensors, 1 in 10 with a sidecar) in one location,
   or as many HF-style `checkpoint-<step>/` directories; the first round (every structure read,
   the newest two hashed) and the steady rounds after it (a stat per file), wall and CPU time
   (time.process_time: every thread of this process).

    python bench/checkpoints.py [--size-mib 512] [--checkpoints 1000] [--rounds 5] [--drop-caches]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
from safetensors.numpy import save_file

from agent.contracts.collector import (
    CollectContext,
    CollectorDeps,
    MemoryKeyValueStore,
    SharedServices,
)
from agent.runtime.blocking import PooledCaller
from collectors.checkpoints.checksums import Expected, HashJob
from collectors.checkpoints.collector import CheckpointCollector
from collectors.checkpoints.formats import read_safetensors
from collectors.checkpoints.settings import CheckpointSettings, LocationSettings

MIB = 2**20


def drop_caches(enabled: bool) -> str:
    if not enabled:
        return "page cache"
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as exc:
        return f"page cache (drop_caches refused: {exc.strerror})"
    return "from disk (caches dropped)"


def write_big(directory: Path, size_mib: int) -> Path:
    path = directory / "big.safetensors"
    rows = size_mib * MIB // (1024 * 4)
    save_file(
        {"w": np.random.default_rng(0).standard_normal((rows, 1024), dtype=np.float32)}, str(path)
    )
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    Path(f"{path}.sha256").write_text(f"{digest}  {path.name}\n")
    return path


def time_hash(path: Path, rate: float) -> float:
    digest = Path(f"{path}.sha256").read_text().split()[0]
    job = HashJob([Expected(path, digest)], rate)
    started = time.perf_counter()
    while not job.step(64 * MIB):
        pass
    assert not job.mismatches
    return path.stat().st_size / MIB / (time.perf_counter() - started)


def throughput(directory: Path, size_mib: int, drop: bool) -> list[tuple[str, str, str]]:
    path = write_big(directory, size_mib)
    rows: list[tuple[str, str, str]] = []
    where = drop_caches(drop)
    started = time.perf_counter()
    read_safetensors(path)
    rows.append(
        (
            "structure read (header, offsets)",
            f"{(time.perf_counter() - started) * 1e3:.2f} ms",
            where,
        )
    )
    where = drop_caches(drop)
    rows.append(("HashJob sha256, no limit", f"{time_hash(path, 1e15):.0f} MiB/s", where))
    where = drop_caches(drop)
    rows.append(("HashJob sha256, 50 MiB/s limit", f"{time_hash(path, 50 * MIB):.1f} MiB/s", where))
    if shutil.which("sha256sum"):
        where = drop_caches(drop)
        started = time.perf_counter()
        subprocess.run(["sha256sum", str(path)], check=True, capture_output=True)
        rows.append(
            (
                "sha256sum (coreutils)",
                f"{size_mib / (time.perf_counter() - started):.0f} MiB/s",
                where,
            )
        )
    return rows


def make_location(directory: Path, count: int, kind: str) -> None:
    tensor = {"w": np.zeros((64, 64), dtype=np.float32)}
    stamp = time.time() - 7200
    for i in range(count):
        if kind == "files":
            path = directory / f"step_{i:06d}.safetensors"
            save_file(tensor, str(path))
            targets = [path]
            if i % 10 == 0:
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
                sidecar = Path(f"{path}.sha256")
                sidecar.write_text(f"{digest}  {path.name}\n")
                targets.append(sidecar)
        else:
            path = directory / f"checkpoint-{i}"
            path.mkdir()
            save_file(tensor, str(path / "model.safetensors"))
            (path / "trainer_state.json").write_text(json.dumps({"global_step": i}))
            targets = [path, *path.iterdir()]
        for target in targets:
            os.utime(target, (stamp + i, stamp + i))


async def rounds(directory: Path, count: int) -> tuple[float, float, float, float]:
    settings = CheckpointSettings(
        enabled=True, locations=(LocationSettings(path=directory, max_age=86400.0),)
    )
    deps = CollectorDeps(
        "bench", directory, MemoryKeyValueStore(), SharedServices(), lambda e: None
    )
    collector = CheckpointCollector(settings, deps)
    with concurrent.futures.ThreadPoolExecutor(4) as executor:
        caller = PooledCaller(executor, settings.timeout)
        walls: list[float] = []
        cpus: list[float] = []
        for number in range(count + 1):
            wall, cpu = time.perf_counter(), time.process_time()
            await collector.collect(CollectContext(caller, time.time(), number))
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
    return walls[0], cpus[0], statistics.median(walls[1:]), statistics.median(cpus[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--checkpoints", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--drop-caches", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpuwarden-bench-ckpt-", dir="/var/tmp") as tmp:
        base = Path(tmp)
        print(f"verification of one {args.size_mib} MiB safetensors file")
        print(f"{'what':<36} {'figure':>14}  reads")
        for what, figure, where in throughput(base, args.size_mib, args.drop_caches):
            print(f"{what:<36} {figure:>14}  {where}")
        (base / "big.safetensors").unlink()
        print()
        print(
            f"cost per round, {args.checkpoints} checkpoints in one location (median of {args.rounds} steady rounds)"
        )
        print(
            f"{'layout':<28} {'first wall':>11} {'first CPU':>10} {'steady wall':>12} {'steady CPU':>11}"
        )
        for kind in ("files", "hf-directories"):
            location = base / kind
            location.mkdir()
            make_location(location, args.checkpoints, kind)
            first_wall, first_cpu, wall, cpu = asyncio.run(rounds(location, args.rounds))
            print(
                f"{kind:<28} {first_wall * 1e3:>9.0f}ms {first_cpu * 1e3:>8.0f}ms "
                f"{wall * 1e3:>10.1f}ms {cpu * 1e3:>9.1f}ms"
            )


if __name__ == "__main__":
    main()
