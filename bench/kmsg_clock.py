"""How far a /dev/kmsg record's own stamp is from CLOCK_MONOTONIC when it is logged: the error
of the wall-clock time the kernel_log collector gives a record (boot time from the monotonic
clock, plus the stamp), and so of judging whether a record was logged within a pause
(docs/pause.md, "Kernel-log findings during a pause").

The kernel stamps printk records with local_clock(), which NTP does not steer; CLOCK_MONOTONIC
is steered. This writes a record into /dev/kmsg (root), reads it back and prints, per probe,
the stamp minus CLOCK_MONOTONIC at the write, beside the uptime that the difference grew over.

    sudo python bench/kmsg_clock.py [--probes 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def probe(fd: int, n: int) -> tuple[float, float]:
    """(seconds the record's stamp lies from CLOCK_MONOTONIC, the monotonic clock then)."""
    tag = f"gpuwarden kmsg clock probe {os.getpid()}-{n}"
    written = time.clock_gettime(time.CLOCK_MONOTONIC)
    os.write(fd, f"<6>{tag}\n".encode())
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        try:
            record = os.read(fd, 8192).decode(errors="replace")
        except BlockingIOError:
            time.sleep(0.005)
            continue
        header, _, message = record.partition(";")
        if message.startswith(tag):
            return int(header.split(",")[2]) / 1e6 - written, written
    raise TimeoutError("the probe record did not come back from /dev/kmsg")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--probes", type=int, default=5)
    args = parser.parse_args()
    fd = os.open("/dev/kmsg", os.O_RDWR | os.O_NONBLOCK)
    try:
        os.lseek(fd, 0, os.SEEK_END)
        results = [probe(fd, n) for n in range(args.probes)]
    finally:
        os.close(fd)
    offsets = [o for o, _ in results]
    uptime = results[-1][1]
    median = statistics.median(offsets)
    print(f"{os.uname().nodename}, kernel {os.uname().release}")
    print("| uptime (s) | stamp - CLOCK_MONOTONIC, median (ms) | min (ms) | max (ms) | ppm |")
    print("| --- | --- | --- | --- | --- |")
    print(
        f"| {uptime:.0f} | {median * 1e3:+.3f} | {min(offsets) * 1e3:+.3f} | "
        f"{max(offsets) * 1e3:+.3f} | {median / uptime * 1e6:+.3f} |"
    )


if __name__ == "__main__":
    main()
