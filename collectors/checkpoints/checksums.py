"""Sidecar checksums and hashing that leaves the training job its I/O.

A file checkpoint `X` may have `X.sha256`; a directory `D` may have `D.sha256` beside it or a
`SHA256SUMS` / `checksums.sha256` manifest inside. All are `sha256sum` output (`<hex>  <name>`
lines; a file's sidecar may be the bare hex). A `HashJob` hashes in steps: each step is one
blocking call that reads at most a byte budget at most at a byte rate (it sleeps to keep under
it), and the job keeps its hash state between steps, so a 100 GiB checkpoint is hashed over
several rounds without a call outliving its timeout. A file that changes under it (size,
mtime or inode) ends the job: the checkpoint is not stable, and will be looked at again.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from collectors.checkpoints.detect import MANIFEST_NAMES, SIDECAR_SUFFIX, Candidate
from collectors.checkpoints.formats import Unreadable

CHUNK_BYTES = 1024 * 1024
_LINE = re.compile(r"^([0-9a-fA-F]{64})(?:\s+\*?(.+))?$")


@dataclass(frozen=True, slots=True)
class Expected:
    path: Path
    sha256: str


def sidecar_of(candidate: Candidate) -> Path | None:
    beside = Path(f"{candidate.path}{SIDECAR_SUFFIX}")
    if beside.is_file():
        return beside
    if candidate.kind in ("safetensors", "torch"):
        return None
    return next(
        (candidate.path / n for n in MANIFEST_NAMES if (candidate.path / n).is_file()), None
    )


def read_sidecar(candidate: Candidate) -> list[Expected] | None:
    """Blocking: what the checkpoint's sidecar says its files hash to; None without one.
    Raises Unreadable when the sidecar is malformed or names a file that is not there."""
    sidecar = sidecar_of(candidate)
    if sidecar is None:
        return None
    base = candidate.path if candidate.path.is_dir() else candidate.path.parent
    out: list[Expected] = []
    try:
        text = sidecar.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise Unreadable(f"{sidecar}: cannot be read ({exc})") from None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        match = _LINE.match(line.strip())
        if not match:
            raise Unreadable(
                f"{sidecar}:{number}: expected '<64 hex digits>  <file name>' (sha256sum output)"
            )
        digest, name = match.group(1).lower(), match.group(2)
        if candidate.path.is_file():
            out.append(Expected(candidate.path, digest))
        elif name is None:
            raise Unreadable(f"{sidecar}:{number}: a directory's manifest must name each file")
        else:
            target = base / name
            if not target.is_file():
                raise Unreadable(f"{sidecar}:{number}: names {name}, which is not in {base}")
            out.append(Expected(target, digest))
    if not out:
        raise Unreadable(f"{sidecar}: empty")
    return out


def _identity(path: Path) -> tuple[int, int, int]:
    st = os.stat(path)
    return (st.st_size, st.st_mtime_ns, st.st_ino)


@dataclass
class HashJob:
    """Hashes each expected file in turn; `step` is the blocking part (one ctx.call)."""

    items: list[Expected]
    bytes_per_second: float
    md5: bool = False
    """Also an MD5 of each file: what a single-part S3 upload's ETag is."""
    index: int = 0
    offset: int = 0
    hashed_bytes: int = 0
    seconds: float = 0.0
    mismatches: list[str] = field(default_factory=list)
    md5s: dict[Path, str] = field(default_factory=dict)
    changed: str = ""
    """Non-empty when a file changed under the job: the job is over, with no verdict."""
    _sha: hashlib._Hash | None = None
    _md5: hashlib._Hash | None = None
    _identity: tuple[int, int, int] | None = None

    @property
    def done(self) -> bool:
        return bool(self.changed) or self.index >= len(self.items)

    def step(
        self,
        budget_bytes: int,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> bool:
        """Hash up to `budget_bytes` at most at `bytes_per_second`; True when the job is done."""
        started = clock()
        read = 0
        while not self.done and read < budget_bytes:
            read += self._advance(budget_bytes - read)
            # Sleep off what runs ahead of the rate: the job's reads average to the limit.
            ahead = read / self.bytes_per_second - (clock() - started)
            if ahead > 0:
                sleep(ahead)
        self.seconds += clock() - started
        return self.done

    def _advance(self, budget: int) -> int:
        item = self.items[self.index]
        try:
            identity = _identity(item.path)
        except FileNotFoundError:
            self.changed = f"{item.path} vanished while it was hashed"
            return 0
        if self._sha is None:
            self._sha, self._identity, self.offset = hashlib.sha256(), identity, 0
            self._md5 = hashlib.md5(usedforsecurity=False) if self.md5 else None
        elif identity != self._identity:
            self.changed = f"{item.path} changed while it was hashed"
            return 0
        read = 0
        with open(item.path, "rb") as handle:
            handle.seek(self.offset)
            while read < budget:
                chunk = handle.read(min(CHUNK_BYTES, budget - read))
                if not chunk:
                    self._finish(item)
                    break
                self._sha.update(chunk)
                if self._md5 is not None:
                    self._md5.update(chunk)
                read += len(chunk)
                self.offset += len(chunk)
        self.hashed_bytes += read
        return read

    def _finish(self, item: Expected) -> None:
        assert self._sha is not None
        if self._sha.hexdigest() != item.sha256:
            self.mismatches.append(
                f"{item.path}: sha256 {self._sha.hexdigest()[:16]}…, the sidecar says "
                f"{item.sha256[:16]}…"
            )
        if self._md5 is not None:
            self.md5s[item.path] = self._md5.hexdigest()
        self._sha = self._md5 = None
        self.index += 1
