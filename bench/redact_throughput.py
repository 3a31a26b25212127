"""Redaction throughput: rules on the lines that hold their hints (as shipped) side by side
with every rule over the whole text (the reference the property test compares against).

Run: `python bench/redact_throughput.py`. Prints MiB/s for a secret-dense log (the corpus's
training log, repeated) and for plain step/loss lines (what most of a real log is).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.program.diagnose import redact as redact_module
from agent.program.diagnose.redact import Redactor

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "redaction" / "train.log"


def timed(text: str) -> float:
    started = time.perf_counter()
    Redactor().redact(text)
    return time.perf_counter() - started


def main() -> None:
    log = CORPUS.read_text()
    inputs = {
        "training log with planted secrets": log * 100,
        "step/loss lines only": "\n".join(line for line in log.splitlines() if "step=" in line)
        * 150,
    }
    print(f"{'input':<36} {'MiB':>6} {'line windows MiB/s':>19} {'whole text MiB/s':>17}")
    for name, text in inputs.items():
        size = len(text.encode()) / 2**20
        fast = min(timed(text) for _ in range(3))
        with mock.patch.multiple(
            redact_module,
            _hint_spans=lambda t, rule: [(0, len(t))],
            _key_value_lines=lambda t: [(0, len(t))],
        ):
            slow = min(timed(text) for _ in range(3))
        print(f"{name:<36} {size:>6.1f} {size / fast:>19.1f} {size / slow:>17.1f}")


if __name__ == "__main__":
    main()
