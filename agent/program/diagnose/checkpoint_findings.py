"""Checkpoints for `check` (a line per watched location), `diag` (an index: names, sizes, steps,
checksums and ages, never contents) and `checkpoint verify` (the collector's judgement now).

`check` runs the collector itself for two rounds a short gap apart (what it sees change between
them is still being written), so its lines say what the daemon would say. The index and
`verify` drive the collector's own `Judge` on a pool of their own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.contracts.config import Config
from agent.program.diagnose.collect_once import CollectorResult, OneShotCollectors
from agent.program.diagnose.findings import Finding, Status
from agent.runtime.blocking import PooledCaller
from collectors.checkpoints import collector as ckpt
from collectors.checkpoints.detect import DEFAULT_TEMP_PATTERNS, classify, observe, scan_location
from collectors.checkpoints.judge import Judge, JudgeSettings, RoundOutcome
from collectors.checkpoints.settings import CheckpointSettings

MIB = 2**20
CALL_TIMEOUT = 600.0
CHECK_GAP_SECONDS = 1.0


@dataclass(frozen=True)
class Looked:
    """One PATH judged: the outcome of the second look and the judge (its sidecar digests)."""

    outcome: RoundOutcome
    judge: Judge


def _observe(path: Path, temp_patterns: tuple[str, ...]) -> list[Any]:
    candidate = classify(path, temp_patterns)
    if candidate is not None:
        seen = observe(candidate)
        return [seen] if seen else []
    return scan_location(path, "*", temp_patterns, 1_000_000)


async def verify_paths(
    paths: list[Path],
    gap: float,
    settle: float,
    bandwidth_mib_s: float,
    *,
    hash_sidecars: bool = True,
    temp_patterns: tuple[str, ...] = DEFAULT_TEMP_PATTERNS,
) -> dict[str, Looked | str]:
    """Per PATH: two looks `gap` apart, or why it could not be looked at."""
    settings = JudgeSettings(
        settle_seconds=settle,
        hash_newest=1_000_000 if hash_sidecars else 0,
        hash_bytes_per_second=bandwidth_mib_s * MIB,
        hash_call_bytes=max(int(bandwidth_mib_s * MIB * 60), MIB),
    )
    out: dict[str, Looked | str] = {}
    with concurrent.futures.ThreadPoolExecutor(4) as executor:
        caller = PooledCaller(executor, CALL_TIMEOUT)
        for path in paths:
            judge = Judge(settings, str(path))
            try:
                first = await caller.call(f"scan:{path}", _observe, path, temp_patterns)
                await judge.round(caller, first, time.time(), 0.0)
                await asyncio.sleep(gap)
                second = await caller.call(f"scan:{path}", _observe, path, temp_patterns)
                out[str(path)] = Looked(await judge.round(caller, second, time.time(), 1e9), judge)
            except OSError as exc:
                out[str(path)] = f"{path}: {exc.strerror or exc}"
    return out


# -- diag: the index ----------------------------------------------------------------------------


async def checkpoint_index(config: Config) -> dict[str, Any] | None:
    """Every watched location's checkpoints, as the collector judges their structure (no
    hashing: a bundle is not the moment for reading 100 GiB); None when none is watched."""
    settings = config.collectors.get("checkpoints")
    if not isinstance(settings, CheckpointSettings) or not settings.enabled:
        return None
    now = time.time()
    looked = await verify_paths(
        [loc.path for loc in settings.locations],
        0.0,
        settings.settle_seconds,
        settings.hash_bandwidth_mib_s,
        hash_sidecars=False,
        temp_patterns=settings.temp_patterns,
    )
    index: dict[str, Any] = {}
    for loc in settings.locations:
        entry = looked[str(loc.path)]
        if isinstance(entry, str):
            index[loc.label] = {"path": str(loc.path), "error": entry}
            continue
        index[loc.label] = {
            "path": str(loc.path),
            "max_age": loc.max_age,
            "offnode": loc.target,
            "checkpoints": [
                {
                    "name": v.name,
                    "kind": v.kind,
                    "status": v.status,
                    "step": v.step,
                    "size_bytes": v.size_bytes,
                    "age_seconds": round(now - v.mtime, 1),
                    "sidecar_sha256": entry.judge.expected(v.name),
                    "problem": v.problem,
                }
                for v in entry.outcome.verdicts
            ],
        }
    return index


# -- check: a line per location -----------------------------------------------------------------


async def check_checkpoints(runner: OneShotCollectors, config: Config) -> list[Finding]:
    settings = config.collectors.get("checkpoints")
    if not isinstance(settings, CheckpointSettings) or not settings.enabled:
        return []
    result = await runner.run("checkpoints", rounds=2, gap=CHECK_GAP_SECONDS)
    return classify_checkpoints(result, settings)


def _by_location(result: CollectorResult, family: str) -> dict[str, float]:
    return {s.labels["location"]: s.value for s in result.values(family)}


def classify_checkpoints(result: CollectorResult, settings: CheckpointSettings) -> list[Finding]:
    if result.error:
        return [
            Finding("checkpoints", "checkpoints", Status.WARN, f"the round failed: {result.error}")
        ]
    ages = _by_location(result, ckpt.NEWEST_AGE.name)
    steps = _by_location(result, ckpt.NEWEST_STEP.name)
    sizes = _by_location(result, ckpt.NEWEST_SIZE.name)
    errors = _by_location(result, ckpt.LOCATION_ERROR.name)
    corrupt_latest = _by_location(result, ckpt.LATEST_CORRUPT.name)
    offnode_ok = _by_location(result, ckpt.OFFNODE_OK.name)
    counts: dict[str, dict[str, float]] = {}
    for sample in result.values(ckpt.COUNT.name):
        counts.setdefault(sample.labels["location"], {})[sample.labels["status"]] = sample.value
    events = {e.subject: e for e in result.events if e.severity.name in ("WARNING", "CRITICAL")}
    findings = []
    for loc in settings.locations:
        label, name = loc.label, f"checkpoints {loc.label}"
        event = events.get(label)
        action = event.action if event else ""
        if errors.get(label):
            detail = event.message if event else f"{loc.path} cannot be listed"
            findings.append(Finding("checkpoints", name, Status.FAIL, detail, action))
            continue
        count = counts.get(label, {})
        tally = ", ".join(f"{int(n)} {s}" for s, n in count.items() if n)
        if label not in ages:
            findings.append(
                Finding(
                    "checkpoints",
                    name,
                    Status.FAIL,
                    f"no complete checkpoint in {loc.path} ({tally or 'none at all'})",
                    f"gpuwarden checkpoint verify {loc.path}",
                )
            )
            continue
        step = f"step {int(steps[label])}, " if label in steps else ""
        detail = (
            f"newest complete: {step}{sizes.get(label, 0) / MIB:.1f} MiB, "
            f"{ages[label] / 3600:.1f} h old (max_age {loc.max_age / 3600:.1f} h); {tally}"
        )
        status = Status.OK
        if corrupt_latest.get(label):
            status, detail = Status.FAIL, f"the latest save is corrupt; {detail}"
        elif ages[label] > loc.max_age:
            status = Status.WARN
        elif offnode_ok.get(label) == 0:
            status, detail = Status.WARN, f"off-node copy {loc.target} is behind; {detail}"
        elif label in offnode_ok:
            detail += f"; off-node copy {loc.target} holds it"
        findings.append(
            Finding(
                "checkpoints",
                name,
                status,
                detail,
                action
                or (f"gpuwarden checkpoint verify {loc.path}" if status is not Status.OK else ""),
            )
        )
    # One line per location, in order: each gets the stable id and its label as the subject.
    return [
        dataclasses.replace(f, check="checkpoints", subject=loc.label)
        for f, loc in zip(findings, settings.locations, strict=True)
    ]
