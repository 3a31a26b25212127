"""A stand-in for /dev/kmsg with its read semantics, for tests (this machine's ring holds no Xids).

`FakeKmsg` implements `collectors.kmsg.KmsgIO`: each read returns one whole record; a buffer
shorter than the record fails with EINVAL; the end of the buffer is EAGAIN (BlockingIOError);
when records an open descriptor has not read yet are overwritten, the next read fails once with
EPIPE and the descriptor moves on to the oldest record left, as the kernel does.
"""

from __future__ import annotations

import bisect
import errno
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agent.contracts.collector import CollectorSpec
from collectors.kernel_log.collector import KernelLogCollector, KernelLogSettings

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "kernel_log"
H200_CAPTURE = FIXTURES / "h200-kmsg-records.txt"
"""Raw /dev/kmsg records captured on the lent H200 (driver 580.159.04), copied from the shared
fixtures (fixtures/h200/kmsg-records.txt) so the tests run on any checkout."""


def escape_kmsg(text: str) -> str:
    """Escape as the kernel does: bytes outside printable ASCII and the backslash as \\xNN."""
    out = []
    for byte in text.encode("utf-8"):
        if byte == 0x5C or byte < 0x20 or byte >= 0x7F:
            out.append(f"\\x{byte:02x}")
        else:
            out.append(chr(byte))
    return "".join(out)


def kmsg_record(
    seq: int,
    message: str,
    *,
    level: int = 4,
    facility: int = 0,
    usec: int | None = None,
    fields: Sequence[tuple[str, str]] = (),
) -> bytes:
    """One record as read() returns it: header line, then ` KEY=value` lines."""
    usec = seq * 1000 if usec is None else usec
    lines = [f"{facility * 8 + level},{seq},{usec},-;{escape_kmsg(message)}"]
    lines += [f" {key}={escape_kmsg(value)}" for key, value in fields]
    return ("\n".join(lines) + "\n").encode()


def sequence_gaps(records: Sequence[bytes]) -> int:
    """Sequence numbers missing between the first and last record."""
    seqs = [record_seq(r) for r in records]
    return seqs[-1] - seqs[0] + 1 - len(seqs) if seqs else 0


def capture_records(path: Path = H200_CAPTURE) -> list[bytes]:
    """The H200 capture's records, each with its continuation lines, as read() returns them."""
    records: list[list[str]] = []
    for line in path.read_bytes().decode("utf-8").split("\n")[:-1]:  # only \n ends a line
        if line.startswith(" ") and records:
            records[-1].append(line)
        else:
            records.append([line])
    return [("\n".join(r) + "\n").encode() for r in records]


_SEQ = re.compile(rb"^\d+,(\d+),")


def record_seq(record: bytes) -> int:
    match = _SEQ.match(record)
    assert match is not None, record[:40]
    return int(match[1])


@dataclass
class _Descriptor:
    position: int  # the sequence number of the next record to read


@dataclass
class FakeKmsg:
    """The kernel's ring buffer, as far as a reader can tell."""

    records: list[bytes] = field(default_factory=list)
    fds: dict[int, _Descriptor] = field(default_factory=dict)
    reads: int = 0
    einval: int = 0
    opened: int = 0
    _next_fd: int = 100

    @classmethod
    def with_records(cls, records: Iterable[bytes]) -> FakeKmsg:
        return cls(records=list(records))

    @property
    def next_seq(self) -> int:
        return record_seq(self.records[-1]) + 1 if self.records else 0

    def write(self, message: str, **kwargs: object) -> int:
        """Append a record (as the kernel would) and return its sequence number."""
        seq = self.next_seq
        self.records.append(kmsg_record(seq, message, **kwargs))  # type: ignore[arg-type]
        return seq

    def overwrite_oldest(self, count: int) -> None:
        """The ring buffer wrapped: the oldest `count` records are gone."""
        del self.records[:count]

    # -- KmsgIO --------------------------------------------------------------------------------

    def open(self, path: str) -> int:
        fd = self._next_fd
        self._next_fd += 1
        self.opened += 1
        first = record_seq(self.records[0]) if self.records else 0
        self.fds[fd] = _Descriptor(first)
        return fd

    def read(self, fd: int, size: int) -> bytes:
        self.reads += 1
        desc = self.fds[fd]
        if not self.records or desc.position >= self.next_seq:
            raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
        oldest = record_seq(self.records[0])
        if desc.position < oldest:
            desc.position = oldest
            raise OSError(errno.EPIPE, "Broken pipe")
        # The capture has gaps in its sequence numbers (records left out when it was saved):
        # the next record is the first one at or after the position.
        index = bisect.bisect_left([record_seq(r) for r in self.records], desc.position)
        record = self.records[index]
        if len(record) > size:
            self.einval += 1
            raise OSError(errno.EINVAL, "Invalid argument")
        desc.position = record_seq(record) + 1
        return record

    def close(self, fd: int) -> None:
        del self.fds[fd]


def write_boot_id(path: Path, boot_id: str) -> Path:
    path.write_text(boot_id + "\n", encoding="ascii")
    return path


def kernel_log_spec(kmsg: FakeKmsg) -> CollectorSpec[KernelLogSettings]:
    """The kernel_log collector as the registry makes it, reading `kmsg` for /dev/kmsg."""
    return CollectorSpec(
        "kernel_log",
        "the kernel log on the stand-in",
        KernelLogSettings,
        lambda settings, deps: KernelLogCollector(settings, deps, io=kmsg),
    )


def write_device(text: str, device: str = "/dev/kmsg") -> None:
    """Write one record into the real /dev/kmsg (root only), as `echo text > /dev/kmsg` does:
    a descriptor of its own each time, since the kernel rate-limits writes per open file
    (printk.c `devkmsg_write`, 10 in 5 seconds with printk_devkmsg=ratelimit)."""
    fd = os.open(device, os.O_WRONLY)
    try:
        os.write(fd, text.encode("utf-8"))
    finally:
        os.close(fd)
