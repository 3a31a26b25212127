"""Build the Debian package: dist/gpuwarden_<version>_<arch>.deb (`make deb`).

    python scripts/build_deb.py [--out dist] [--version 0.1.0] [--python /usr/bin/python3]

The package holds the program in its own virtual environment at /opt/gpuwarden/venv, built
from a wheel of this tree with its dependencies from the configured package index (pip's own
cache makes a rebuild quick), plus the units, the sysusers and tmpfiles entries, a short
conffile, the full example configuration, the rules and the dashboards (docs/package.md lists
every path).

A virtual environment names its own path in its scripts, its pyvenv.cfg and every compiled
module, so it is built at <stage>/opt/gpuwarden/venv and each of those is pointed at the final
path: scripts and pyvenv.cfg are rewritten, modules are compiled with the stage stripped from
their file names. Nothing in the package may name the stage; the build fails if anything does.

The interpreter is the distribution's (--python, default /usr/bin/python3): the venv links to
it and its compiled dependencies are built for its minor version, so the package depends on
exactly that python3.X. torch is not included (see `[collectors.benchmark] python`).

Only the standard library: this runs before any environment exists.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import email.utils
import gzip
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import tomllib
from collections.abc import Iterable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "gpuwarden"
PREFIX = "/opt/gpuwarden"
VENV = f"{PREFIX}/venv"
# The [build-system] floor: the SPDX `license` string and `license-files` need it.
MIN_SETUPTOOLS = (77, 0)
UNITS = ("gpuwarden.service", "gpuwarden-watch.service")
CONFFILE = "/etc/gpuwarden/gpuwarden.toml"
# What the rules' runbook_url links start with until --runbook-url says where docs/runbook.md
# is published (as `make install RUNBOOK_URL=` does).
RUNBOOK_PLACEHOLDER = "https://gpuwarden.invalid/docs/runbook.md"
# A build for a fleet names its maintainer (--maintainer); lintian flags this placeholder.
DEFAULT_MAINTAINER = "gpuwarden maintainers <gpuwarden@localhost>"
# Data the package ships beside the program: (source glob under configs/, target directory).
SHARED_DATA = (
    ("prometheus/*.yml", "usr/share/gpuwarden/prometheus"),
    ("grafana/*.json", "usr/share/gpuwarden/grafana"),
    ("alertmanager/*.yml", "usr/share/gpuwarden/alertmanager"),
    ("gpuwarden.toml.example", "usr/share/gpuwarden"),
)
# The policy manylinux tags before PEP 600 named the glibc version in the tag itself.
LEGACY_MANYLINUX = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}


class BuildError(Exception):
    """A build that cannot produce a correct package; the message says what to fix."""


@dataclasses.dataclass(frozen=True)
class WheelBuild:
    wheel: Path
    log: str  # everything the build backend printed, warnings included


@dataclasses.dataclass(frozen=True)
class Stage:
    """A staged tree ready to pack, and what its control file must say about it."""

    root: Path
    python: str  # "3.11"
    min_glibc: tuple[int, int] | None
    architecture: str


def project() -> dict[str, object]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert isinstance(data, dict)
    return data


def debian_version(version: str) -> str:
    """PEP 440 -> a Debian version that sorts the same way: pre- and dev releases sort before
    the release, which in Debian takes a tilde ("1.0rc1" -> "1.0~rc1"), and a dev release of
    the release itself before its pre-releases, which takes two ("1.0.dev1" -> "1.0~~dev1")."""
    match = re.fullmatch(r"(\d+(?:\.\d+)*)((?:a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?", version)
    if not match:
        raise BuildError(
            f"pyproject.toml: project.version {version!r} is not a plain PEP 440 version"
        )
    release, pre, post, dev = match.groups()
    out = release
    if pre:
        out += f"~{pre}"
    if post:
        out += f"+{post[1:]}"
    if dev:
        out += f"{'~' if pre or post else '~~'}{dev[1:]}"
    return out


def run(argv: Sequence[str | Path], **kwargs: object) -> str:
    done = subprocess.run(
        [str(a) for a in argv],
        capture_output=True,
        text=True,
        check=False,
        **kwargs,  # type: ignore[call-overload]
    )
    if done.returncode != 0:
        raise BuildError(
            f"{' '.join(map(str, argv))} failed ({done.returncode}):\n{done.stdout}{done.stderr}"
        )
    return str(done.stdout) + str(done.stderr)


def build_wheel(source: Path, work: Path, python: str = sys.executable) -> WheelBuild:
    """A wheel of `source`, built in a copy of it (no build/ or egg-info left in the tree) by
    calling the setuptools backend directly, as pip does, with every warning shown."""
    check_setuptools(python)
    copy = work / "src"
    include = tomllib.loads((source / "pyproject.toml").read_text())["tool"]["setuptools"]
    for name in (p.rstrip("*") for p in include["packages"]["find"]["include"]):
        shutil.copytree(source / name, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(source / name, copy / name)
    out = work / "wheel"
    out.mkdir()
    hook = "import sys; from setuptools import build_meta; build_meta.build_wheel(sys.argv[1])"
    log = run([python, "-W", "always", "-c", hook, out], cwd=copy)
    wheels = list(out.glob(f"{PACKAGE}-*.whl"))
    if len(wheels) != 1:
        raise BuildError(f"expected one wheel in {out}, found {wheels}")
    return WheelBuild(wheels[0], log)


def check_setuptools(python: str) -> None:
    found = run([python, "-c", "import setuptools; print(setuptools.__version__)"]).strip()
    parts = tuple(int(p) for p in re.findall(r"\d+", found)[:2])
    if parts < MIN_SETUPTOOLS:
        raise BuildError(
            f"{python} has setuptools {found}; the build needs >= "
            f"{'.'.join(map(str, MIN_SETUPTOOLS))} (pip install 'setuptools>=77')"
        )


def stage(
    wheel: Path, root: Path, python: str, pip_args: Sequence[str] = (), runbook_url: str = ""
) -> Stage:
    """The package's file tree under `root`, the venv made to work at its final path."""
    venv = root / VENV.lstrip("/")
    # The versioned interpreter (/usr/bin/python3.11, not python3): the venv links to what it
    # was made with, and python3 may name a newer minor version after a distribution upgrade.
    python = os.path.realpath(shutil.which(python) or python)
    version = run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"]).strip()
    # Without pip: nobody is meant to pip-install into a tree dpkg owns; our pip fills it.
    run([python, "-m", "venv", "--without-pip", venv])
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            venv / "bin/python",
            "install",
            "--quiet",
            "--no-compile",
            "--no-warn-script-location",
            *pip_args,
            wheel,
        ]
    )
    relocate(venv)
    # Modules compiled now, with the stage stripped from the names tracebacks show; shipped, so
    # dpkg owns every __pycache__ and a service user who cannot write there starts quickly.
    run([python, "-m", "compileall", "-q", "-j0", "-s", root, "-p", "/", venv / "lib"])
    install_files(root, runbook_url)
    normalise_modes(root)
    # The stage and wherever the wheel was built: neither exists on the target.
    for place in (root, wheel.parent):
        leaks = list(naming(root, str(place).encode()))
        if leaks:
            raise BuildError(f"files still name the build path {place}: {leaks[:10]}")
    binary = any(venv.rglob("*.so"))  # a compiled extension: the package is per architecture
    arch = run(["dpkg", "--print-architecture"]).strip() if binary else "all"
    return Stage(root, version, min_glibc(venv), arch)


