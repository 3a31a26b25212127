"""scripts/build_deb.py's parts that need no build: the version dpkg sees, the packaged rules'
runbook links (docs/package.md)."""

from __future__ import annotations

import itertools
import subprocess
from pathlib import Path

import pytest
from packaging.version import Version as packaging_version

from scripts.build_deb import BuildError, debian_version, install_files
from tests.support.rules import RULES, RUNBOOK_PLACEHOLDER, alert_rules


class TestDebianVersion:
    """scripts/build_deb.py's PEP 440 -> Debian version: dpkg must order releases as pip does."""

    # Ascending in PEP 440 order.
    ORDERED = (
        "0.9",
        "1.0.dev1",
        "1.0a1.dev1",
        "1.0a1",
        "1.0a2",
        "1.0b1",
        "1.0rc1.dev3",
        "1.0rc1",
        "1.0",
        "1.0.post1.dev1",
        "1.0.post1",
        "1.0.1",
        "1.1.dev0",
        "1.1",
    )

    def test_dpkg_orders_them_as_pep_440_does(self) -> None:
        assert list(self.ORDERED) == sorted(self.ORDERED, key=packaging_version)
        mapped = [debian_version(v) for v in self.ORDERED]
        for lower, higher in itertools.pairwise(mapped):
            done = subprocess.run(["dpkg", "--compare-versions", lower, "lt", higher], check=False)
            assert done.returncode == 0, f"dpkg does not sort {lower} before {higher}"

    @pytest.mark.parametrize("bad", ["1.0-1", "v1.0", "1.0+local", "1!2.0", ""])
    def test_what_it_cannot_map_is_an_error_naming_the_key(self, bad: str) -> None:
        with pytest.raises(BuildError, match=r"project\.version"):
            debian_version(bad)


class TestRunbookUrl:
    """scripts/build_deb.py --runbook-url: the packaged rules link where the runbook is
    published, as `make install RUNBOOK_URL=...` does for its copy."""

    URL = "https://git.example.org/ops/gpuwarden/-/blob/main/docs/runbook.md"

    def test_every_rule_links_the_published_runbook(self, tmp_path: Path) -> None:
        install_files(tmp_path, runbook_url=self.URL)
        text = (tmp_path / "usr/share/gpuwarden/prometheus/gpuwarden-rules.yml").read_text()
        assert text == RULES.read_text().replace(f"{RUNBOOK_PLACEHOLDER}#", f"{self.URL}#")
        urls = [r["annotations"]["runbook_url"] for r in alert_rules(text).values()]
        assert urls and all(u.startswith(f"{self.URL}#") for u in urls)

    def test_without_one_the_placeholder_stays(self, tmp_path: Path) -> None:
        install_files(tmp_path)
        shipped = tmp_path / "usr/share/gpuwarden/prometheus/gpuwarden-rules.yml"
        assert shipped.read_text() == RULES.read_text()

    @pytest.mark.parametrize(
        "url", ["git.example.org/runbook.md", "https://x/a b", "https://x/r.md#top", 'https://x/"']
    )
    def test_an_address_that_cannot_take_the_anchors_is_refused(
        self, tmp_path: Path, url: str
    ) -> None:
        with pytest.raises(BuildError, match="--runbook-url") as caught:
            install_files(tmp_path, runbook_url=url)
        assert url in str(caught.value)
