"""Run the fault harness (tests/support/chaos.py) over many seeds: `python scripts/chaos.py
--seeds 1-50 --steps 30`. Prints one line per seed and the report of each that failed; exits 1
if any did. Root (the state disk is a tmpfs), mosquitto installed."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.chaos import Chaos, report


def seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        out += range(int(first), int(last or first) + 1)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", default="1-20", help="e.g. 1-20 or 3,7,9")
    parser.add_argument("--steps", type=int, default=30, help="operations per schedule")
    parser.add_argument("--verbose", action="store_true", help="print each step as it runs")
    args = parser.parse_args()
    failed = 0
    operations = 0
    for seed in seeds(args.seeds):
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f"chaos-{seed}-") as folder:
            chaos = Chaos(seed, Path(folder), verbose=args.verbose)
            try:
                violations = chaos.run(args.steps)
            except Exception as exc:  # the harness itself failed: a finding too
                violations = chaos.violations or [f"{type(exc).__name__}: {exc}"]
                chaos.violations = violations
        operations += args.steps
        took = time.monotonic() - started
        print(f"seed {seed}: {len(violations)} violation(s), {took:.0f} s, {chaos.stats}")
        if violations:
            failed += 1
            print(report(chaos))
        sys.stdout.flush()
    print(f"{failed} of {len(seeds(args.seeds))} seeds failed ({operations} operations)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
