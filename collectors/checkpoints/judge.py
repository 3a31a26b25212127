"""Complete or not: one location's checkpoints judged round after round.

A checkpoint is complete when (1) its name is not temporary, (2) it has not changed since the
last look, or its newest file is older than `settle_seconds` (a one-shot verify has no last
look), (3) its structure reads (formats.py), and (4) where it has a sidecar checksum, the
checksum matched. Structure reads and sidecar checks are remembered per fingerprint, so an
unchanged checkpoint is read once, not once a round: a round over a thousand checkpoints costs
a thousand stats. Hashing is the expensive part; only the `hash_newest` newest checkpoints
with a sidecar are hashed (those are the ones a restart would use), the rest are "unchecked".
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from agent.contracts.errors import CallStillHung, CallTimedOut
from collectors.checkpoints.checksums import Expected, HashJob, read_sidecar
from collectors.checkpoints.detect import Candidate, Observed, step_of, verify_structure
from collectors.checkpoints.formats import Structure, Unreadable

Status = Literal["complete", "incomplete", "corrupt", "verifying"]
Checksum = Literal["ok", "mismatch", "none", "pending", "unchecked"]
STATUSES: tuple[Status, ...] = ("complete", "incomplete", "corrupt", "verifying")


class Caller(Protocol):
    async def call(self, key: str, fn: Callable[..., Any], *args: Any) -> Any: ...


@dataclass(frozen=True, slots=True)
class JudgeSettings:
    settle_seconds: float = 60.0
    hash_newest: int = 2
    hash_bytes_per_second: float = 50 * 2**20
    hash_call_bytes: int = 64 * 2**20
    """Bytes one blocking hash call reads at most (keep it under the call timeout)."""
    md5: bool = False


@dataclass(frozen=True, slots=True)
class Verdict:
    name: str
    path: Path
    kind: str
    status: Status
    step: int | None
    size_bytes: int
    mtime: float
    checksum: Checksum
    problem: str = ""

    @property
    def action(self) -> str:
        if self.status == "complete":
            return "" if self.checksum != "unchecked" else "restartable (checksum not hashed)"
        if self.status == "corrupt":
            return f"do not restart from {self.name}: {self.problem}; use an older complete one"
        if self.status == "verifying":
            return "checksum being hashed; look again shortly"
        return "still being written, or temporary: wait for the writer to finish and rename it"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": str(self.path),
            "kind": self.kind,
            "status": self.status,
            "step": self.step,
            "size_bytes": self.size_bytes,
            "mtime": self.mtime,
            "checksum": self.checksum,
            "problem": self.problem,
            "action": self.action,
        }


@dataclass
class _Memory:
    fingerprint: tuple[tuple[str, int, int, int], ...]
    structure: Structure | None = None
    problem: str = ""
    expected: list[Expected] | None = None
    checksum: Checksum = "none"
    was_complete: bool = False
    reported_corrupt: bool = False
    md5s: dict[Path, str] = field(default_factory=dict)
    root: Path | None = None


@dataclass(frozen=True, slots=True)
class Overwritten:
    name: str
    before_size: int
    after_size: int
    same_inode: bool


@dataclass
class RoundOutcome:
    verdicts: list[Verdict]
    """Newest first (by modification time)."""
    overwritten: list[Overwritten] = field(default_factory=list)
    new_corrupt: list[Verdict] = field(default_factory=list)
    seconds: float = 0.0
    hashed_bytes: int = 0
    hash_seconds: float = 0.0

    def newest_complete(self) -> Verdict | None:
        return next((v for v in self.verdicts if v.status == "complete"), None)

    def counts(self) -> dict[Status, int]:
        out: dict[Status, int] = dict.fromkeys(STATUSES, 0)
        for verdict in self.verdicts:
            out[verdict.status] += 1
        return out


def _read(candidate: Candidate) -> tuple[Structure, list[Expected] | None]:
    """Blocking: the structure and the sidecar's expectations (Unreadable for either)."""
    return verify_structure(candidate), read_sidecar(candidate)


