"""A disk or NVMe failure in every wording the kernel has used for it: the block layer's failed
request names its status (`critical medium error`, not only `I/O error`), and the NVMe driver's
timeouts changed words in 6.x (`I/O tag <n> (<cid>) opcode ... QID <n> timeout, aborting ...`)
and read differently again over fabrics. Each is the same fault as its older or plainer
wording, with the same finding, read live and from every saved shape. The sources are in
tests/fixtures/kernel_log/corpus/SOURCES.md (07-host-faults).
"""

from __future__ import annotations

import pytest

from agent.contracts.model import RepairAction, Severity
from tests.support.klog_shapes import SHAPES
from tests.test_kernel_log_records import BOTH
from tests.test_kernel_log_stalls import Line, assert_in_shape, assert_line

R = RepairAction
IO = "io_error"
NVME = "nvme_error"


def _failed(status: str, device: str, text: str) -> Line:
    return Line(
        text, IO, device, Severity.CRITICAL, R.CHECK_STORAGE, attributes={"block_error": status}
    )


# block/blk-core.c: `blk_print_req_error` (5.x on: `%s error, dev %s, sector %llu op
# 0x%x:(%s) flags 0x%x phys_seg %u prio class %u`), `print_req_error` (4.13-5.x: `%s: %s
# error, dev %s, sector %llu`), `blk_update_request` (up to 4.12, errno to a word) and
# `end_request` before it; the words are blk_errors[].name (BLK_STS_NEXUS became
# BLK_STS_RESV_CONFLICT in 6.5).
BLOCK = [
    _failed(
        "critical medium",
        "sdb",
        "critical medium error, dev sdb, sector 1953524992 op 0x0:(READ) flags 0x80700 "
        "phys_seg 1 prio class 0",
    ),
    _failed(
        "critical medium",
        "nvme0n1",
        "blk_update_request: critical medium error, dev nvme0n1, sector 2048 op 0x0:(READ) "
        "flags 0x0 phys_seg 1 prio class 0",
    ),
    _failed("critical target", "sdc", "print_req_error: critical target error, dev sdc, sector 8"),
    _failed(
        "critical nexus", "sdd", "blk_update_request: critical nexus error, dev sdd, sector 99"
    ),
    _failed(
        "critical space allocation",
        "dm-3",
        "critical space allocation error, dev dm-3, sector 4096 op 0x1:(WRITE) flags 0x8800 "
        "phys_seg 16 prio class 2",
    ),
    _failed(
        "recoverable transport",
        "sde",
        "recoverable transport error, dev sde, sector 8 op 0x1:(WRITE) flags 0x0 phys_seg 1 "
        "prio class 0",
    ),
    _failed(
        "timeout",
        "nvme1n1",
        "timeout error, dev nvme1n1, sector 0 op 0x0:(READ) flags 0x0 phys_seg 1 prio class 0",
    ),
    _failed(
        "protection",
        "sdf",
        "protection error, dev sdf, sector 16 op 0x0:(READ) flags 0x0 phys_seg 1 prio class 0",
    ),
    _failed(
        "device offline",
        "sdg",
        "device offline error, dev sdg, sector 0 op 0x1:(WRITE) flags 0x800 phys_seg 1 prio "
        "class 0",
    ),
    _failed("critical medium", "sdb", "end_request: critical medium error, dev sdb, sector 12345"),
]

# drivers/nvme/host/pci.c nvme_timeout: up to 5.x `I/O %d QID %d timeout, aborting` (also
# `, reset controller`, `, completion polled`, `, disable controller`); 6.x `I/O tag %d (%04x)
# QID %d timeout, ...` and, where the opcode is known, `I/O tag %d (%04x) opcode %#x (%s) QID
# %d timeout, aborting req_op:%s(%u) size:%u`. Over fabrics: tcp.c `queue %d: timeout request
# %#x type %d` (5.x), then `I/O tag %d (%04x) type %d opcode %#x (%s) QID %d timeout`; rdma.c
# `I/O tag %d (%04x) opcode %#x (%s) QID %d timeout`.
NVME_LINES = [
    Line(text, NVME, device, Severity.WARNING, R.CHECK_STORAGE)
    for device, text in [
        (
            "nvme0",
            "nvme nvme0: I/O tag 283 (b11b) opcode 0x2 (Read) QID 7 timeout, aborting "
            "req_op:READ(0) size:131072",
        ),
        (
            "nvme0",
            "nvme nvme0: I/O tag 283 (b11b) opcode 0x1 (Write) QID 7 timeout, reset controller",
        ),
        ("nvme1", "nvme nvme1: I/O tag 12 (000c) QID 0 timeout, completion polled"),
        ("nvme2", "nvme nvme2: I/O tag 5 (1005) QID 3 timeout, disable controller"),
        ("nvme2", "nvme nvme2: I/O 5 QID 3 timeout, disable controller"),
        ("nvme3", "nvme nvme3: I/O tag 40 (2028) type 4 opcode 0x2 (Read) QID 2 timeout"),
        ("nvme3", "nvme nvme3: I/O tag 40 (2028) opcode 0x1 (Write) QID 2 timeout"),
        ("nvme4", "nvme nvme4: queue 2: timeout request 0x28 type 4"),
    ]
]

LINES = BLOCK + NVME_LINES

QUIET = [
    # the same block-layer line for a request the device does not support or the caller
    # retries: no fault of the disk
    "operation not supported error, dev loop0, sector 0 op 0x9:(WRITE_ZEROES) flags 0x800 "
    "phys_seg 0 prio class 0",
    "nonblocking retry error, dev sda, sector 8 op 0x0:(READ) flags 0x0 phys_seg 1 prio class 0",
    "nvme nvme0: 32/0/0 default/read/poll queues",
    "nvme nvme0: pci function 0000:01:00.0",
]


@BOTH
@pytest.mark.parametrize("line", LINES, ids=[line.text[:60] for line in LINES])
def test_line(way: object, line: Line) -> None:
    assert_line(way, line)


@pytest.mark.parametrize("shape", SHAPES)
def test_every_line_in_every_saved_shape(shape: str) -> None:
    assert_in_shape(shape, LINES)


@BOTH
@pytest.mark.parametrize("line", QUIET)
def test_quiet(way: object, line: str) -> None:
    assert callable(way)
    assert way(line) == []
