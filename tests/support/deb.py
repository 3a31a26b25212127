"""The Debian package for tests: built once per source tree, and installed on this host.

`deb_packages` (a session fixture, registered in tests/conftest.py) builds the package with
scripts/build_deb.py the way `make deb` does, once: the staged tree is cached under the
temporary directory by a hash of every file that goes into the package, so a second session,
or a second test module, packs it again in seconds instead of building a venv.
`DebPackages.path(version)` packs any version from the same tree (an upgrade needs a higher one).

Installing touches the real host (dpkg database, /opt, /etc, a system user). `host_session()`
serialises that between test sessions of several worktrees on one machine (a lock file), and
`HostPackage` installs with apt from the file and purges, leaving the host as it found it.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

# scripts/ is no package of the program; the tree's root is on the path (pytest's pythonpath),
# so the builder `make deb` runs is importable from here as a namespace package.
from scripts import build_deb as builder

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "gpuwarden"
DEB_PYTHON = "/usr/bin/python3"
LOCK = Path("/run/lock/gpuwarden-package-tests.lock")
CACHE_PREFIX = "gpuwarden-deb-"
# What goes into the package: a change to any of these is a new build.
SOURCES = ("agent", "collectors", "exporters", "systemd", "configs", "scripts/deb")
SOURCE_FILES = ("pyproject.toml", "README.md", "LICENSE", "scripts/build_deb.py")

WheelBuild = builder.WheelBuild
BuildError = builder.BuildError


def build_wheel(source: Path, work: Path) -> WheelBuild:
    """A wheel of `source` with the build backend's output (scripts/build_deb.py)."""
    return builder.build_wheel(source, work)


def source_hash() -> str:
    digest = hashlib.sha256(DEB_PYTHON.encode())
    files = [ROOT / f for f in SOURCE_FILES]
    for folder in SOURCES:
        files += [
            p for p in (ROOT / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts
        ]
    for path in sorted(files):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


@dataclasses.dataclass
class DebPackages:
    """One staged tree of this source, packed into a .deb per version asked for."""

    cache: Path
    version: str  # the package's own version (pyproject's, in Debian form)

    @property
    def next_version(self) -> str:
        """A version dpkg sorts after `version`: what an upgrade installs."""
        return f"{self.version}+1"

    def path(self, version: str | None = None) -> Path:
        version = version or self.version
        with _locked(self.cache.parent / f"{self.cache.name}.lock"):
            found = list((self.cache / "debs").glob(f"{PACKAGE}_{version}_*.deb"))
            if found:
                return found[0]
            info = json.loads((self.cache / "stage.json").read_text())
            stage = builder.Stage(
                self.cache / "root",
                info["python"],
                tuple(info["min_glibc"]) if info["min_glibc"] else None,
                info["architecture"],
            )
            out = self.cache / "debs"
            return builder.pack(stage, version, out, builder.DEFAULT_MAINTAINER)


def build_packages(cache_dir: Path | None = None) -> DebPackages:
    """The cached stage of this source, built now if there is none."""
    base = cache_dir or Path(tempfile.gettempdir())
    cache = base / f"{CACHE_PREFIX}{source_hash()}"
    version = builder.debian_version(str(builder.project()["version"]))
    with _locked(base / f"{cache.name}.lock"):
        if not (cache / "stage.json").is_file():
            _prune(base, keep=cache)
            work = Path(tempfile.mkdtemp(prefix=f"{cache.name}.", dir=base))
            try:
                wheel = builder.build_wheel(ROOT, work)
                stage = builder.stage(wheel.wheel, work / "root", DEB_PYTHON)
                # The stage must live at its cache path: it names no path of its own, so
                # moving the finished tree is safe (the builder checked that).
                shutil.rmtree(cache, ignore_errors=True)
                cache.mkdir()
                (work / "root").rename(cache / "root")
                info = {
                    "python": stage.python,
                    "min_glibc": stage.min_glibc,
                    "architecture": stage.architecture,
                }
                (cache / "stage.json").write_text(json.dumps(info))
            finally:
                shutil.rmtree(work, ignore_errors=True)
    os.utime(cache)  # in use: not pruned by another session for an hour
    return DebPackages(cache, version)


def _prune(base: Path, keep: Path) -> None:
    """Stages of older sources, untouched for an hour (another worktree's may be in use)."""
    for old in base.glob(f"{CACHE_PREFIX}*"):
        if old != keep and old.is_dir() and time.time() - old.stat().st_mtime > 3600:
            shutil.rmtree(old, ignore_errors=True)
            old.with_name(f"{old.name}.lock").unlink(missing_ok=True)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def deb_packages() -> DebPackages:
    """The Debian package of this tree (`make deb`), built once for the whole session."""
    missing = [p for p in ("dpkg-deb", DEB_PYTHON) if shutil.which(p) is None]
    if missing:
        pytest.skip(f"building the Debian package needs {', '.join(missing)}")
    try:
        return build_packages()
    except BuildError as exc:
        pytest.fail(f"the package does not build: {exc}")


# --- on this host ---------------------------------------------------------------------------


def host_skip_reason() -> str | None:
    """Why the package cannot be installed on this host by a test, or None."""
    if os.geteuid() != 0:
        return "installs a Debian package on this host: root only (CI runs as root)"
    if not shutil.which("apt-get") or not shutil.which("dpkg-deb"):
        return "needs apt-get and dpkg-deb"
    return None


@contextmanager
def host_session() -> Iterator[None]:
    """Hold the host for one test module: other sessions installing the package wait."""
    with _locked(LOCK):
        yield


def run(
    argv: list[str], check: bool = True, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, env=env, check=False
    )
    if check and done.returncode != 0:
        raise AssertionError(
            f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout}{done.stderr}"
        )
    return done