class Judge:
    """One location's memory across rounds; `round` is one look at it."""

    def __init__(self, settings: JudgeSettings, key: str) -> None:
        self.settings = settings
        self.key = key
        self._memory: dict[str, _Memory] = {}
        self._jobs: dict[str, HashJob] = {}

    def md5s(self, name: str) -> dict[Path, str]:
        memory = self._memory.get(name)
        return dict(memory.md5s) if memory else {}

    def expected(self, name: str) -> dict[str, str] | None:
        """The sidecar's digests by file name relative to the checkpoint; None without one."""
        memory = self._memory.get(name)
        if memory is None or memory.expected is None:
            return None
        return {_relative(e.path, memory): e.sha256 for e in memory.expected}

    def files(self, name: str) -> dict[str, int]:
        """Size of each file of the checkpoint, by path relative to it ("" for a file)."""
        memory = self._memory.get(name)
        if memory is None:
            return {}
        return {e[0]: e[1] for e in memory.fingerprint if not e[0].startswith("../")}

    async def round(
        self,
        caller: Caller,
        observed: Sequence[Observed],
        now: float,
        hash_seconds: float,
    ) -> RoundOutcome:
        started = time.monotonic()
        outcome = RoundOutcome([])
        ordered = sorted(observed, key=lambda o: (o.mtime, o.candidate.name), reverse=True)
        hash_slots = self.settings.hash_newest
        pending: list[tuple[int, Observed]] = []
        for obs in ordered:
            verdict = await self._judge(caller, obs, now, outcome)
            memory = self._memory[obs.candidate.name]
            if verdict.checksum in ("pending", "unchecked") and hash_slots > 0:
                hash_slots -= 1
                verdict = _with(verdict, status="verifying", checksum="pending")
                pending.append((len(outcome.verdicts), obs))
            memory.was_complete = verdict.status == "complete"
            outcome.verdicts.append(verdict)
        self._forget({o.candidate.name for o in ordered})
        newest = next((o for o in ordered if o.candidate.name == _newest_name(outcome)), None)
        if (
            self.settings.md5
            and newest is not None
            and not self._memory[newest.candidate.name].md5s
        ):
            # The off-node copy's single-part ETags are MD5s: the newest complete one is hashed
            # for them even without a sidecar.
            pending.append((-1, newest))
        await self._hash(caller, pending, outcome, hash_seconds)
        outcome.seconds = time.monotonic() - started
        return outcome

    async def _judge(
        self, caller: Caller, obs: Observed, now: float, outcome: RoundOutcome
    ) -> Verdict:
        cand = obs.candidate
        memory = self._memory.get(cand.name)
        changed = memory is not None and memory.fingerprint != obs.fingerprint
        if changed and memory is not None and memory.was_complete:
            before = sum(e[1] for e in memory.fingerprint if not e[0].startswith("../"))
            outcome.overwritten.append(
                Overwritten(cand.name, before, obs.size_bytes, _same_inodes(memory, obs))
            )
        base = Verdict(
            cand.name,
            cand.path,
            cand.kind,
            "incomplete",
            step_of(cand),
            obs.size_bytes,
            obs.mtime,
            "none",
        )
        stable = (
            memory is not None and not changed
        ) or now - obs.mtime >= self.settings.settle_seconds
        if cand.temporary or not stable:
            self._memory[cand.name] = _Memory(obs.fingerprint)
            self._jobs.pop(cand.name, None)
            problem = "temporary name" if cand.temporary else "changed since the last look"
            return _with(base, problem=problem)
        if memory is None or changed:
            memory = self._memory[cand.name] = _Memory(obs.fingerprint, root=cand.path)
            self._jobs.pop(cand.name, None)
            try:
                memory.structure, memory.expected = await caller.call(
                    f"{self.key}:read:{cand.name}", _read, cand
                )
            except Unreadable as exc:
                memory.problem = str(exc)
            except (CallTimedOut, CallStillHung) as exc:
                self._memory.pop(cand.name)
                return _with(base, problem=f"not read in time ({exc})")
            memory.checksum = "none" if memory.expected is None else "unchecked"
        step = memory.structure.step if memory.structure else base.step
        if memory.problem or memory.checksum == "mismatch":
            verdict = _with(base, status="corrupt", step=step, problem=memory.problem)
            if memory.checksum == "mismatch":
                verdict = _with(verdict, checksum="mismatch")
            if not memory.reported_corrupt:
                memory.reported_corrupt = True
                outcome.new_corrupt.append(verdict)
            return verdict
        return _with(base, status="complete", step=step, checksum=memory.checksum)

    def _forget(self, present: set[str]) -> None:
        for name in [n for n in self._memory if n not in present]:
            del self._memory[name]
            self._jobs.pop(name, None)

    async def _hash(
        self,
        caller: Caller,
        pending: list[tuple[int, Observed]],
        outcome: RoundOutcome,
        budget_seconds: float,
    ) -> None:
        deadline = time.monotonic() + budget_seconds
        for index, obs in pending:
            name = obs.candidate.name
            memory = self._memory[name]
            job = self._jobs.get(name)
            if job is None:
                items = memory.expected or [
                    Expected(obs.candidate.path / rel if rel else obs.candidate.path, "")
                    for rel in self.files(name)
                ]
                job = self._jobs[name] = HashJob(
                    list(items), self.settings.hash_bytes_per_second, md5=self.settings.md5
                )
            while not job.done and time.monotonic() < deadline:
                try:
                    await caller.call(
                        f"{self.key}:hash:{name}", job.step, self.settings.hash_call_bytes
                    )
                except (CallTimedOut, CallStillHung):
                    break
            outcome.hashed_bytes += job.hashed_bytes
            outcome.hash_seconds += job.seconds
            if not job.done:
                continue
            del self._jobs[name]
            if index < 0:  # an MD5 for the off-node copy only
                memory.md5s = job.md5s if not job.changed else {}
                continue
            verdict = outcome.verdicts[index]
            if job.changed:
                memory.fingerprint = ()  # looked at again as changed next round
                outcome.verdicts[index] = _with(verdict, status="incomplete", problem=job.changed)
                continue
            memory.md5s = job.md5s
            if job.mismatches:
                memory.checksum, memory.problem = "mismatch", "; ".join(job.mismatches)
                memory.reported_corrupt = True
                verdict = _with(
                    verdict, status="corrupt", checksum="mismatch", problem=memory.problem
                )
                outcome.new_corrupt.append(verdict)
            else:
                memory.checksum = "ok"
                verdict = _with(verdict, status="complete", checksum="ok")
            memory.was_complete = verdict.status == "complete"
            outcome.verdicts[index] = verdict


def _with(verdict: Verdict, **changes: Any) -> Verdict:
    return dataclasses.replace(verdict, **changes)


def _newest_name(outcome: RoundOutcome) -> str:
    newest = outcome.newest_complete()
    return newest.name if newest else ""


def _relative(path: Path, memory: _Memory) -> str:
    if memory.root is None or path == memory.root:
        return ""
    return str(path.relative_to(memory.root))


def _same_inodes(memory: _Memory, obs: Observed) -> bool:
    before = {e[0]: e[3] for e in memory.fingerprint}
    return any(before.get(e[0]) == e[3] for e in obs.fingerprint if not e[0].startswith("../"))
