"""README.md and docs/*.md: every repository path and link they name exists, nothing points
outside the repository, every docs/ file is reachable from the README, and the alert table
names exactly the rules that exist."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

from agent.program.watch.alertmanager import alertname
from agent.program.watch.fleet import ALERT_KINDS
from tests.support.rules import RULES, alert_blocks

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
# Top-level entries of the repository: a token starting with one of them is a repository path.
TOP = (
    "agent",
    "bench",
    "collectors",
    "configs",
    "docs",
    "exporters",
    "scripts",
    "systemd",
    "tests",
)
REPO_PATH = re.compile(rf"(?<![\w./<>-])((?:{'|'.join(TOP)}|\.ci)/[\w./-]*[\w/])")
BARE_FILE = re.compile(r"(?<![\w./<>-])([\w-]+(?:\.[\w-]+)*\.(?:md|py|sh))\b")
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} (.+)$", re.MULTILINE)
# Text that names something only the project's authors had: the shared folder of the sessions
# that wrote gpuwarden, its notes, and the guide's script by a name a reader cannot open.
OUTSIDE = re.compile(r"\.\./shared|(?<![\w-])shared/|/work/|FIELD-NOTES|field guide's|the guide's")


def documents() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def doc_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def without_bundle_members(text: str) -> str:
    """The diag bundle's member table names paths inside the tar.gz (agent/metrics.txt), not
    in the repository: drop its rows."""
    return re.sub(r"^\| member \|.*?(?=\n\n)", "", text, flags=re.MULTILINE | re.DOTALL)


@cache
def anchors(path: Path) -> frozenset[str]:
    """The anchors GitHub gives the headings of a markdown file."""
    fenced = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)
    return frozenset(
        re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        for heading in HEADING.findall(fenced)
    )


@cache
def python_classes() -> frozenset[str]:
    return frozenset(
        name
        for top in ("agent", "collectors", "exporters")
        for source in (ROOT / top).rglob("*.py")
        for name in re.findall(r"^class (\w+)", source.read_text(), re.MULTILINE)
    )


def inside_repo(path: Path) -> bool:
    return path.resolve().is_relative_to(ROOT)


def broken_links(doc: Path) -> list[str]:
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file_part, _, fragment = target.partition("#")
        linked = (doc.parent / file_part) if file_part else doc
        if not inside_repo(linked) or not linked.exists():
            broken.append(f"{target}: no such file in the repository")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            broken.append(f"{target}: {doc_id(linked)} has no heading #{fragment}")
    return broken


def missing_paths(doc: Path) -> list[str]:
    text = without_bundle_members(doc.read_text())
    missing = [p for p in REPO_PATH.findall(text) if not (ROOT / p).exists()]
    for name in BARE_FILE.findall(text):
        if name.endswith(".md"):  # a document is named where it is, or from the root
            found = (doc.parent / name).exists() or (ROOT / name).exists()
        else:  # a module or script by its file name alone
            found = any(p for p in ROOT.rglob(name) if ".venv" not in p.parts)
        if not found:
            missing.append(name)
    return missing


@pytest.mark.parametrize("doc", documents(), ids=doc_id)
class TestEveryDocument:
    def test_links_resolve_to_files_and_headings(self, doc: Path) -> None:
        broken = broken_links(doc)
        assert not broken, f"{doc_id(doc)}: " + "; ".join(broken)

    def test_named_repository_paths_exist(self, doc: Path) -> None:
        missing = missing_paths(doc)
        assert not missing, f"{doc_id(doc)} names paths not in the repository: {missing}"

    def test_nothing_points_outside_the_repository(self, doc: Path) -> None:
        hits = [
            f"line {n}: {m.group(0)!r}"
            for n, line in enumerate(doc.read_text().splitlines(), 1)
            for m in OUTSIDE.finditer(line)
        ]
        assert not hits, f"{doc_id(doc)} points outside the repository: {hits}"


def test_the_readme_links_every_docs_file() -> None:
    linked = {
        (ROOT / target.partition("#")[0]).resolve() for target in LINK.findall(README.read_text())
    }
    unlinked = [doc_id(p) for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert not unlinked, f"README.md does not link {unlinked}"


def test_the_alerts_doc_names_exactly_the_rules() -> None:
    rules = set(alert_blocks(RULES.read_text()))
    named = set(re.findall(r"`(Gpuwarden[A-Z]\w*)`", (DOCS / "alerts.md").read_text()))
    assert rules - named == set(), f"docs/alerts.md lacks {sorted(rules - named)}"
    assert named - rules == set(), f"docs/alerts.md names no such rule: {sorted(named - rules)}"


@pytest.mark.parametrize("doc", documents(), ids=doc_id)
def test_every_alert_named_is_a_rule(doc: Path) -> None:
    """`GpuwardenX` names a rule, or an alert the watcher posts to Alertmanager itself;
    `GpuwardenX*` names at least one (a group of rules). Python classes of that form
    (`GpuwardenError`) are not alerts."""
    rules = set(alert_blocks(RULES.read_text())) | {alertname(kind) for kind in ALERT_KINDS}
    unknown = [
        name + star
        for name, star in re.findall(r"`(Gpuwarden[A-Z]\w*)(\*?)`", doc.read_text())
        if not (any(r.startswith(name) for r in rules) if star else name in rules)
        and name not in python_classes()
    ]
    assert not unknown, f"{doc_id(doc)} names alerts that are no rules: {unknown}"


class TestTheCheckerCatches:
    """The checks above can fail: each kind of bad reference is caught in a document of its own."""

    @pytest.mark.parametrize(
        ("text", "problem"),
        [
            ("[x](nowhere.md)", "no such file"),
            ("[x](../../etc/passwd)", "no such file"),
            ("[x](ARCHITECTURE.md#no-such-heading)", "has no heading"),
        ],
    )
    def test_bad_links(self, text: str, problem: str) -> None:
        doc = DOCS / "_probe.md"
        try:
            doc.write_text(text + "\n")
            assert problem in " ".join(broken_links(doc))
        finally:
            doc.unlink()

    @pytest.mark.parametrize(
        "text", ["see `collectors/no_such.py`", "in scripts/nothing.sh", "FIELD-NOTES2.md"]
    )
    def test_missing_paths(self, text: str) -> None:
        doc = DOCS / "_probe.md"
        try:
            doc.write_text(text + "\n")
            assert missing_paths(doc)
        finally:
            doc.unlink()

    @pytest.mark.parametrize(
        "text",
        ["/work/shared/FIELD-NOTES.md", "../shared/device", "as in the field guide's script"],
    )
    def test_outside_pointers(self, text: str) -> None:
        assert OUTSIDE.search(text)


def test_every_benchmark_is_in_the_development_guide() -> None:
    """A bench/ script nobody can find is a measurement nobody repeats."""
    guide = (DOCS / "development.md").read_text()
    missing = [
        f"bench/{script.name}"
        for script in sorted((ROOT / "bench").glob("*.py"))
        if script.name != "__init__.py" and f"`bench/{script.name}`" not in guide
    ]
    assert missing == [], missing
