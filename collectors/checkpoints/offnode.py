"""The off-node copy: does it hold the newest complete checkpoint, intact, in time?

A copy holds a checkpoint when an entry of the same name is there with every file at the
local size. Sizes are always compared; checksums where the copy can give one: a directory copy
by its sidecar (the same sha256sum lines as the local one), an S3 copy by the ETag, which is
the object's MD5 only for a single-part upload (a multipart ETag is `<md5 of the part MD5s>-N`
and says nothing comparable without the part sizes): each comparison says which check was
possible (`checksum_check`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from agent.contracts.errors import CallStillHung, CallTimedOut
from collectors.checkpoints.detect import is_temporary, scan_location
from collectors.checkpoints.judge import Caller, Judge, JudgeSettings, RoundOutcome, Verdict
from collectors.checkpoints.settings import CheckpointSettings, LocationSettings


@dataclass(frozen=True, slots=True)
class CopyEntry:
    """One checkpoint as the copy holds it."""

    files: Mapping[str, int]
    """size by path relative to the checkpoint ("" for a single file)"""
    sha256: Mapping[str, str] | None = None
    etags: Mapping[str, str] = field(default_factory=dict)
    problem: str = ""
    """Non-empty when the copy's entry is there but unusable (its structure does not read)."""


@dataclass(frozen=True, slots=True)
class Comparison:
    ok: bool = True
    held_step: int | None = None
    lag_seconds: float | None = None
    kind: str = ""
    problem: str = ""
    action: str = ""
    checksum_check: str = ""
    error: str = ""


class OffnodeCopy(Protocol):
    async def compare(
        self, caller: Caller, outcome: RoundOutcome, local: Judge, now: float
    ) -> Comparison: ...


def make_copy(
    loc: LocationSettings, settings: CheckpointSettings, judge_settings: JudgeSettings
) -> OffnodeCopy | None:
    if loc.copy_dir is not None:
        return DirectoryCopy(loc, settings, judge_settings)
    if loc.s3_bucket:
        from collectors.checkpoints.s3 import S3Copy  # noqa: PLC0415 (s3 imports offnode)

        return S3Copy(loc, settings)
    return None


def judge_copy(
    loc: LocationSettings,
    complete: Sequence[Verdict],
    local: Judge,
    entries: Mapping[str, CopyEntry],
    now: float,
) -> Comparison:
    """Compare the local complete checkpoints (newest first) with what the copy holds."""
    if not complete:
        return Comparison()
    newest = complete[0]
    checks: set[str] = set()
    for verdict in complete:
        entry = entries.get(verdict.name)
        if entry is None:
            continue
        mismatch = _mismatch(verdict, local, entry, checks)
        if mismatch:
            return Comparison(
                ok=False,
                kind="checkpoint_offnode_mismatch",
                problem=f"the off-node copy of {verdict.name} in {loc.target} differs: {mismatch}",
                action=f"copy {verdict.name} again; do not restart from the off-node copy of it",
                checksum_check=", ".join(sorted(checks)),
            )
        if not _held(verdict, local, entry):
            continue
        lag = max(newest.mtime - verdict.mtime, 0.0)
        in_time = verdict is newest or now - newest.mtime <= loc.offnode_max_lag
        return Comparison(
            ok=in_time,
            held_step=verdict.step,
            lag_seconds=lag,
            kind="" if in_time else "checkpoint_offnode_behind",
            problem="" if in_time else _behind(loc, newest, verdict, now),
            action="" if in_time else _behind_action(loc, newest),
            checksum_check=", ".join(sorted(checks)),
        )
    overdue = now - newest.mtime > loc.offnode_max_lag
    return Comparison(
        ok=not overdue,
        kind="checkpoint_offnode_behind" if overdue else "",
        problem=_behind(loc, newest, None, now) if overdue else "",
        action=_behind_action(loc, newest) if overdue else "",
    )


def _held(verdict: Verdict, local: Judge, entry: CopyEntry) -> bool:
    return not entry.problem and all(rel in entry.files for rel in local.files(verdict.name))