def relocate(venv: Path) -> None:
    staged, final = str(venv).encode(), VENV.encode()
    for path in [venv / "pyvenv.cfg", *(venv / "bin").iterdir()]:
        if path.is_symlink() or not path.is_file():
            continue
        data = path.read_bytes()
        if staged in data:
            path.write_bytes(data.replace(staged, final))
    # Where the wheel came from (a file in the build's scratch directory): meaningless on the
    # target, and it would name the stage. Its line in RECORD goes with it.
    for direct in venv.glob("lib/python*/site-packages/*.dist-info/direct_url.json"):
        record = direct.parent / "RECORD"
        lines = record.read_text().splitlines(keepends=True)
        record.write_text(
            "".join(x for x in lines if not x.startswith(f"{direct.parent.name}/direct_url.json,"))
        )
        direct.unlink()


def naming(root: Path, needle: bytes) -> Iterable[str]:
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            if needle in os.readlink(path).encode():
                yield str(path.relative_to(root))
        elif path.is_file() and needle in path.read_bytes():
            yield str(path.relative_to(root))


def min_glibc(venv: Path) -> tuple[int, int] | None:
    """The newest glibc any bundled wheel's platform tag asks for (libc6 (>= it))."""
    needed: list[tuple[int, int]] = []
    for wheel_file in venv.glob("lib/python*/site-packages/*.dist-info/WHEEL"):
        for tag in re.findall(r"^Tag: \S+-\S+-(\S+)$", wheel_file.read_text(), re.MULTILINE):
            for platform in tag.split("."):
                if platform.startswith("musllinux"):
                    raise BuildError(f"{wheel_file.parent.name} is built for musl, not glibc")
                pep600 = re.match(r"manylinux_(\d+)_(\d+)_", platform)
                if pep600:
                    needed.append((int(pep600[1]), int(pep600[2])))
                elif platform.split("_")[0] in LEGACY_MANYLINUX:
                    needed.append(LEGACY_MANYLINUX[platform.split("_")[0]])
    return max(needed, default=None)


