"""The wheel: built without a warning from the build backend, licensed in SPDX form, and holding
only the program's own packages (docs/package.md, "What the wheel holds")."""

from __future__ import annotations

import email.parser
import re
import zipfile
from pathlib import Path

import pytest

from tests.support.deb import WheelBuild, build_wheel

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> WheelBuild:
    return build_wheel(ROOT, tmp_path_factory.mktemp("wheel"))


def metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(archive.read(name).decode())


class TestBuild:
    def test_no_warning_from_the_backend(self, built: WheelBuild) -> None:
        # Any warning class counts (SetuptoolsDeprecationWarning, SetuptoolsWarning, ...):
        # each one is a build that breaks on some later setuptools.
        warnings = re.findall(r"^.*\b\w*Warning\b.*$", built.log, re.MULTILINE)
        assert warnings == [], "\n".join(warnings)

    def test_license_is_an_spdx_expression_with_its_file(self, built: WheelBuild) -> None:
        meta = metadata(built.wheel)
        assert meta["License-Expression"] == "Apache-2.0"
        assert meta.get_all("License-File") == ["LICENSE"]
        with zipfile.ZipFile(built.wheel) as archive:
            licenses = [n for n in archive.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
            assert len(licenses) == 1
            assert b"Apache License" in archive.read(licenses[0])


class TestContents:
    def test_only_the_programs_packages_at_top_level(self, built: WheelBuild) -> None:
        with zipfile.ZipFile(built.wheel) as archive:
            tops = {name.split("/")[0] for name in archive.namelist()}
        packages = {t for t in tops if not t.endswith(".dist-info")}
        # tests/, bench/ and scripts/ never leak into an installation.
        assert packages == {"agent", "collectors", "exporters"}

    def test_package_data_the_program_reads_is_inside(self, built: WheelBuild) -> None:
        with zipfile.ZipFile(built.wheel) as archive:
            names = set(archive.namelist())
        assert "collectors/_xid_catalog.json" in names
        # Every data file the source tree holds beside the code goes into the wheel.
        for pattern in ("*.json", "*.toml", "py.typed"):
            for path in (ROOT / "agent").rglob(pattern):
                assert path.relative_to(ROOT).as_posix() in names, path
            for path in (ROOT / "collectors").rglob(pattern):
                assert path.relative_to(ROOT).as_posix() in names, path
