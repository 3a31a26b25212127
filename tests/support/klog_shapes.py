"""One kernel-log message written out in every shape it is saved in, for the parser's tests.

Each shape is what the named tool prints for a record (the facts are in
tests/fixtures/kernel_log/corpus/SOURCES.md): raw /dev/kmsg, util-linux `dmesg` (plain, `-T`,
`-r`, `-x`, `--time-format iso`, `-t`), `journalctl -k` in its short output modes with and
without the host name, and rsyslog files. A message with an embedded newline comes out as the
tool writes it: dmesg and journalctl indent the following lines under the first, /dev/kmsg
escapes the newline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tests.support.kmsg import escape_kmsg

HOST = "gpu-host-17"
LEVELS = ("emerg", "alert", "crit", "err", "warn", "notice", "info", "debug")
FACILITIES = ("kern", "user", "mail", "daemon")


@dataclass(frozen=True)
class Record:
    """What the kernel (or a process writing into /dev/kmsg) logged."""

    message: str
    seq: int = 1
    usec: int = 5_123_456
    facility: int = 0
    level: int = 4
    pid: int | None = None
    """Set for a user-space process in the journal/syslog shapes (`ident[pid]:`)."""

    @property
    def from_kernel(self) -> bool:
        return self.facility == 0 and self.pid is None


def _secs(record: Record) -> str:
    return f"{record.usec // 1_000_000:5d}.{record.usec % 1_000_000:06d}"


def _indent(first: str, message: str) -> str:
    """The first line's prefix, then each further line of the message indented under it."""
    head, *rest = message.split("\n")
    pad = " " * len(first)
    return "\n".join([first + head, *(pad + line for line in rest)])


def _ident(record: Record) -> str:
    return "kernel" if record.pid is None else f"python3[{record.pid}]"


def kmsg(r: Record) -> str:
    return f"{r.facility * 8 + r.level},{r.seq},{r.usec},-;{escape_kmsg(r.message)}"


def dmesg(r: Record) -> str:
    return _indent(f"[{_secs(r)}] ", r.message)


def dmesg_t(r: Record) -> str:
    return _indent("[Sun Nov 29 18:10:02 2026] ", r.message)


def dmesg_r(r: Record) -> str:
    return _indent(f"<{r.facility * 8 + r.level}>[{_secs(r)}] ", r.message)


def dmesg_x(r: Record) -> str:
    prefix = f"{FACILITIES[r.facility]:<6}:{LEVELS[r.level]:<6}: [{_secs(r)}] "
    return _indent(prefix, r.message)


def dmesg_iso(r: Record) -> str:
    prefix = f"{FACILITIES[r.facility]:<6}:{LEVELS[r.level]:<6}: 2026-11-29T18:10:02,123456+00:00 "
    return _indent(prefix, r.message)


def dmesg_notime(r: Record) -> str:
    """`dmesg -t`: no prefix, so nothing to indent under: further lines start at column 0."""
    return r.message


def _journal(stamp: str, host: bool) -> Callable[[Record], str]:
    def render(r: Record) -> str:
        where = f" {HOST}" if host else ""
        return _indent(f"{stamp}{where} {_ident(r)}: ", r.message)

    return render


def syslog_kern_log(r: Record) -> str:
    """rsyslog's traditional format; the kernel's lines keep the kernel's own stamp in their
    text (kern.log, when rsyslog reads /proc/kmsg with printk times on)."""
    stamp = f"[{_secs(r)}] " if r.pid is None else ""
    return _indent(f"Nov 29 18:10:02 {HOST} {_ident(r)}: {stamp}", r.message)


SHAPES: dict[str, Callable[[Record], str]] = {
    "kmsg": kmsg,
    "dmesg": dmesg,
    "dmesg-T": dmesg_t,
    "dmesg-t": dmesg_notime,
    "dmesg-r": dmesg_r,
    "dmesg-x": dmesg_x,
    "dmesg-decode-iso": dmesg_iso,
    "journal-short": _journal("Nov 29 18:10:02", host=True),
    "journal-short-precise": _journal("Nov  9 18:10:02.123456", host=True),
    "journal-short-iso": _journal("2026-11-29T18:10:02+0000", host=True),
    "journal-short-iso-precise": _journal("2026-11-29T18:10:02.123456+00:00", host=True),
    "journal-short-full": _journal("Sun 2026-11-29 18:10:02 UTC", host=True),
    "journal-short-monotonic": _journal("[    5.123456]", host=True),
    "journal-short-unix": _journal("1764439802.123456", host=True),
    "journal-no-hostname": _journal("Nov 29 18:10:02", host=False),
    "journal-iso-no-hostname": _journal("2026-11-29T18:10:02+00:00", host=False),
    "journal-monotonic-no-hostname": _journal("[    5.123456]", host=False),
    "syslog-kern-log": syslog_kern_log,
    "syslog-rfc3339": _journal("2026-11-29T18:10:02.123456+00:00", host=True),
    "syslog-no-host": _journal("May 18 19:02:39", host=False),
}
"""Shape name -> the text a tool writes for one record (lines joined by \\n)."""

KERNEL_ONLY = frozenset({"dmesg", "dmesg-T", "dmesg-t", "journal-monotonic-no-hostname"})
"""Shapes in which a user-space record cannot be told apart, so tests write only the kernel's
records in them: dmesg without -r/-x carries no facility; and without a host, a monotonic
journal stamp before `python3[42]: ...` reads as dmesg (the kernel itself prints
`python3[42]: segfault at ...`)."""

INDENTS = frozenset(SHAPES) - {"kmsg", "dmesg-t"}
"""Shapes that write a message's further lines indented under its first."""


def render(shape: str, record: Record) -> str:
    return SHAPES[shape](record)