def _mismatch(verdict: Verdict, local: Judge, entry: CopyEntry, checks: set[str]) -> str:
    if entry.problem:
        return entry.problem
    files = local.files(verdict.name)
    checks.add("size")
    for rel, size in sorted(files.items()):
        there = entry.files.get(rel)
        if there is not None and there != size:
            return f"{rel or verdict.name}: {there} bytes off node, {size} here"
    expected = local.expected(verdict.name)
    if expected is not None and entry.sha256 is not None:
        checks.add("sha256 sidecar")
        for rel, digest in sorted(expected.items()):
            if rel in entry.sha256 and entry.sha256[rel] != digest:
                return f"{rel or verdict.name}: the sidecars' sha256 differ"
    md5s = {_rel(path, verdict.path): md5 for path, md5 in local.md5s(verdict.name).items()}
    for rel, etag in sorted(entry.etags.items()):
        if "-" in etag:
            checks.add("size only for multipart uploads (their ETag is not an MD5)")
            continue
        if rel in md5s:
            checks.add("MD5 = single-part ETag")
            if md5s[rel] != etag:
                return f"{rel or verdict.name}: ETag {etag} is not the local MD5 {md5s[rel]}"
    return ""


def _rel(path: Path, root: Path) -> str:
    return "" if path == root else str(path.relative_to(root))


def _behind(loc: LocationSettings, newest: Verdict, held: Verdict | None, now: float) -> str:
    having = f"its newest is {held.name}" if held else "it holds none of the local ones"
    return (
        f"the off-node copy {loc.target} lacks {newest.name}, complete here "
        f"{(now - newest.mtime) / 60:.0f} min ago (offnode_max_lag {loc.offnode_max_lag:g} s); "
        f"{having}"
    )


def _behind_action(loc: LocationSettings, newest: Verdict) -> str:
    return (
        f"check the upload job that copies {loc.path} to {loc.target}; if the node is lost, "
        f"the work since the newest off-node checkpoint is lost with it ({newest.name} is not there)"
    )


class DirectoryCopy:
    """The copy is another directory (a mounted volume) with the same entry names, judged by
    the same rules as the location (stable, structure reads) but never hashed."""

    def __init__(
        self, loc: LocationSettings, settings: CheckpointSettings, judge_settings: JudgeSettings
    ) -> None:
        assert loc.copy_dir is not None
        self.loc = loc
        self.settings = settings
        no_hashing = JudgeSettings(judge_settings.settle_seconds, hash_newest=0)
        self._judge = Judge(no_hashing, f"copy:{loc.label}")

    async def compare(
        self, caller: Caller, outcome: RoundOutcome, local: Judge, now: float
    ) -> Comparison:
        assert self.loc.copy_dir is not None
        try:
            observed = await caller.call(
                f"scan:copy:{self.loc.label}",
                scan_location,
                self.loc.copy_dir,
                self.loc.pattern,
                self.settings.temp_patterns,
                self.settings.max_checkpoints,
            )
        except (OSError, CallTimedOut, CallStillHung) as exc:
            return Comparison(ok=False, error=getattr(exc, "strerror", None) or str(exc))
        copied = await self._judge.round(caller, observed, now, 0.0)
        entries: dict[str, CopyEntry] = {}
        for verdict in copied.verdicts:
            if verdict.status == "incomplete":
                continue
            entries[verdict.name] = CopyEntry(
                self._judge.files(verdict.name),
                self._judge.expected(verdict.name),
                problem="" if verdict.status != "corrupt" else verdict.problem,
            )
        complete = [v for v in outcome.verdicts if v.status == "complete"]
        return judge_copy(self.loc, complete, local, entries, now)


def group_objects(
    objects: Sequence[Mapping[str, Any]], prefix: str, temp_patterns: Sequence[str]
) -> dict[str, CopyEntry]:
    """S3 objects under `prefix` as checkpoints: the first path part after the prefix is the
    checkpoint's name (`<prefix>checkpoint-500/model.safetensors`, `<prefix>model.pt`)."""
    files: dict[str, dict[str, int]] = {}
    etags: dict[str, dict[str, str]] = {}
    for obj in objects:
        rel = str(obj["Key"])[len(prefix) :]
        name, _, inner = rel.partition("/")
        if not name or is_temporary(name, temp_patterns) or name.endswith(".sha256"):
            continue
        files.setdefault(name, {})[inner] = int(obj["Size"])
        etags.setdefault(name, {})[inner] = str(obj.get("ETag", "")).strip('"')
    return {name: CopyEntry(files[name], None, etags[name]) for name in files}
