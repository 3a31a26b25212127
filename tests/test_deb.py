"""The Debian package (`make deb`, scripts/build_deb.py; docs/package.md).

TestPackage reads the built .deb. TestOnHost installs it on this machine for real, with apt from
the file: runs the installed program, verifies the installed units, upgrades over itself with an
edited configuration, removes and purges. Those are marked `host`, need root (CI is root),
hold a lock against other sessions doing the same, and purge in teardown.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.program import config_file
from tests.support.deb import (
    CACHE_PREFIX,
    PACKAGE,
    DebPackages,
    HostPackage,
    host_package,
)

ROOT = Path(__file__).resolve().parents[1]
VENV = Path("/opt/gpuwarden/venv")
CONFFILE = Path("/etc/gpuwarden/gpuwarden.toml")
STATE_DIR = Path("/var/lib/gpuwarden")
UNITS = sorted(p.name for p in (ROOT / "systemd").glob("*.service"))
WANTS = Path("/etc/systemd/system/multi-user.target.wants")


def field(deb: Path, name: str) -> str:
    return subprocess.run(
        ["dpkg-deb", "--field", str(deb), name], capture_output=True, text=True, check=True
    ).stdout.strip()


def _member(deb: Path, name: str) -> str:
    """A file of the control archive (conffiles, postinst, ...)."""
    tar = subprocess.run(["dpkg-deb", "--ctrl-tarfile", str(deb)], capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as archive:
        member = archive.extractfile(f"./{name}")
        assert member is not None, name
        return member.read().decode()


def contents(deb: Path) -> dict[str, tarfile.TarInfo]:
    """Every entry of the data archive by its absolute path."""
    tar = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as archive:
        return {"/" + m.name.removeprefix("./").rstrip("/"): m for m in archive.getmembers()}


@pytest.fixture(scope="module")
def deb(deb_packages: DebPackages) -> Path:
    return deb_packages.path()


@pytest.fixture(scope="module")
def listing(deb: Path) -> dict[str, tarfile.TarInfo]:
    return contents(deb)


@pytest.fixture(scope="module")
def extracted(deb: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("extracted")
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    return root


class TestPackage:
    def test_file_name_version_and_architecture(self, deb: Path, deb_packages: DebPackages) -> None:
        arch = subprocess.run(
            ["dpkg", "--print-architecture"], capture_output=True, text=True, check=True
        ).stdout.strip()
        # psutil, bcrypt and PyYAML are compiled: the package is per architecture.
        assert deb.name == f"{PACKAGE}_{deb_packages.version}_{arch}.deb"
        assert field(deb, "Package") == PACKAGE
        assert field(deb, "Version") == deb_packages.version
        assert field(deb, "Architecture") == arch

    def test_depends_on_the_interpreter_the_venv_links_to(
        self, deb: Path, listing: dict[str, tarfile.TarInfo]
    ) -> None:
        link = listing[f"{VENV}/bin/python3"]
        target = link.linkname if link.issym() else ""
        while not target.startswith("/"):  # python3 -> python3.11 -> /usr/bin/python3.11
            target = listing[f"{VENV}/bin/{target}"].linkname
        match = re.fullmatch(r"/usr/bin/python(3\.\d+)", target)
        assert match, target
        depends = [d.strip() for d in field(deb, "Depends").split(",")]
        assert f"python{match[1]}" in depends
        # Its site-packages is that version's, and nothing else is.
        sites = {p.split("/")[5] for p in listing if p.startswith(f"{VENV}/lib/python")}
        assert sites == {f"python{match[1]}"}
        assert any(re.fullmatch(r"libc6 \(>= 2\.\d+\)", d) for d in depends), depends
        assert "torch" not in field(deb, "Depends")

    def test_layout(self, listing: dict[str, tarfile.TarInfo]) -> None:
        assert listing[f"{VENV}/bin/gpuwarden"].isfile()
        assert listing["/usr/bin/gpuwarden"].linkname == f"{VENV}/bin/gpuwarden"
        for unit in UNITS:
            assert f"/usr/lib/systemd/system/{unit}" in listing, unit
        assert "/usr/lib/sysusers.d/gpuwarden.conf" in listing
        assert "/usr/lib/tmpfiles.d/gpuwarden.conf" in listing
        assert str(CONFFILE) in listing
        assert "/usr/share/doc/gpuwarden/copyright" in listing
        # Every rule file, dashboard and Alertmanager example the tree ships.
        for pattern in ("prometheus/*.yml", "grafana/*.json", "alertmanager/*.yml"):
            for source in (ROOT / "configs").glob(pattern):
                assert f"/usr/share/gpuwarden/{pattern.split('/')[0]}/{source.name}" in listing
        # /etc/systemd/system is the administrator's; torch is not ours to ship.
        assert not [p for p in listing if p.startswith("/etc/systemd")]
        assert not [p for p in listing if "/site-packages/torch" in p]

    def test_shipped_files_are_the_trees(self, extracted: Path) -> None:
        pairs = {
            "systemd/gpuwarden.sysusers": "usr/lib/sysusers.d/gpuwarden.conf",
            "systemd/gpuwarden.tmpfiles": "usr/lib/tmpfiles.d/gpuwarden.conf",
            "scripts/deb/gpuwarden.toml": "etc/gpuwarden/gpuwarden.toml",
            "configs/gpuwarden.toml.example": "usr/share/gpuwarden/gpuwarden.toml.example",
            **{f"systemd/{u}": f"usr/lib/systemd/system/{u}" for u in UNITS},
        }
        for source, target in pairs.items():
            assert (extracted / target).read_bytes() == (ROOT / source).read_bytes(), target

    def test_the_example_config_is_the_only_conffile(self, deb: Path) -> None:
        assert _member(deb, "conffiles").split() == [str(CONFFILE)]

    def test_the_conffile_does_not_follow_the_settings(
        self, extracted: Path, listing: dict[str, tarfile.TarInfo]
    ) -> None:
        # A conffile that changes with each new setting makes dpkg stop an unattended upgrade
        # of every host whose administrator edited it ("end of file on stdin at conffile
        # prompt"): it sets no key, and points at the full example instead.
        text = (extracted / str(CONFFILE).lstrip("/")).read_text()
        assert [line for line in text.splitlines() if line and not line.startswith("#")] == []
        assert "/usr/share/gpuwarden/gpuwarden.toml.example" in text
        assert "/usr/share/gpuwarden/gpuwarden.toml.example" in listing
        # Its commented example, uncommented, is a configuration the program accepts.
        keys = [line[1:] for line in text.splitlines() if re.match(r"#(\[|\w+ = )", line)]
        assert len(keys) >= 3
        parsed = config_file.parse(tomllib.loads("\n".join(keys)))
        assert parsed.sections != config_file.parse({}).sections

    def test_md5sums_cover_every_file_but_the_conffile(
        self, deb: Path, listing: dict[str, tarfile.TarInfo]
    ) -> None:
        sums = {}
        for line in _member(deb, "md5sums").splitlines():
            digest, name = line.split("  ", 1)
            sums[name] = digest
        files = {p.lstrip("/") for p, e in listing.items() if e.isfile()}
        assert set(sums) == files - {str(CONFFILE).lstrip("/")}

    def test_maintainer_scripts_are_the_trees(self, deb: Path) -> None:
        for script in ("postinst", "prerm", "postrm"):
            assert _member(deb, script) == (ROOT / "scripts/deb" / script).read_text(), script

    def test_units_name_a_program_the_package_holds(
        self, extracted: Path, listing: dict[str, tarfile.TarInfo]
    ) -> None:
        for unit in UNITS:
            text = (extracted / "usr/lib/systemd/system" / unit).read_text()
            for command in re.findall(r"^Exec\w+=[-@:+!]*(\S+)", text, re.MULTILINE):
                assert command in listing or Path(command).is_file(), (unit, command)

    def test_owned_by_root_and_readable_by_all(self, listing: dict[str, tarfile.TarInfo]) -> None:
        for path, entry in listing.items():
            assert (entry.uname, entry.gname) == ("root", "root"), path
            if entry.issym():
                continue
            mode = entry.mode
            assert mode & 0o022 == 0, f"{path} is writable by others: {oct(mode)}"
            assert mode & 0o444 == 0o444, f"{path} is not readable by all: {oct(mode)}"
            if entry.isdir():
                assert mode & 0o777 == 0o755, path

    def test_nothing_names_where_it_was_built(self, extracted: Path) -> None:
        # The stage, the cache and the source tree: the venv must work at /opt only.
        needles = [CACHE_PREFIX.encode(), str(ROOT).encode(), b"/tmp/pytest-"]
        named = []
        for path in extracted.rglob("*"):
            data = os.readlink(path).encode() if path.is_symlink() else b""
            if path.is_file() and not path.is_symlink():
                data = path.read_bytes()
            named += [f"{path.relative_to(extracted)}: {n.decode()}" for n in needles if n in data]
        assert named == []

    def test_modules_compiled_for_their_final_path(self, extracted: Path) -> None:
        site = next((extracted / VENV.relative_to("/") / "lib").glob("python3.*/site-packages"))
        cli = site / "agent/program/cli.py"
        compiled = list((cli.parent / "__pycache__").glob("cli.*.pyc"))
        assert compiled, "no compiled module shipped"
        final = "/" + str(cli.relative_to(extracted))
        assert final.encode() in compiled[0].read_bytes()


# lintian's tags that this package carries by design, each with the reason (docs/package.md).
LINTIAN_BY_DESIGN = {
    # The program is a local add-on, not part of the distribution: /opt is where FHS puts it.
    "dir-or-file-in-opt": "the venv lives in /opt/gpuwarden",
    # Compiled for /opt at build time and owned by dpkg, so purge leaves none behind.
    "package-installs-python-pycache-dir": "compiled modules are shipped",
    # The dependencies are their published wheels, byte for byte (RECORD holds their hashes).
    "embedded-library": "PyYAML's wheel carries libyaml",
    "unstripped-binary-or-object": "extension modules as their wheels ship them",
    "script-not-executable": "a dependency's module with a shebang line",
    "unusual-interpreter": "the venv's python, and dependencies' modules with shebangs",
    "no-manual-page": "gpuwarden --help and docs/ are its manual",
    # The builder's default Maintainer; a real build passes --maintainer.
    "bogus-mail-host": "default Maintainer",
    "bogus-mail-host-in-debian-changelog": "default Maintainer",
}


@pytest.mark.skipif(shutil.which("lintian") is None, reason="lintian is not installed")
def test_lintian_finds_nothing_new(deb: Path) -> None:
    done = subprocess.run(
        ["lintian", "--tag-display-limit", "0", str(deb)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    tags = re.findall(r"^[EWIPX]: gpuwarden(?: \w+)?: (\S+)(.*)$", done.stdout, re.MULTILINE)
    unexpected = [f"{tag}{rest}" for tag, rest in tags if tag not in LINTIAN_BY_DESIGN]
    assert unexpected == [], "\n".join(unexpected)
    # Third-party findings only inside the venv: nothing of ours is excused by them.
    for tag, rest in tags:
        if tag in ("embedded-library", "unstripped-binary-or-object", "script-not-executable"):
            assert "opt/gpuwarden/venv/lib/" in rest, (tag, rest)


# --- on this host -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def host() -> Iterator[HostPackage]:
    with host_package() as package:
        yield package


@pytest.fixture
def installed(host: HostPackage, deb_packages: DebPackages) -> HostPackage:
    """The package's own version installed and untouched: reused while the tests that only
    read it run (they come first), installed afresh after one that changed it."""
    if host.status() == "ii" and host.version() == deb_packages.version and not host.dirty:
        return host
    if host.status():
        host.purge()
    host.install(deb_packages.path())
    assert host.status() == "ii"
    return host


@pytest.fixture
def changed(installed: HostPackage) -> HostPackage:
    """An installation the test changes: the next one starts afresh."""
    installed.dirty = True
    return installed


def installed_run(*argv: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    # Nothing of the tests' own environment: the program must stand on its own venv.
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(tmp_path)}
    return subprocess.run(
        list(argv), capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120, check=False
    )


def unowned_under(top: Path, host: HostPackage) -> list[str]:
    owned = set(host.files())
    return sorted(str(p) for p in top.rglob("*") if str(p) not in owned)


@pytest.mark.host
class TestOnHost:
    def test_install_makes_user_state_dir_and_secrets(self, installed: HostPackage) -> None:
        user = subprocess.run(
            ["getent", "passwd", PACKAGE], capture_output=True, text=True, check=True
        )
        fields = user.stdout.strip().split(":")
        assert int(fields[2]) < 1000, fields  # a system user
        info = STATE_DIR.stat()
        assert stat.S_IMODE(info.st_mode) == 0o700
        assert info.st_uid == int(fields[2])
        for secret in ("mqtt-password", "watch-mqtt-password"):
            mode = (CONFFILE.parent / secret).stat()
            assert (stat.S_IMODE(mode.st_mode), mode.st_uid) == (0o600, 0), secret
        # Enabled, not started: the agent on every GPU host, the watcher nowhere by default.
        assert (WANTS / "gpuwarden.service").is_symlink()
        assert not (WANTS / "gpuwarden-watch.service").exists()

    def test_check_runs_from_the_installed_path(
        self, installed: HostPackage, tmp_path: Path
    ) -> None:
        done = installed_run("/usr/bin/gpuwarden", "check", "--expect-gpus", "0", tmp_path=tmp_path)
        # 0 or 1 (a warning on this VM is fair); 2 would be a failure, a traceback worse.
        assert done.returncode in (0, 1), done.stdout + done.stderr
        assert "Traceback" not in done.stderr
        assert "/var/lib/gpuwarden" in done.stdout

    def test_check_json_from_the_installed_path(
        self, installed: HostPackage, tmp_path: Path
    ) -> None:
        done = installed_run(
            "/usr/bin/gpuwarden", "check", "--json", "--expect-gpus", "0", tmp_path=tmp_path
        )
        report = json.loads(done.stdout)
        assert report["exit_code"] == done.returncode
        torch = next(f for f in report["findings"] if f["area"] == "torch")
        assert str(VENV / "bin/python") in torch["detail"]  # the program's own interpreter
        # The state directory the tmpfiles entry made, found before any start of the unit.
        state = [f for f in report["findings"] if str(STATE_DIR) in json.dumps(f)]
        assert state, report["findings"]
        assert state[0]["status"] == "OK"
        assert "does not exist" not in state[0]["detail"]

    def test_runs_on_its_own_venv_and_writes_nothing_there(
        self, installed: HostPackage, tmp_path: Path
    ) -> None:
        code = "import sys, agent, yaml; print(sys.prefix); print(agent.__file__)"
        done = installed_run(str(VENV / "bin/python"), "-c", code, tmp_path=tmp_path)
        prefix, module = done.stdout.split()
        assert prefix == str(VENV)
        assert module.startswith(f"{VENV}/lib/")
        config = installed_run("/usr/bin/gpuwarden", "config", "check", tmp_path=tmp_path)
        assert config.returncode == 0, config.stdout + config.stderr
        # The shipped compiled modules are valid where dpkg put them: root running the
        # program compiles nothing new (which purge would then have to find), and changes
        # none of the package's files (dpkg --verify reads the md5sums).
        assert unowned_under(Path("/opt/gpuwarden"), installed) == []
        verify = subprocess.run(
            ["dpkg", "--verify", PACKAGE], capture_output=True, text=True, check=False
        )
        assert (verify.returncode, verify.stdout) == (0, ""), verify.stdout + verify.stderr

    @pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="no torch here")
    def test_benchmark_runs_on_a_configured_torch_python(
        self, installed: HostPackage, tmp_path: Path
    ) -> None:
        # torch is not in the package: [collectors.benchmark] python names an interpreter
        # that has it (here the tests' own), and the packaged child runs under it.
        config = tmp_path / "gpuwarden.toml"
        config.write_text(
            f'state_dir = "{tmp_path / "state"}"\n'
            f'[collectors.benchmark]\npython = "{sys.executable}"\n'
            # the least work that still runs a whole record: this machine is shared
            "iterations = 1\nwarmup = 0\nsamples = 1\nmin_window_seconds = 0.0\n"
        )
        done = installed_run(
            "/usr/bin/gpuwarden", "bench", "--device", "cpu", "--size", "128", "--json",
            "--config", str(config), tmp_path=tmp_path,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        record = json.loads(done.stdout.strip().splitlines()[-1])
        assert record["torch"].startswith("2.")
        assert record["correct"] is True

    @pytest.mark.parametrize("unit", UNITS)
    def test_installed_units_verify(self, installed: HostPackage, unit: str) -> None:
        analyze = shutil.which("systemd-analyze") or "/usr/bin/systemd-analyze"
        done = subprocess.run(
            [analyze, "verify", f"/usr/lib/systemd/system/{unit}"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert done.stderr.strip() == ""

    def test_upgrade_keeps_edited_config_state_and_choices(
        self, changed: HostPackage, deb_packages: DebPackages
    ) -> None:
        edited = CONFFILE.read_text() + '\nnode_id = "edited-by-admin"\n'
        CONFFILE.write_text(edited)
        (CONFFILE.parent / "mqtt-password").write_text("secret\n")
        (STATE_DIR / "kept").write_text("state\n")
        (WANTS / "gpuwarden.service").unlink()  # the administrator disabled the agent
        upgraded = changed.install(deb_packages.path(deb_packages.next_version))
        assert "Unpacking gpuwarden" in upgraded.stdout
        assert changed.version() == deb_packages.next_version
        assert CONFFILE.read_text() == edited
        assert (CONFFILE.parent / "mqtt-password").read_text() == "secret\n"
        assert (STATE_DIR / "kept").read_text() == "state\n"
        assert not (WANTS / "gpuwarden.service").exists()
        assert not list(CONFFILE.parent.glob("*.dpkg-*"))

    def test_remove_keeps_config_and_state(self, changed: HostPackage) -> None:
        CONFFILE.write_text(CONFFILE.read_text() + '\nnode_id = "kept"\n')
        # A module compiled by some other interpreter: dpkg does not own it, postrm removes it.
        stray = next(VENV.glob("lib/python3.*/site-packages/agent/__pycache__"))
        (stray / "cli.cpython-399.pyc").write_bytes(b"\0")
        changed.remove()
        assert changed.status() == "rc"
        assert 'node_id = "kept"' in CONFFILE.read_text()
        assert STATE_DIR.is_dir()
        assert not Path("/opt/gpuwarden").exists()
        assert not Path("/usr/bin/gpuwarden").exists()
        assert not [u for u in UNITS if Path("/usr/lib/systemd/system", u).exists()]

    def test_purge_leaves_nothing(self, changed: HostPackage) -> None:
        (STATE_DIR / "state.db").write_text("x")
        changed.remove()
        changed.purge()
        assert changed.status() == ""
        assert changed.files() == []
        for path in ("/opt/gpuwarden", "/etc/gpuwarden", str(STATE_DIR), "/usr/bin/gpuwarden"):
            assert not os.path.lexists(path), path
        for top in ("/etc/systemd", "/var/lib/systemd", "/usr/lib/systemd"):
            assert not list(Path(top).rglob("*gpuwarden*")), top
        # The system user stays (docs/package.md says why); the fixture removes it here.
        kept = subprocess.run(["getent", "passwd", PACKAGE], capture_output=True, check=False)
        assert kept.returncode == 0
