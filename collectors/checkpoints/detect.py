"""What in a location is a checkpoint, what it looks like now, and whether its structure reads.

A location is one directory; its entries (one level down) are the candidates: a Hugging Face
`checkpoint-<step>/` directory, a DeepSpeed `global_step<step>/` directory, a directory holding
a torch.distributed checkpoint (`.metadata`), or a `*.safetensors` / `*.pt` / `*.pth` / `*.bin`
file. A name that matches a temporary pattern (an upload or save in progress) is a candidate
that is never complete. Sidecar checksum files (`X.sha256`) belong to their checkpoint.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.contracts.json_text import parse_json
from collectors.checkpoints.formats import (
    Structure,
    Unreadable,
    read_dcp_dir,
    read_safetensors,
    read_torch_zip,
)

FILE_KINDS = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".bin": "torch"}
WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")
DEFAULT_TEMP_PATTERNS = (
    ".*",
    "*.tmp",
    "*.tmp.*",
    "tmp*",
    "*.part",
    "*.partial",
    "*.incomplete",
    "*.uploading",
    "*~",
)
"""Names writers use before the final rename: HF's Trainer saves into `tmp-checkpoint-<step>`,
torch and most tools write `.name.XXXX` or `name.tmp` and rename when done."""
SIDECAR_SUFFIX = ".sha256"
MANIFEST_NAMES = ("SHA256SUMS", "checksums.sha256")
_TEMP_SUFFIX = re.compile(r"(\.(tmp|part|partial|incomplete|uploading)(\..*)?|~)$")
_HF = re.compile(r"checkpoint-(\d+)$")
_DEEPSPEED = re.compile(r"global_step(\d+)$")
_STEP_IN_NAME = re.compile(r"(?:global_step|step|iter|checkpoint|ckpt)[-_=]?(\d+)", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Candidate:
    path: Path
    kind: str
    """hf, deepspeed, dcp, safetensors, torch"""
    temporary: bool

    @property
    def name(self) -> str:
        return self.path.name


@dataclass(frozen=True, slots=True)
class Observed:
    """A candidate as it looks now: equal fingerprints mean it has not changed."""

    candidate: Candidate
    fingerprint: tuple[tuple[str, int, int, int], ...]
    """(relative path, size, mtime_ns, inode) of every file, sorted."""
    size_bytes: int
    mtime: float
    """The newest file's modification time (seconds since the epoch)."""

    @property
    def inodes(self) -> frozenset[int]:
        return frozenset(entry[3] for entry in self.fingerprint)


