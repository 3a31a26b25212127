"""Reading a saved kernel log of any size keeps memory flat: the followed-file reader,
`gpuwarden scan` and check/diag's kernel-log part, each in a child process that reports its
own peak RSS (a gross bound: the
machine is noisy, the difference between a bounded and a whole-file read is hundreds of MiB)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MIB = 1024 * 1024
XID = "NVRM: Xid (PCI:0000:3b:00): 79, pid=2314, name=python3, GPU has fallen off the bus."
RSS_BOUND_MIB = 64
"""Growth allowed over the child's RSS after its imports: one 4 MiB read, decoded, split
and parsed, is well under it; the whole 120 MiB file is several times over."""

# Run in the child: read the file to its end, report findings, lines read, malformed lines and
# the peak RSS growth. ru_maxrss is in KiB on Linux.
CHILD = """
import json, resource, sys
sys.path.insert(0, {root!r})
from pathlib import Path
from agent.contracts.collector import MemoryKeyValueStore
from agent.program.commands.scan import scan_stream
from agent.program.diagnose.kernel_findings import scan_kernel_log
from collectors.kernel_log.collector import KernelLogSettings
from collectors.kernel_log.kmsg import FileLogReader
from collectors.kernel_log.matchers import MatcherSet
from collectors.kernel_log.parse import ParseStats

path, how = Path(sys.argv[1]), sys.argv[2]
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if how == "follow":
    reader, matchers, records, malformed = FileLogReader(path, MemoryKeyValueStore()), MatcherSet(), 0, 0
    kinds = []
    while True:
        batch = reader.read()
        reader.commit(batch)
        records += len(batch.records)
        malformed += batch.malformed
        kinds += [(f.line, f.kind) for f in matchers.scan(batch.records)]
        if not batch.more:
            break
    lines = records + malformed
elif how == "check":
    found = scan_kernel_log(KernelLogSettings(path=path))
    kinds = [(f.line, f.kind) for f in found.findings]
    lines, malformed = found.records_read + found.malformed, found.malformed
else:
    stats = ParseStats()
    with path.open("rb") as handle:
        kinds = [(f.line, f.kind) for f in scan_stream(handle, stats)]
    lines, malformed = stats.lines, stats.malformed  # its prefilter parses only some lines
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({{"findings": kinds, "lines": lines, "malformed": malformed,
                  "growth_mib": (peak - base) / 1024}}))
"""


@pytest.fixture(scope="module")
def many_lines(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """120 MiB of 1 KiB noise lines, then an Xid."""
    path = tmp_path_factory.mktemp("logs") / "big.log"
    line = b"[   12.345678] usb 1-1: " + b"n" * 999 + b"\n"
    block = line * (MIB // len(line))
    with path.open("wb") as handle:
        for _ in range(120):
            handle.write(block)
        handle.write(f"[   99.000000] {XID}\n".encode())
    return path, 120 * (MIB // len(line)) + 1


@pytest.fixture(scope="module")
def one_long_line(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A 150 MiB line without a newline until its end (a runaway writer), then an Xid."""
    path = tmp_path_factory.mktemp("logs") / "long.log"
    with path.open("wb") as handle:
        handle.write(b"[    1.000000] before\n")
        for _ in range(150):
            handle.write(b"q" * MIB)
        handle.write(f"\n[   99.000000] {XID}\n".encode())
    return path, 3


def run_child(path: Path, how: str) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD.format(root=str(ROOT)), str(path), how],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    result: dict[str, object] = json.loads(proc.stdout)
    return result


@pytest.mark.slow
@pytest.mark.parametrize("how", ["follow", "scan", "check"])
def test_big_log_is_read_in_flat_memory(how: str, many_lines: tuple[Path, int]) -> None:
    """Every line read (a record, or malformed), the Xid at the very end found, RSS growth
    bounded."""
    path, lines = many_lines
    result = run_child(path, how)
    assert result["findings"] == [[lines, "xid"]]
    assert (result["lines"], result["malformed"]) == (lines, 0)
    assert isinstance(result["growth_mib"], float)
    assert result["growth_mib"] < RSS_BOUND_MIB


@pytest.mark.slow
@pytest.mark.parametrize("how", ["follow", "scan", "check"])
def test_long_line_is_skipped_in_flat_memory(how: str, one_long_line: tuple[Path, int]) -> None:
    """The 150 MiB line is one malformed line, never held whole; the Xid after it is found on
    its own line number."""
    path, lines = one_long_line
    result = run_child(path, how)
    assert result["findings"] == [[lines, "xid"]]
    assert (result["lines"], result["malformed"]) == (lines, 1)
    assert isinstance(result["growth_mib"], float)
    assert result["growth_mib"] < RSS_BOUND_MIB
