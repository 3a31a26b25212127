"""What the daemon's start-up imports cost, and what `gpuwarden run` has loaded after its first
rounds: one table, side by side for two checkouts when `--before` names another.

    python bench/import_footprint.py [--before CHECKOUT] [--top 25] [--run] [--everything]

Every module stays resident for the daemon's life (issue 14: <= 64 MB RSS on the H200), so the
figures are of `import agent.program.cli, agent.program.registry` in a fresh interpreter:
- RSS before and after the import (no tracing in that interpreter), and the modules loaded;
- tracemalloc of each module's own execution (its code objects, classes, tables, compiled
  regular expressions; what the modules it imports allocate is theirs), summed per top-level
  package, and the largest modules;
- with `--run`: `gpuwarden run` on the embedded defaults and the fake NVML
  (tests/support/modules_agent.py), short intervals, until every collector has run 3 rounds
  and the benchmark has tried once: its RSS then, and the modules it loaded after start-up;
  with `--everything`, the same with MQTT (no broker), the I/O probe and the checkpoints
  collector on too, as on the H200 of docs/MEASUREMENTS.md.
Extension modules' code (a shared object such as _decimal's) is not traced: RSS shows it. A
module is also charged what the interpreter sets up lazily while it runs (the first user of the
`ast` node types, say). Both checkouts are byte-compiled first (into their __pycache__); for
the branch point: `git archive main | tar -x -C /tmp/before` and `--before /tmp/before`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.agent_proc import AgentProcess  # noqa: E402
from tests.support.modules_probe import ask, everything_on, fast_rounds, rounds_done  # noqa: E402
from tests.support.ports import free_port  # noqa: E402

ENTRY = "import agent.program.cli, agent.program.registry"

# Patches the import system's one loading step (importlib._bootstrap._load_unlocked, which every
# import statement goes through), so a module's own allocations are the traced growth while it
# executes less what the imports it starts allocate.
TRACE = """
import json, sys, tracemalloc
import importlib._bootstrap as bootstrap
# The table of interned strings grows as modules load, and a resize would be charged to
# whichever module made it: grown once beforehand (untraced), it stays that size.
warm = [sys.intern(f"gpuwarden-warm-{i}") for i in range(200_000)]
del warm
tracemalloc.start()
original = bootstrap._load_unlocked
nested, own, parent, names = [], {}, {}, []
def load(spec):
    parent.setdefault(spec.name, names[-1] if names else None)
    nested.append(0)
    names.append(spec.name)
    before = tracemalloc.get_traced_memory()[0]
    try:
        return original(spec)
    finally:
        grown = tracemalloc.get_traced_memory()[0] - before
        names.pop()
        own[spec.name] = own.get(spec.name, 0) + grown - nested.pop()
        if nested:
            nested[-1] += grown
bootstrap._load_unlocked = load
ENTRY
bootstrap._load_unlocked = original
print(json.dumps({"own": own, "parent": parent}))
"""

RSS = """
import json, sys
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
bare, count = rss(), len(sys.modules)
ENTRY
print(json.dumps({"bare": bare, "after": rss(), "modules": len(sys.modules) - count,
                  "names": sorted(m for m, v in sys.modules.items() if v)}))