def is_temporary(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def _real_name(name: str) -> str:
    """The name a temporary one will be renamed to, as far as it shows: `.model.pt.x1y2` and
    `model.pt.tmp` are both on their way to `model.pt`."""
    stripped = name.lstrip(".")
    for word in ("tmp-", "tmp_", "tmp"):
        stripped = stripped.removeprefix(word)
    for suffix in WEIGHT_SUFFIXES:
        at = stripped.find(suffix)
        if at > 0:
            return stripped[: at + len(suffix)]
    return _TEMP_SUFFIX.sub("", stripped)


def classify(path: Path, temp_patterns: Sequence[str]) -> Candidate | None:
    """The candidate `path` is, or None for anything else (a sidecar, a log, `latest`)."""
    name = path.name
    temporary = is_temporary(name, temp_patterns)
    real = _real_name(name) if temporary else name
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISDIR(mode):
        if _HF.search(real):
            return Candidate(path, "hf", temporary)
        if _DEEPSPEED.search(real):
            return Candidate(path, "deepspeed", temporary)
        if (path / ".metadata").exists() or any(p.name.endswith(".distcp") for p in _scandir(path)):
            return Candidate(path, "dcp", temporary)
        return None
    if not stat.S_ISREG(mode) or name.endswith(SIDECAR_SUFFIX):
        return None
    kind = next((k for suffix, k in FILE_KINDS.items() if real.endswith(suffix)), None)
    return Candidate(path, kind, temporary) if kind else None


def _scandir(path: Path) -> list[Path]:
    try:
        return [Path(entry.path) for entry in os.scandir(path)]
    except (FileNotFoundError, NotADirectoryError):
        return []


def observe(candidate: Candidate) -> Observed | None:
    """Stat every file of the candidate; None when it went away meanwhile (rotation)."""
    root = candidate.path
    entries: list[tuple[str, int, int, int]] = []
    try:
        if candidate.kind in ("safetensors", "torch"):
            st = root.stat()
            entries.append(("", st.st_size, st.st_mtime_ns, st.st_ino))
        else:
            for folder, _, files in os.walk(root):
                for name in files:
                    full = os.path.join(folder, name)
                    st = os.stat(full)
                    entries.append(
                        (os.path.relpath(full, root), st.st_size, st.st_mtime_ns, st.st_ino)
                    )
        sidecar = Path(f"{root}{SIDECAR_SUFFIX}")
        if sidecar.is_file():  # a sidecar written later changes the verdict: part of the look
            st = sidecar.stat()
            entries.append((f"../{sidecar.name}", st.st_size, st.st_mtime_ns, st.st_ino))
    except FileNotFoundError:
        return None
    entries.sort()
    mtime_ns = max((e[2] for e in entries), default=0)
    return Observed(
        candidate,
        tuple(entries),
        sum(e[1] for e in entries if not e[0].startswith("../")),
        mtime_ns / 1e9,
    )


def scan_location(
    directory: Path, pattern: str, temp_patterns: Sequence[str], limit: int
) -> list[Observed]:
    """Blocking: every candidate in `directory` (at most `limit`, newest names first)."""
    names = sorted(
        (e.name for e in os.scandir(directory) if fnmatch.fnmatchcase(e.name, pattern)),
        reverse=True,
    )
    out: list[Observed] = []
    for name in names:
        candidate = classify(directory / name, temp_patterns)
        if candidate is None:
            continue
        seen = observe(candidate)
        if seen is not None:
            out.append(seen)
        if len(out) >= limit:
            break
    return out


def step_of(candidate: Candidate) -> int | None:
    """The step the name gives (`checkpoint-500`, `global_step500`, `model_step500.pt`)."""
    name = _real_name(candidate.name) if candidate.temporary else candidate.name
    for pattern in (_HF, _DEEPSPEED, _STEP_IN_NAME):
        match = pattern.search(name)
        if match:
            return int(match.group(1))
    return None


# -- structure --------------------------------------------------------------------------------


def verify_structure(candidate: Candidate) -> Structure:
    """Blocking: read the structure of every part of the checkpoint. Raises Unreadable."""
    try:
        if candidate.kind == "safetensors":
            found = read_safetensors(candidate.path)
        elif candidate.kind == "torch":
            found = read_torch_zip(candidate.path)
        elif candidate.kind == "dcp":
            found = read_dcp_dir(candidate.path)
        else:
            found = _read_directory(candidate.path)
    except FileNotFoundError as exc:
        raise Unreadable(f"{exc.filename}: vanished while it was read") from None
    except OSError as exc:
        raise Unreadable(f"{exc.filename or candidate.path}: {exc.strerror}") from None
    step = _trainer_state_step(candidate.path) if candidate.kind == "hf" else None
    return Structure(
        found.files, found.size_bytes, step if step is not None else step_of(candidate), found.notes
    )


def _read_directory(directory: Path) -> Structure:
    """An HF or DeepSpeed directory: each weight file, each distributed checkpoint below it,
    each index file's named shards. At least one weight file must be there."""
    files: list[Path] = []
    size = 0
    weights = 0
    for folder, subdirs, names in os.walk(directory):
        here = Path(folder)
        if ".metadata" in names:
            part = read_dcp_dir(here)
            files += part.files
            size += part.size_bytes
            weights += 1
            subdirs.clear()
            continue
        for name in sorted(names):
            path = here / name
            kind = FILE_KINDS.get(path.suffix)
            if kind == "safetensors":
                part = read_safetensors(path)
            elif kind == "torch":
                part = read_torch_zip(path)
            else:
                if name.endswith(".index.json"):
                    _check_index(path)
                elif name == "trainer_state.json":
                    _load_json(path)
                files.append(path)
                size += path.stat().st_size
                continue
            weights += 1
            files += part.files
            size += part.size_bytes
    if not weights:
        raise Unreadable(f"{directory}: no weight file (safetensors, .pt, .bin) or .metadata")
    return Structure(tuple(files), size, notes=(f"{weights} weight files",))


def _load_json(path: Path) -> object:
    try:
        return parse_json(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise Unreadable(f"{path}: not valid JSON ({exc})") from None


def _check_index(path: Path) -> None:
    data = _load_json(path)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise Unreadable(f"{path}: no weight_map")
    for shard in sorted({str(v) for v in weight_map.values()}):
        if not (path.parent / shard).is_file():
            raise Unreadable(f"{path}: shard {shard} is named but missing")


def _trainer_state_step(directory: Path) -> int | None:
    state = directory / "trainer_state.json"
    if not state.is_file():
        return None
    data = _load_json(state)
    step = data.get("global_step") if isinstance(data, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None
