"""Every facility a process can write into /dev/kmsg, as the real `dmesg -r` and `dmesg -x`
print it, parsed: a user-space look-alike of the driver's Xid line is never the kernel's
unless the tool printed it exactly as it prints the kernel's own records.

A write's `<N>` prefix (N up to 255*8+7) sets facility N >> 3 & 0xff, 0 becoming 1 (printk.c
`devkmsg_write`). util-linux dmesg then reads the facility through libc's `LOG_FAC`, which
keeps 7 bits (128 to 255 print as 0 to 127), names only the facilities it knows (`-x`: none
for the others, the line then has no prefix at all), and before 2.40 writes `-r`'s number as
`facility | level`, unshifted (`<5>` for a user's `<12>`; util-linux commit fa6ac102d), and
`<-1>` (2.40 on: `<-8>` to `<-1>`) for a facility it has no name for.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import uuid

import pytest

from collectors.kernel_log.matchers import MatcherSet
from collectors.kernel_log.parse import parse_line
from tests.support.kmsg import write_device

LEVEL = 3  # the Xid line's level (KERN_ERR)
FACILITIES = range(256)
BOUNDARIES = (0, 1, 11, 12, 23, 24, 31, 127, 128, 129, 255)


def _writable() -> bool:
    return os.geteuid() == 0 and os.access("/dev/kmsg", os.W_OK) and bool(shutil.which("dmesg"))


pytestmark = pytest.mark.skipif(not _writable(), reason="needs root, /dev/kmsg and dmesg")


def _xid(tag: str, facility: int) -> str:
    return f"NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name={tag}-f{facility}, GPU has fallen off the bus."


@pytest.fixture(scope="module")
def written() -> str:
    """One record per facility, each with the driver's Xid words; the tag names them."""
    tag = "fac" + uuid.uuid4().hex[:10]
    for facility in FACILITIES:
        write_device(f"<{facility * 8 + LEVEL}>{_xid(tag, facility)}\n")
    return tag


def _printed(tag: str, *args: str) -> dict[int, str]:
    """facility -> the line the real dmesg printed for it."""
    out = subprocess.run(["dmesg", *args], capture_output=True, text=True, check=True).stdout
    lines: dict[int, str] = {}
    for line in out.splitlines():
        found = re.search(rf"name={tag}-f(\d+),", line)
        if found is not None:
            lines[int(found[1])] = line
    assert set(lines) == set(FACILITIES), sorted(set(FACILITIES) - set(lines))[:10]
    return lines


# What dmesg prints before the stamp for the kernel's own records (facility 0, any level): a
# line that starts so cannot be told from the kernel's by any reader.
KERNEL_PREFIX = {"-r": re.compile(r"<[0-7]>\["), "-x": re.compile(r"kern  :[a-z]+ *: \[")}


DECODED = re.compile(r"[a-z0-9]+ *:[a-z]+ *: ")


@pytest.mark.parametrize("option", ["-r", "-x"])
@pytest.mark.parametrize("facility", FACILITIES, ids=lambda f: f"facility-{f}")
def test_a_written_record_is_not_the_kernels(option: str, facility: int, written: str) -> None:
    line = _printed_cache(written, option)[facility]
    record = parse_line(line, 1)
    assert record is not None
    assert record.message.startswith("NVRM: Xid"), record
    findings = list(MatcherSet().scan([record]))
    if KERNEL_PREFIX[option].match(line):
        pytest.skip(f"dmesg {option} prints facility {facility} as the kernel's: {line[:24]!r}")
    if option == "-x" and not DECODED.match(line):
        # No name, so no prefix: the line is plain dmesg's, which carries no facility and is
        # taken as given (parse.py's docstring): a limit of this shape, said, not fixed.
        pytest.xfail(f"dmesg -x has no name for facility {facility}: {line[:20]!r}")
    assert not record.from_kernel, (line, record)
    assert findings == [], line


_CACHE: dict[tuple[str, str], dict[int, str]] = {}


def _printed_cache(tag: str, option: str) -> dict[int, str]:
    if (tag, option) not in _CACHE:
        _CACHE[tag, option] = _printed(tag, option)
    return _CACHE[tag, option]


@pytest.mark.parametrize("facility", BOUNDARIES)
def test_the_raw_record_always_tells(facility: int, written: str) -> None:
    """`cat /dev/kmsg` (what the agent reads live) keeps the facility the kernel stored:
    every written record is user space's, the folded and unnamed ones included."""
    fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    lines: dict[int, str] = {}
    try:
        while True:
            try:
                data = os.read(fd, 8192).decode("utf-8", errors="replace")
            except BlockingIOError:
                break
            except BrokenPipeError:
                continue
            found = re.search(rf"name={written}-f(\d+),", data)
            if found is not None:
                lines[int(found[1])] = data.split("\n", 1)[0]
    finally:
        os.close(fd)
    record = parse_line(lines[facility], 1)
    assert record is not None
    assert record.facility == (facility or 1)
    assert not record.from_kernel