"""


@dataclass
class Footprint:
    label: str
    own: dict[str, int]
    parent: dict[str, str | None]
    rss_bare: int
    rss_after: int
    modules: int
    names: set[str]
    run_rss: int | None = None
    run_names: set[str] | None = None
    all_rss: int | None = None
    all_names: set[str] | None = None

    def packages(self) -> dict[str, tuple[int, int]]:
        """Top-level package -> (bytes, modules)."""
        out: dict[str, tuple[int, int]] = {}
        for name, size in self.own.items():
            top = name.split(".")[0]
            total, count = out.get(top, (0, 0))
            out[top] = (total + size, count + 1)
        return out

    def chain(self, name: str) -> str:
        """Who imported `name`, up to the entry point."""
        links = [name]
        while (up := self.parent.get(links[-1])) is not None and len(links) < 12:
            links.append(up)
        return " <- ".join(links)


def python(repo: Path, code: str, *, write_bytecode: bool = False) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(repo)}
    if write_bytecode:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    out = subprocess.run(
        [sys.executable, "-c", code.replace("ENTRY", ENTRY)],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    result: dict[str, object] = json.loads(out.stdout.splitlines()[-1])
    return result


def measure(repo: Path, label: str) -> Footprint:
    # Byte-compiled first, as an installed agent is: compiling a module from its source raises
    # the process's high-water mark (RSS) by more than the differences measured here.
    python(repo, "ENTRY\nimport agent.program.commands.run\nprint('{}')", write_bytecode=True)
    traced = python(repo, TRACE)
    # The median of three fresh interpreters: RSS moves by a few hundred kB run to run.
    runs = sorted((python(repo, RSS) for _ in range(3)), key=lambda r: int(str(r["after"])))
    rss = runs[1]
    return Footprint(
        label=label,
        own={str(k): int(v) for k, v in dict(traced["own"]).items()},  # type: ignore[call-overload]
        parent=dict(traced["parent"]),  # type: ignore[call-overload]
        rss_bare=int(str(rss["bare"])),
        rss_after=int(str(rss["after"])),
        modules=int(str(rss["modules"])),
        names=set(rss["names"]),  # type: ignore[call-overload]
    )


def run_agent(repo: Path, everything: bool, rounds: int = 3) -> tuple[int, set[str]]:
    """`gpuwarden run` of `repo` for a few rounds: its RSS and the modules it holds then."""
    # The launcher of this checkout, run by path: the other checkout may not have one.
    launcher = REPO / "tests" / "support" / "modules_agent.py"
    work = Path(tempfile.mkdtemp(prefix="gpuwarden-imports-"))
    (work / "dev").mkdir()
    request = work / "dump"
    code = (
        "import runpy, sys\n"
        f"sys.argv = [{str(launcher)!r}, *sys.argv[1:]]\n"
        f"runpy.run_path({str(launcher)!r}, run_name='__main__')\n"
    )
    config = everything_on(work, free_port()) if everything else fast_rounds(work / "kern.log")
    agent = AgentProcess(
        work / "agent",
        config_text=config,
        repo=repo,
        entry=["-c", code, str(work / "dev"), "2", str(request)],
    )
    try:
        agent.start(timeout=60)
        deadline = time.monotonic() + 120
        while not rounds_done(agent, rounds):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {rounds} rounds in 120 s:\n{agent.log()}")
            time.sleep(0.2)
        names = ask(request).modules
        assert agent.process is not None
        status = Path(f"/proc/{agent.process.pid}/status").read_text()
        rss = next(
            int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:")
        )
    finally:
        agent.stop()
        shutil.rmtree(work, ignore_errors=True)
    return rss, names


def kib(size: int | None) -> str:
    return "-" if size is None else f"{size / 1024:,.0f}"


def mib(size: int | None) -> str:
    return "-" if size is None else f"{size / 2**20:.1f}"


def table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def report(prints: Sequence[Footprint], top: int) -> str:
    head = ["", *(p.label for p in prints)]
    rows: list[list[str]] = [head]
    rows.append(["RSS, bare interpreter (MiB)", *(mib(p.rss_bare) for p in prints)])
    rows.append([f"RSS after `{ENTRY}` (MiB)", *(mib(p.rss_after) for p in prints)])
    rows.append(["modules the import loads", *(str(p.modules) for p in prints)])
    rows.append(["traced by their execution (kB)", *(kib(sum(p.own.values())) for p in prints)])
    runs = (("`gpuwarden run`", "run"), ("`gpuwarden run`, everything on", "all"))
    for title, key in runs:
        if all(getattr(p, f"{key}_rss") is None for p in prints):
            continue
        rows.append(
            [
                f"{title}, after its rounds: RSS (MiB)",
                *(mib(getattr(p, f"{key}_rss")) for p in prints),
            ]
        )
        counts = []
        for p in prints:
            names = getattr(p, f"{key}_names")
            counts.append("-" if names is None else str(len(names - p.names)))
        rows.append(["  modules loaded after start-up", *counts])
    rows.append(["per top-level package: kB (modules)", *("" for _ in prints)])
    packages = [p.packages() for p in prints]
    biggest = sorted(
        {k for pk in packages for k in pk},
        key=lambda k: -max(pk.get(k, (0, 0))[0] for pk in packages),
    )
    for name in biggest[:top]:
        cells = [f"{kib(pk[name][0])} ({pk[name][1]})" if name in pk else "-" for pk in packages]
        rows.append([f"  {name}", *cells])
    rows.append(["largest modules: kB of their own execution", *("" for _ in prints)])
    largest = sorted(
        {m for p in prints for m in p.own}, key=lambda m: -max(p.own.get(m, 0) for p in prints)
    )
    for name in largest[:top]:
        rows.append([f"  {name}", *(kib(p.own.get(name)) for p in prints)])
    out = [table(rows)]
    last = prints[-1]
    if len(prints) == 2:
        gone = sorted(prints[0].names - last.names)
        new = sorted(last.names - prints[0].names)
        out.append(
            f"\nloaded at start-up by {prints[0].label} only ({len(gone)}): {' '.join(gone)}"
        )
        out.append(f"loaded at start-up by {last.label} only ({len(new)}): {' '.join(new)}")
    for p in prints:
        for title, held in (("`gpuwarden run`", p.run_names), ("everything on", p.all_names)):
            if held is not None:
                late = sorted(held - p.names)
                out.append(f"\n{p.label}, {title}, after start-up ({len(late)}): {' '.join(late)}")
    out.append("\nwho imports the largest of " + last.label + ":")
    out.extend(f"  {last.chain(name)}" for name in largest[: min(top, 10)] if name in last.parent)
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="another checkout, measured beside this one")
    parser.add_argument("--top", type=int, default=25, help="rows of packages and of modules")
    parser.add_argument("--run", action="store_true", help="also run the agent for a few rounds")
    parser.add_argument(
        "--everything",
        action="store_true",
        help="also run it with MQTT, the I/O probe and the checkpoints collector on",
    )
    args = parser.parse_args()
    checkouts = [(args.before.resolve(), "before")] if args.before else []
    checkouts.append((REPO, "this checkout" if not args.before else "after"))
    prints = [measure(repo, label) for repo, label in checkouts]
    for (repo, _), footprint in zip(checkouts, prints, strict=True):
        if args.run:
            footprint.run_rss, footprint.run_names = run_agent(repo, everything=False)
        if args.everything:
            footprint.all_rss, footprint.all_names = run_agent(repo, everything=True)
    print(report(prints, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
