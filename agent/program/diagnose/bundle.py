"""A redacted tar.gz bundle, written atomically.

Every member goes through the `Redactor` as it is added; nothing unredacted is held for the
archive. The manifest lists each member with its size and SHA-256 (of the redacted bytes that
are in the archive), and a redaction report counts what was removed, by kind, never the values.

Atomic: the archive is written to a temp file in the target's directory that has no name
(O_TMPFILE), fsynced, given a name, renamed over the final name, and the directory fsynced.
On any error the temp file is removed, and a kill -9 leaves none, so the final name either
holds a complete bundle or what it held before.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import secrets
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from agent.program.diagnose.redact import RedactionReport, Redactor

MANIFEST = "manifest.json"
REDACTION_REPORT = "redaction.json"
BINARY_SNIFF_BYTES = 8192


@dataclass
class Bundle:
    redactor: Redactor
    members: dict[str, bytes] = field(default_factory=dict)
    report: RedactionReport = field(default_factory=RedactionReport)
    notes: list[str] = field(default_factory=list)
    """What could not be collected, and why: the reader of the bundle needs to know."""

    def _unique(self, name: str) -> str:
        candidate, n = name, 1
        while candidate in self.members:
            n += 1
            stem, dot, ext = name.rpartition(".")
            candidate = f"{stem}-{n}.{ext}" if dot and "/" not in ext else f"{name}-{n}"
        return candidate

    def add_text(self, name: str, text: str) -> str:
        name = self._unique(self.redactor.redact_text(name))
        redacted, counts = self.redactor.redact(text)
        self.report.add(name, counts)
        self.members[name] = redacted.encode("utf-8")
        return name

    def add_json(self, name: str, data: Any) -> str:
        return self.add_text(name, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")

    def add_file(self, name: str, path: Path, limit_bytes: int) -> str | None:
        """A user's file: text only (a binary cannot be redacted, so it is left out), and at
        most its last `limit_bytes` (the end of a training log is where the failure is)."""
        try:
            size = path.stat().st_size
            with path.open("rb") as handle:
                if size > limit_bytes:
                    handle.seek(size - limit_bytes)
                data = handle.read(limit_bytes)
        except OSError as exc:
            self.skip(name, f"cannot read {path}: {exc.strerror}")
            return None
        if b"\0" in data[:BINARY_SNIFF_BYTES]:
            self.skip(name, "binary file: left out because it cannot be redacted")
            return None
        text = data.decode("utf-8", errors="replace")
        if size > limit_bytes:
            text = text.split("\n", 1)[-1]  # drop the partial first line
            self.notes.append(f"{name}: only the last {limit_bytes} of {size} bytes included")
        return self.add_text(name, text)

    def skip(self, name: str, reason: str) -> None:
        self.report.skipped_files[self.redactor.redact_text(name)] = self.redactor.redact_text(
            reason
        )

    def manifest(self, header: dict[str, Any]) -> dict[str, Any]:
        files = [
            {"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            for name, data in sorted(self.members.items())
        ]
        return {
            **header,
            "files": files,
            "notes": list(self.notes),
            "redaction": {
                "total": sum(self.report.by_kind.values()),
                "by_kind": dict(sorted(self.report.by_kind.items())),
            },
        }

    def finish(self, header: dict[str, Any]) -> None:
        """Add the redaction report and the manifest (the manifest lists every other member)."""
        self.add_json(REDACTION_REPORT, self.report.to_dict())
        # Member names were redacted as they were added; the header (node id, command line)
        # goes through the redactor here like everything else.
        text = json.dumps(self.manifest(header), indent=2) + "\n"
        self.members[MANIFEST] = self.redactor.redact_text(text).encode()

    def write_tar(self, handle: IO[bytes], top: str, mtime: float) -> None:
        with tarfile.open(fileobj=handle, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
            for name in [MANIFEST, *sorted(n for n in self.members if n != MANIFEST)]:
                data = self.members[name]
                info = tarfile.TarInfo(f"{top}/{name}")
                info.size = len(data)
                info.mtime = int(mtime)
                info.mode = 0o600
                tar.addfile(info, io.BytesIO(data))


_NO_UNNAMED_FILES = (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL)
"""open(2) with O_TMPFILE: EOPNOTSUPP where the file system lacks it (NFS, most FUSE file
systems); EISDIR or EINVAL from a kernel or file system that does not know the flag."""


def write_atomically(final: Path, write: Callable[[IO[bytes]], None]) -> None:
    """`write` fills a temp file beside `final`; then fsync, rename, fsync the directory.

    The temp file has no name while `write` fills it (O_TMPFILE): a kill -9 then leaves
    nothing behind, and the kernel frees its blocks with the process. It gets a name only
    once whole and synced, for the rename over `final`. Where the file system refuses
    unnamed files, the temp file is named from the start, with the writer's pid in the
    name, and the next bundle written to the same name sweeps up those of dead writers.
    """
    directory = final.parent
    _sweep_dead_writers(directory, final.name)
    fd = _open_unnamed(directory)
    temp_name: str | None = None
    if fd is None:
        fd, temp_name = tempfile.mkstemp(
            prefix=_temp_prefix(final.name, os.getpid()), suffix=_TEMP_SUFFIX, dir=directory
        )
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
            if temp_name is None:
                temp_name = _give_name(handle.fileno(), directory, final.name)
        os.replace(temp_name, final)
    except BaseException:
        if temp_name is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp_name)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


_TEMP_SUFFIX = ".partial"


def _temp_prefix(final_name: str, pid: int) -> str:
    return f".{final_name}.{pid}."


def _open_unnamed(directory: Path) -> int | None:
    try:
        return os.open(directory, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno not in _NO_UNNAMED_FILES:
            raise
        return None


def _give_name(fd: int, directory: Path, final_name: str) -> str:
    """Link the unnamed file at `fd` into `directory` under a new temp name: linkat(2) of
    /proc/self/fd/N with AT_SYMLINK_FOLLOW, which needs no privilege (os.link calls plain
    link(2), which does not follow that link, unless given a directory descriptor)."""
    prefix = _temp_prefix(final_name, os.getpid())
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        while True:
            name = f"{prefix}{secrets.token_hex(4)}{_TEMP_SUFFIX}"
            try:
                os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=dir_fd, follow_symlinks=True)
            except FileExistsError:
                continue
            return str(directory / name)
    finally:
        os.close(dir_fd)


def _sweep_dead_writers(directory: Path, final_name: str) -> None:
    """Remove the named temp files of writers to `final_name` that no longer run."""
    start = f".{final_name}."
    try:
        names = os.listdir(directory)
    except OSError:
        return  # the write itself says what is wrong with the directory
    for name in names:
        if not (name.startswith(start) and name.endswith(_TEMP_SUFFIX)):
            continue
        pid_text = name[len(start) :].split(".", 1)[0]
        if not pid_text.isdigit() or _alive(int(pid_text)):
            continue  # an older version's name (no pid), or a writer at work
        with contextlib.suppress(OSError):
            os.unlink(directory / name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def utc_stamp(now: float) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