APT = ["apt-get", "-y", "-q", "-o", "DPkg::Lock::Timeout=120"]


class HostPackage:
    """The gpuwarden package on this host: install from a file, remove, purge, inspect."""

    def __init__(self) -> None:
        self.dirty = False  # changed by a test since its last install

    def status(self) -> str:
        """dpkg's state letters ("ii" installed, "rc" config files left) or "" if unknown."""
        done = run(["dpkg-query", "-W", "-f=${db:Status-Abbrev}", PACKAGE], check=False)
        return done.stdout.strip() if done.returncode == 0 else ""

    def version(self) -> str:
        return run(["dpkg-query", "-W", "-f=${Version}", PACKAGE]).stdout

    def install(self, deb: Path) -> subprocess.CompletedProcess[str]:
        # An absolute path: apt installs a file, not a package by name.
        self.dirty = False
        return run([*APT, "install", str(deb.resolve())])

    def remove(self) -> subprocess.CompletedProcess[str]:
        return run([*APT, "remove", PACKAGE])

    def purge(self) -> subprocess.CompletedProcess[str]:
        return run([*APT, "purge", PACKAGE])

    def files(self) -> list[str]:
        done = run(["dpkg", "-L", PACKAGE], check=False)
        return done.stdout.split() if done.returncode == 0 else []


# Where the package writes beyond its own files; a purge that worked removed them all.
LEFTOVERS = (Path("/opt/gpuwarden"), Path("/etc/gpuwarden"), Path("/var/lib/gpuwarden"))


@contextmanager
def host_package() -> Iterator[HostPackage]:
    """The host without gpuwarden, held for the caller, and as it was again afterwards: the
    package purged, and what a broken purge left behind removed, as is the system user the
    package made (dpkg keeps it) where the host had none."""
    reason = host_skip_reason()
    if reason:
        pytest.skip(reason)
    with host_session():
        package = HostPackage()
        found = [str(p) for p in LEFTOVERS if p.exists()]
        if package.status() or found:
            pytest.skip(f"{PACKAGE} is on this host ({package.status()} {found}): not ours")
        had_user = run(["getent", "passwd", PACKAGE], check=False).returncode == 0
        try:
            yield package
        finally:
            if package.status():
                package.purge()
            for path in LEFTOVERS:
                shutil.rmtree(path, ignore_errors=True)
            # Enable links and deb-systemd-helper's records of them, and drop-in folders
            # (the Ansible role's gpuwarden-watch.service.d).
            for top in (Path("/etc/systemd/system"), Path("/var/lib/systemd")):
                for link in top.glob("**/gpuwarden*.service*"):
                    if link.is_dir() and not link.is_symlink():
                        shutil.rmtree(link, ignore_errors=True)
                    else:
                        link.unlink(missing_ok=True)
            if not had_user and run(["getent", "passwd", PACKAGE], check=False).returncode == 0:
                run(["userdel", PACKAGE])
                run(["groupdel", PACKAGE], check=False)  # gone with the user where USERGROUPS_ENAB
