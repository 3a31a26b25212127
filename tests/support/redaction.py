"""The redaction corpus (tests/fixtures/redaction): planted secrets and lines that must stay."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CORPUS_DIR = Path(__file__).resolve().parent.parent / "fixtures" / "redaction"
CORPUS_FILES = (
    "train.log",
    "requests.jsonl",
    "dotenv",
    "bash_history",
    "id_ed25519",
    "service-account.json",
)


@dataclass(frozen=True)
class Planted:
    kind: str
    value: str


def planted() -> list[Planted]:
    rows = (CORPUS_DIR / "planted.tsv").read_text().splitlines()
    return [Planted(*row.split("\t", 1)) for row in rows if row]


def keep_lines() -> list[str]:
    return [line for line in (CORPUS_DIR / "keep.txt").read_text().splitlines() if line]


def surviving_secrets(texts: list[str]) -> list[Planted]:
    """Planted secrets found in any of `texts` (empty when redaction worked)."""
    joined = "\n".join(texts)
    return [p for p in planted() if p.value in joined]
