"""What the kernel says when a job dies or slows for a reason on the host, not the GPU (class 13
of the corpus): a process killed for corrupt host memory, kernel allocations that fail, a
worker pool that stopped, connection tracking or TCP out of room, a process's own crash
(in libcuda, in NCCL), a clock marked unstable, and a NIC's cable or transceiver. Each wording
is the kernel's or the driver's in the versions named in
tests/fixtures/kernel_log/corpus/SOURCES.md (class 13).
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.contracts.collector import MemoryKeyValueStore
from agent.contracts.model import RepairAction, Severity
from collectors.kernel_log.kmsg import KmsgReader, OsKmsgIO
from collectors.kernel_log.matchers import KINDS, Finding, MatcherSet
from tests.support.klog_shapes import SHAPES
from tests.test_kernel_log_records import BOTH
from tests.test_kernel_log_stalls import Line, assert_in_shape, assert_line

R = RepairAction
MEMORY = "memory_error"
PRESSURE = "memory_pressure"
LOCKUP = "cpu_lockup"
DROPS = "network_drops"
CRASH = "process_crash"
CLOCK = "clock_unstable"
NET = "network_link"

LINES = [
    # mm/memory-failure.c kill_proc: 5.3+, 4.8-4.19, before 4.8, 3.0, and the unmap failure
    Line(
        "Memory failure: 0x1a2b3c: Sending SIGBUS to python3:48211 due to hardware memory "
        "corruption",
        MEMORY,
        "",
        Severity.CRITICAL,
        R.HARDWARE_INSPECTION,
        attributes={"process": "python3", "pid": 48211, "page_frame": "0x1a2b3c"},
    ),
    Line(
        "Memory failure: 0x1a2b3c: Killing pt_main_thread:4321 due to hardware memory corruption",
        MEMORY,
        "",
        Severity.CRITICAL,
        R.HARDWARE_INSPECTION,
        attributes={"process": "pt_main_thread", "pid": 4321},
    ),
    Line(
        "MCE 0x3f2a1c: Killing python3:4321 due to hardware memory corruption",
        MEMORY,
        "",
        Severity.CRITICAL,
        R.HARDWARE_INSPECTION,
    ),
    Line(
        "MCE 0x3f2a1c: Killing python3:4321 early due to hardware memory corruption",
        MEMORY,
        "",
        Severity.CRITICAL,
        R.HARDWARE_INSPECTION,
    ),
    Line(
        "Memory failure: 0x1a2b3c: forcibly killing a:b:77 because of failure to unmap "
        "corrupted page",
        MEMORY,
        "",
        Severity.CRITICAL,
        R.HARDWARE_INSPECTION,
        attributes={"process": "a:b", "pid": 77},
    ),
    # action_result: 4.8+, 4.2-4.7, before
    Line(
        "Memory failure: 0x1a2b3c: recovery action for dirty LRU page: Recovered",
        MEMORY,
        "",
        Severity.WARNING,
        R.HARDWARE_INSPECTION,
        attributes={"page_type": "dirty LRU page", "recovery": "recovered"},
    ),
    Line(
        "MCE 0x1a2b3c: recovery action for huge page: Delayed",
        MEMORY,
        "",
        Severity.WARNING,
        R.HARDWARE_INSPECTION,
        attributes={"recovery": "delayed"},
    ),
    Line(
        "Memory failure: 0x8f00d2: recovery action for reserved kernel page: Ignored",
        MEMORY,
        "",
        Severity.WARNING,
        R.HARDWARE_INSPECTION,
        attributes={"recovery": "ignored"},
    ),
    Line(
        "Memory failure: 0x8f00d2: recovery action for already poisoned: Failed",
        MEMORY,
        "",
        Severity.CRITICAL,
        R.HARDWARE_INSPECTION,
        attributes={"recovery": "failed", "page_type": "already poisoned"},
    ),
    Line(
        "MCE 0x3f2a1c: dirty LRU page recovery: Failed",
        MEMORY,
        "",
        Severity.CRITICAL,
        R.HARDWARE_INSPECTION,
        attributes={"page_type": "dirty LRU"},
    ),
    # mm/page_alloc.c warn_alloc: 5.x one line, 4.11-4.19, 4.6-4.10, 3.0-4.5, before 3.0; the
    # stall warning of 4.9-4.12; mm/vmalloc.c's reasons before and after 5.13
    Line(
        "qemu-kvm: page allocation failure: order:4, mode:0x40dc0(GFP_KERNEL|__GFP_COMP|"
        "__GFP_ZERO), nodemask=(null),cpuset=/,mems_allowed=0-1",
        PRESSURE,
        "",
        Severity.WARNING,
        R.INVESTIGATE,
        attributes={
            "process": "qemu-kvm",
            "order": 4,
            "gfp_mode": "0x40dc0",
            "gfp_flags": "GFP_KERNEL|__GFP_COMP|__GFP_ZERO",
        },
    ),
    Line(
        "kworker/u16:3: page allocation failure: order:0, mode:0x1080020(GFP_ATOMIC), "
        "nodemask=(null)",
        PRESSURE,
        "",
        Severity.WARNING,
        R.INVESTIGATE,
        attributes={"process": "kworker/u16:3", "order": 0},
    ),
    Line(
        "java: page allocation failure: order:4, mode:0x2040d0",
        PRESSURE,
        "",
        Severity.WARNING,
        R.INVESTIGATE,
        attributes={"gfp_mode": "0x2040d0"},
    ),
    Line(
        "swapper: page allocation failure. order:1, mode:0x20",
        PRESSURE,
        "",
        Severity.WARNING,
        R.INVESTIGATE,
        attributes={"order": 1},
    ),
    Line(
        "python3: page allocation stalls for 10232ms, order:0, mode:0x24201ca(GFP_HIGHUSER_MOVABLE)",
        PRESSURE,
        "",
        Severity.WARNING,
        R.INVESTIGATE,
        attributes={"stalled_ms": 10232, "order": 0},
    ),
    Line(
        "modprobe: vmalloc: allocation failure: 4198400 bytes, mode:0xcc0(GFP_KERNEL), "
        "nodemask=(null),cpuset=/,mems_allowed=0",
        PRESSURE,
        "",
        Severity.WARNING,
        R.INVESTIGATE,
        attributes={"bytes": 4198400},
    ),
    Line(
        "insmod: vmalloc error: size 8392704, vm_struct allocation failed, mode:0xdc0(GFP_KERNEL|"
        "__GFP_ZERO), nodemask=(null),cpuset=/,mems_allowed=0",
        PRESSURE,
        "",
        Severity.WARNING,
        R.INVESTIGATE,
        attributes={"bytes": 8392704, "process": "insmod"},
    ),
    # kernel/workqueue.c: a pool of one CPU, an unbound pool (no node), a BH pool (6.12)
    Line(
        "BUG: workqueue lockup - pool cpus=3 node=0 flags=0x0 nice=0 stuck for 42s!",
        LOCKUP,
        "",
        Severity.WARNING,
        R.INVESTIGATE,
        attributes={"cpus": "3", "stuck_seconds": 42},
    ),
    Line(
        "BUG: workqueue lockup - pool cpus=0-7 flags=0x4 nice=0 stuck for 31s!",
        LOCKUP,
        "",
        Severity.WARNING,
        R.INVESTIGATE,
        attributes={"cpus": "0-7"},
    ),
    Line(
        "BUG: workqueue lockup - pool cpus=2 node=0 flags=0x5 bh-hi stuck for 35s!",
        LOCKUP,
        "",
        Severity.WARNING,
        R.INVESTIGATE,
    ),
    # nf_conntrack: from about 4.8, 3.10-4.6, 3.0
    Line(
        "nf_conntrack: nf_conntrack: table full, dropping packet",
        DROPS,
        "",
        Severity.WARNING,
        R.INVESTIGATE,
    ),
    Line("nf_conntrack: table full, dropping packet", DROPS, "", Severity.WARNING, R.INVESTIGATE),
    Line("nf_conntrack: table full, dropping packet.", DROPS, "", Severity.WARNING, R.INVESTIGATE),
    # net/ipv4/tcp.c: 3.2+, and 3.0
    Line(
        "TCP: out of memory -- consider tuning tcp_mem",
        DROPS,
        "",
        Severity.WARNING,
        R.INVESTIGATE,
    ),
    Line("Out of socket memory", DROPS, "", Severity.WARNING, R.INVESTIGATE),
    Line("TCP: too many orphaned sockets", DROPS, "", Severity.WARNING, R.INVESTIGATE),
    Line("TCP: too many of orphaned sockets", DROPS, "", Severity.WARNING, R.INVESTIGATE),
    # arch/x86/mm/fault.c: 6.1-6.11 (likely on CPU), 6.12 (the file offset), before 6.1, and
    # a fault outside any file
    Line(
        "python3[9876]: segfault at 18 ip 00007f3b2c1d2e3f sp 00007ffc1a2b3c40 error 4 in "
        "libcuda.so.550.54.15[7f3b2c000000+195000] likely on CPU 5 (core 5, socket 0)",
        CRASH,
        "",
        Severity.WARNING,
        R.INVESTIGATE,
        attributes={
            "process": "python3",
            "pid": 9876,
            "object": "libcuda.so.550.54.15",
            "cpu": 5,
            "fault": "segfault",
        },
    ),
    Line(
        "pt_main_thread[4242]: segfault at 0 ip 00007f1e2d3c4b5a sp 00007ffd11223340 error 6 in "
        "libnccl.so.2.21.5[1139,7f1e2d300000+a0000] likely on CPU 3 (core 3, socket 0)",
        CRASH,
        "",
        Severity.WARNING,
        R.INVESTIGATE,
        attributes={"object": "libnccl.so.2.21.5", "pid": 4242},
    ),
    # captured from /dev/kmsg on the development machine (kernel 6.18), a NULL dereference
    Line(
        "python3[17022]: segfault at 0 ip 00007f2ee9b85ad8 sp 00007ffd03c90028 error 4 in "
        "libc.so.6[167ad8,7f2ee9a44000+156000] likely on CPU 1 (core 1, socket 0)",
        CRASH,
        "",
        Severity.WARNING,
        R.INVESTIGATE,
        attributes={"object": "libc.so.6", "pid": 17022, "cpu": 1, "fault_address": "0"},
    ),
    Line(
        "a.out[4321]: segfault at 0 ip 000055d5e1a9a139 sp 00007ffd2b3c4d50 error 6 in "
        "a.out[55d5e1a9a000+1000]",
        CRASH,
        "",
        Severity.WARNING,
        R.INVESTIGATE,
        attributes={"object": "a.out"},
    ),
    Line(
        "python3[77]: segfault at 8 ip 00007f0000001000 sp 00007ffd2b3c4d50 error 14",
        CRASH,
        "",
        Severity.WARNING,
        R.INVESTIGATE,
        attributes={"pid": 77, "fault_address": "8"},
    ),
    # arch/x86/kernel/traps.c: 5.3+, up to 4.19, a trap, 6.12's offset
    Line(
        "traps: pt_main_thread[777] general protection fault ip:7f8a1b2c3d4e sp:7ffc9e8d7c60 "
        "error:0 in libnccl.so.2[7f8a1b200000+1e7000]",
        CRASH,
        "",
        Severity.WARNING,
        R.INVESTIGATE,
        attributes={"fault": "general protection", "object": "libnccl.so.2", "pid": 777},
    ),
    Line(
        "traps: python3[1234] general protection ip:7f8a1b2c3d4e sp:7ffc9e8d7c60 error:0 in "
        "libc-2.27.so[7f8a1b200000+1e7000]",
        CRASH,
        "",
        Severity.WARNING,
        R.INVESTIGATE,
    ),
    Line(
        "traps: a.out[2345] trap divide error ip:401136 sp:7ffe5c8a8e50 error:0 in "
        "a.out[1136,401000+1000]",
        CRASH,
        "",
        Severity.WARNING,
        R.INVESTIGATE,
        attributes={"fault": "divide error"},
    ),
    Line(
        "traps: app[777] trap invalid opcode ip:7f1e2d3c4b5a sp:7ffd11223340 error:0 in "
        "libfoo.so[7f1e2d300000+a0000]",
        CRASH,
        "",
        Severity.WARNING,
        R.INVESTIGATE,
        attributes={"fault": "invalid opcode"},
    ),
    # kernel/time/clocksource.c: 4.6+, 4.4, before 4.4; arch/x86/kernel/tsc.c
    Line(
        "clocksource: timekeeping watchdog on CPU12: Marking clocksource 'tsc' as unstable "
        "because the skew is too large:",
        CLOCK,
        "tsc",
        Severity.WARNING,
        R.INVESTIGATE,
        attributes={"cpu": 12},
    ),
    Line(
        "clocksource: timekeeping watchdog: Marking clocksource 'tsc' as unstable because the "
        "skew is too large:",
        CLOCK,
        "tsc",
        Severity.WARNING,
        R.INVESTIGATE,
    ),
    Line(
        "Clocksource tsc unstable (delta = -95490077 ns)",
        CLOCK,
        "tsc",
        Severity.WARNING,
        R.INVESTIGATE,
        attributes={"skew_ns": -95490077},
    ),
    Line(
        "tsc: Marking TSC unstable due to clocksource watchdog",
        CLOCK,
        "TSC",
        Severity.WARNING,
        R.INVESTIGATE,
        attributes={"reason": "clocksource watchdog"},
    ),
    # mlx5 port module events: upstream 5.3+ (the error through mlx5_core_err), MLNX_OFED
    # 4.5-4.6, upstream 4.10-4.19 (no prefix), plug and unplug
    Line(
        "mlx5_core 0000:3b:00.0: port_module:254:(pid 0): Port module event[error]: module 0, "
        "Cable error, High Temperature",
        NET,
        "0000:3b:00.0",
        Severity.WARNING,
        R.INVESTIGATE,
        attributes={"module": 0, "module_error": "High Temperature"},
    ),
    Line(
        "mlx5_core 0000:3b:00.1: mlx5_port_module_event:1131:(pid 0): Port module event[error]: "
        "module 1, Cable error, Bus stuck(I2C or data shorted)",
        NET,
        "0000:3b:00.1",
        Severity.WARNING,
        R.INVESTIGATE,
        attributes={"module": 1, "module_error": "Bus stuck(I2C or data shorted)"},
    ),
    Line(
        "mlx5_core 0000:3b:00.0: Port module event[error]: module 0, Cable error, One or more "
        "network ports have been powered down due to insufficient/unadvertised power on the PCIe "
        "slot",
        NET,
        "0000:3b:00.0",
        Severity.WARNING,
        R.INVESTIGATE,
    ),
    Line(
        "mlx5_core 0000:3b:00.0: Port module event: module 0, Cable unplugged",
        NET,
        "0000:3b:00.0",
        Severity.WARNING,
        R.INVESTIGATE,
        attributes={"module_status": "Cable unplugged"},
    ),
    Line(
        "mlx5_core 0000:3b:00.0: Port module event: module 0, Cable plugged",
        NET,
        "0000:3b:00.0",
        Severity.INFO,
        R.NONE,
        (NET,),
    ),
]

QUIET = [
    # what the same code and neighbours also say that is no fault
    "Memory failure: 0x1a2b3c: already hardware poisoned",
    "Unpoison: Software-unpoisoned page 0x1a2b3c",
    "Soft offline: 0x1a2b3c: page migration failed 1, type 0x17ffffc0000000()",
    "Mem-Info:",
    "workqueue: round-robin CPU selection forced, expect performance impact",
    "Showing busy workqueues and worker pools:",
    "nf_conntrack: default automatic helper assignment has been turned off for security reasons",
    "TCP: Hash tables configured (established 524288 bind 65536)",
    "TCP: request_sock_TCP: Possible SYN flooding on port 22. Sending cookies.",
    "clocksource: Switched to clocksource tsc",
    "clocksource: tsc: mask: 0xffffffffffffffff max_cycles: 0x2b3e459bf4c, max_idle_ns: "
    "440795289890 ns",
    "tsc: Refined TSC clocksource calibration: 2999.999 MHz",
    "clocksource:                       'hpet' wd_nsec: 505376421 wd_now: 3c1f0a2 wd_last: "
    "3410b97 mask: ffffffff",
    "mlx5_core 0000:3b:00.0: firmware version: 28.39.1002",
    "mlx5_core 0000:3b:00.0: Port module event: module 0, Cable",
    "Code: 48 89 e5 48 c7 45 f8 00 00 00 00 48 8b 45 f8 <c7> 00 2a 00 00 00",
    "traps: PANIC: double fault, error_code: 0x0",
    "python3[9876]: segfault",
    "systemd-journald[512]: Under memory pressure, flushing caches.",
]


class TestLines:
    @BOTH
    @pytest.mark.parametrize("line", LINES, ids=[line.text[:60] for line in LINES])
    def test_line(self, way: object, line: Line) -> None:
        assert_line(way, line)

    @pytest.mark.parametrize("shape", SHAPES)
    def test_every_line_in_every_saved_shape(self, shape: str) -> None:
        assert_in_shape(shape, LINES)

    @BOTH
    @pytest.mark.parametrize("line", QUIET)
    def test_quiet(self, way: object, line: str) -> None:
        assert callable(way)
        assert way(line) == []


def test_every_new_kind_has_its_repair_and_is_counted() -> None:
    from collectors.kernel_log.host import HOST_KINDS, HOST_REPAIR

    for kind in (PRESSURE, DROPS, CRASH, CLOCK):
        assert kind in HOST_KINDS
        assert kind in KINDS
        assert HOST_REPAIR[kind] is R.INVESTIGATE


# -- a real crash, read from this machine's /dev/kmsg ---------------------------------------------


def _segfaults_logged() -> bool:
    try:
        os.close(os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK))
        return Path("/proc/sys/debug/exception-trace").read_text().strip() == "1"
    except OSError:
        return False


def _no_core() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


@pytest.mark.skipif(not _segfaults_logged(), reason="no readable /dev/kmsg or exception-trace off")
def test_a_real_segfault_read_from_dev_kmsg() -> None:
    """A child that dereferences NULL: the kernel's own record of it (facility 0, this
    machine's kernel's wording) is a process_crash naming the child and the library. The
    record stays in this machine's kernel log: tests that judge a host read their own log
    (tests/support/diag.py)."""
    state = MemoryKeyValueStore()
    boot = Path("/proc/sys/kernel/random/boot_id")
    reader = KmsgReader(Path("/dev/kmsg"), boot, state, io=OsKmsgIO())
    reader.commit(reader.read())
    child = subprocess.Popen(
        [sys.executable, "-c", "import ctypes; ctypes.string_at(0)"],
        preexec_fn=_no_core,  # noqa: PLW1509 - only the child's core limit, before exec
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    assert child.wait(timeout=30) == -signal.SIGSEGV
    matchers = MatcherSet()
    found: list[Finding] = []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not found:
        for record in reader.read().records:
            found += [f for f in matchers.feed(record) if f.kind == CRASH]
        time.sleep(0.05)
    reader.close()
    assert found, "the kernel logged no segfault (printk_ratelimit may have held it back)"
    crash = found[-1].to_dict()
    assert crash["fault"] == "segfault"
    assert crash["severity"] == "warning"
    assert crash["pid"] == child.pid
    assert str(crash["process"]).startswith("python")
    assert "libc" in str(crash.get("object", "")), crash
