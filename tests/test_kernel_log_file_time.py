"""A followed kernel-log file's findings carry the time their line says, where the line says
it with its zone (ISO 8601 with an offset, journalctl's short-unix), not the time the agent
read it: a file read after a pause (an agent restarted, a log rotated) holds old lines."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest

from agent.contracts.collector import MemoryKeyValueStore
from collectors.kernel_log.kmsg import FileLogReader

XID = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus."
STAMP = "2026-11-29T18:10:02.123456+00:00"
WHEN = datetime.fromisoformat(STAMP).timestamp()
NOW = WHEN + 6 * 3600.0  # the agent reads the file six hours later
PENDING = "FileLogReader.record_time answers the time of the read for every line (not fixed yet)"


def _pending(line: str, expected: float) -> object:
    return pytest.param(line, expected, marks=pytest.mark.xfail(strict=True, reason=PENDING))


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        _pending(f"{STAMP} gpu-host-17 kernel: {XID}", WHEN),  # journalctl -o short-iso-precise
        _pending(
            f"2026-11-29T18:10:02+0000 gpu-host-17 kernel: {XID}", WHEN - 0.123456
        ),  # short-iso
        _pending(f"2026-11-29T20:10:02+02:00 gpu-host-17 kernel: {XID}", WHEN - 0.123456),
        _pending(f"2026-11-29T18:10:02Z gpu-host-17 kernel: {XID}", WHEN - 0.123456),
        _pending(f"<4>1 {STAMP} gpu-host-17 kernel - - - {XID}", WHEN),  # RFC 5424 file
        _pending(f"kern  :err   : 2026-11-29T18:10:02,123456+00:00 {XID}", WHEN),  # dmesg -x iso
        _pending(f"2026-11-29T18:10:02,123456+00:00 {XID}", WHEN),  # dmesg --time-format iso
        _pending(f"{WHEN:.6f} gpu-host-17 kernel: {XID}", WHEN),  # journalctl -o short-unix
        # No zone or no year: the line cannot say when; the time it was read.
        (f"Nov 29 18:10:02 gpu-host-17 kernel: {XID}", NOW),
        (f"[Sun Nov 29 18:10:02 2026] {XID}", NOW),
        (f"[   12.345678] {XID}", NOW),
        (f"2026-11-29T18:10:02 gpu-host-17 kernel: {XID}", NOW),
        # A stamp after the reader's clock (a skewed sender) is not trusted past now.
        (f"2027-11-29T18:10:02+00:00 gpu-host-17 kernel: {XID}", NOW),
    ],
)
def test_a_finding_carries_its_lines_time(line: str, expected: float, tmp_path: Path) -> None:
    path = tmp_path / "kern.log"
    path.write_text(line + "\n", encoding="utf-8")
    reader = FileLogReader(path, MemoryKeyValueStore(), clock=lambda: NOW)
    [record] = reader.read().records
    assert record.message == XID
    assert reader.record_time(record) == pytest.approx(expected, abs=1e-6)