def install_files(root: Path, runbook_url: str = "") -> None:
    """Everything but the venv, under `root`; the rules' runbook links at `runbook_url`."""
    check_runbook_url(runbook_url)

    def put(source: Path, target: str, mode: int = 0o644) -> None:
        path = root / target.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, path)
        path.chmod(mode)

    for unit in UNITS:
        put(ROOT / "systemd" / unit, f"/usr/lib/systemd/system/{unit}")
    put(ROOT / "systemd/gpuwarden.sysusers", "/usr/lib/sysusers.d/gpuwarden.conf")
    put(ROOT / "systemd/gpuwarden.tmpfiles", "/usr/lib/tmpfiles.d/gpuwarden.conf")
    # Not the generated example, which changes whenever a setting is added: dpkg asks about a
    # changed conffile an administrator edited, and an unattended upgrade then fails.
    put(ROOT / "scripts/deb/gpuwarden.toml", CONFFILE)
    for pattern, target in SHARED_DATA:
        for source in sorted((ROOT / "configs").glob(pattern)):
            put(source, f"{target}/{source.name}")
    put(ROOT / "scripts/deb/copyright", "/usr/share/doc/gpuwarden/copyright")
    if runbook_url:
        rules = root / "usr/share/gpuwarden/prometheus/gpuwarden-rules.yml"
        text = rules.read_text()
        rules.write_text(text.replace(f"{RUNBOOK_PLACEHOLDER}#", f"{runbook_url}#"))
    link = root / "usr/bin/gpuwarden"
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(f"{VENV}/bin/gpuwarden")


def check_runbook_url(url: str) -> None:
    """The rules append each alert's anchor (#Name) and YAML holds the link unquoted."""
    if not url:
        return
    if re.search(r"[#\s\"'\\]", url):
        raise BuildError(f"--runbook-url: no '#', quote, backslash or space, got {url!r}")
    if not re.match(r"https?://[^/]", url):
        raise BuildError(f"--runbook-url: expected an http:// or https:// URL, got {url!r}")


def normalise_modes(root: Path) -> None:
    """0755 directories, 0644 files, 0755 where any execute bit is set: the builder's umask
    (0077 for a service account) must not reach the target."""
    for path in root.rglob("*"):
        if path.is_symlink():
            continue
        if path.is_dir():
            path.chmod(0o755)
        else:
            path.chmod(0o755 if path.stat().st_mode & 0o111 else 0o644)
    root.chmod(0o755)


def pack(built: Stage, version: str, out: Path, maintainer: str) -> Path:
    """Write DEBIAN/ for `version` and build the .deb into `out`."""
    meta = project()
    control_dir = built.root / "DEBIAN"
    shutil.rmtree(control_dir, ignore_errors=True)
    control_dir.mkdir(mode=0o755)
    depends = [f"python{built.python}"]
    if built.min_glibc:
        depends.append(f"libc6 (>= {built.min_glibc[0]}.{built.min_glibc[1]})")
    depends.append("systemd")
    size_kib = sum(
        (p.lstat().st_size + 1023) // 1024
        for p in built.root.rglob("*")
        if control_dir not in p.parents
    )
    summary = str(meta["description"]).split(": ")[0]
    control = {
        "Package": PACKAGE,
        "Version": version,
        "Architecture": built.architecture,
        "Maintainer": maintainer,
        "Installed-Size": str(size_kib),
        "Depends": ", ".join(depends),
        "Suggests": "prometheus, prometheus-alertmanager",
        "Section": "admin",
        "Priority": "optional",
        "Description": f"{summary}\n" + description(str(meta["description"])),
    }
    (control_dir / "control").write_text("".join(f"{k}: {v}\n" for k, v in control.items()))
    write_changelog(built.root, version, maintainer)
    (control_dir / "conffiles").write_text(f"{CONFFILE}\n")
    (control_dir / "md5sums").write_text(md5sums(built.root, control_dir))
    for script in ("postinst", "prerm", "postrm"):
        shutil.copyfile(ROOT / "scripts/deb" / script, control_dir / script)
        (control_dir / script).chmod(0o755)
    (control_dir / "control").chmod(0o644)
    (control_dir / "conffiles").chmod(0o644)
    (control_dir / "md5sums").chmod(0o644)
    out.mkdir(parents=True, exist_ok=True)
    target = out / f"{PACKAGE}_{version}_{built.architecture}.deb"
    # gzip: several times faster than xz here, for a package of about 10 MB either way.
    run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", built.root, target])
    return target


