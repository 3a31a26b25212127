"""The redaction corpus (tests/fixtures/redaction): planted secrets and lines that must stay."""

from __future__ import annotations

import subprocess
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


def openssl_hash(scheme: str, password: str) -> str:
    """A crypt(3) hash made by openssl (1, 5, 6, apr1), as passwd and htpasswd write them."""
    done = subprocess.run(
        ["openssl", "passwd", f"-{scheme}", password], capture_output=True, text=True, check=True
    )
    return done.stdout.strip()