def md5sums(root: Path, control_dir: Path) -> str:
    """What `dpkg --verify` (and debsums) compares the installed files with: a changed file
    under /opt/gpuwarden shows. Conffiles are left out, as dpkg keeps their sums itself."""
    lines = []
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root).as_posix()
        if path.is_symlink() or not path.is_file() or control_dir in path.parents:
            continue
        if f"/{relative}" == CONFFILE:
            continue
        lines.append(
            f"{hashlib.md5(path.read_bytes(), usedforsecurity=False).hexdigest()}  {relative}\n"
        )
    return "".join(lines)


def description(text: str) -> str:
    """The extended description: control-file lines (a leading space, "." for a blank line)."""
    paragraphs = [
        text,
        "The program and its Python dependencies live in their own environment under "
        f"{PREFIX}; torch (for the matmul benchmark) is not included.",
    ]
    wrapped = [textwrap.wrap(p, 78) for p in paragraphs]
    return "\n .\n".join("\n".join(f" {line}" for line in lines) for lines in wrapped)


def write_changelog(root: Path, version: str, maintainer: str) -> None:
    """A native package's changelog, as Debian policy asks: this build's entry only (the
    project's history is its git log). SOURCE_DATE_EPOCH, if set, dates it."""
    stamp = float(os.environ.get("SOURCE_DATE_EPOCH", time.time()))
    when = datetime.datetime.fromtimestamp(stamp, datetime.UTC)
    entry = (
        f"{PACKAGE} ({version}) unstable; urgency=medium\n\n"
        "  * Built from the gpuwarden source tree; its git history lists the changes.\n\n"
        f" -- {maintainer}  {email.utils.format_datetime(when)}\n"
    )
    path = root / "usr/share/doc/gpuwarden/changelog.gz"
    path.write_bytes(gzip.compress(entry.encode(), compresslevel=9, mtime=0))
    path.chmod(0o644)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "dist", help="where the .deb goes")
    parser.add_argument("--version", help="Debian version (default: pyproject's, converted)")
    parser.add_argument("--python", default="/usr/bin/python3", help="the target's interpreter")
    parser.add_argument("--work", type=Path, help="scratch directory (default: a temporary one)")
    parser.add_argument("--maintainer", default=DEFAULT_MAINTAINER, help="the Maintainer field")
    parser.add_argument("--pip-arg", action="append", default=[], help="passed to pip install")
    parser.add_argument(
        "--runbook-url", default="", help="where docs/runbook.md is published (http or https)"
    )
    args = parser.parse_args(argv)
    version = args.version or debian_version(str(project()["version"]))
    with tempfile.TemporaryDirectory(prefix="gpuwarden-deb-") as scratch:
        work = args.work or Path(scratch)
        try:
            check_runbook_url(args.runbook_url)  # before the minutes a build takes
            if not args.runbook_url:
                print(
                    f"build_deb: the rules' runbook links point at {RUNBOOK_PLACEHOLDER}"
                    " (set --runbook-url)",
                    file=sys.stderr,
                )
            wheel = build_wheel(ROOT, work)
            built = stage(wheel.wheel, work / "root", args.python, args.pip_arg, args.runbook_url)
            target = pack(built, version, args.out, args.maintainer)
        except BuildError as exc:
            print(f"build_deb: {exc}", file=sys.stderr)
            return 1
    print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
