"""System: memory, swap, load, uptime and boot id, read from /proc; reboots while the agent was away.

Every round persists the boot id and the time the agent was last alive. The first round after a
start compares the stored boot id with the current one: a different one means the host rebooted
since the agent last ran, and the event carries the previous boot id and the last time the agent
saw that boot alive (the reboot happened after it).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.contracts.collector import (
    CollectContext,
    CollectorDeps,
    CollectorSettings,
    CollectorSpec,
    JSONValue,
)
from agent.contracts.model import (
    Collection,
    Event,
    MetricFamily,
    MetricType,
    RepairAction,
    Sample,
    Severity,
)
from agent.contracts.settings import setting
from collectors._procfs import read_boot_id

G = MetricType.GAUGE

MEMORY_TOTAL = MetricFamily(
    "gpuwarden_memory_total_bytes", G, "MemTotal from /proc/meminfo", unit="bytes"
)
MEMORY_AVAILABLE = MetricFamily(
    "gpuwarden_memory_available_bytes", G, "MemAvailable from /proc/meminfo", unit="bytes"
)
SWAP_TOTAL = MetricFamily(
    "gpuwarden_swap_total_bytes", G, "SwapTotal from /proc/meminfo", unit="bytes"
)
SWAP_FREE = MetricFamily(
    "gpuwarden_swap_free_bytes", G, "SwapFree from /proc/meminfo", unit="bytes"
)
LOAD = MetricFamily("gpuwarden_load_average", G, "Load average over the window", ("window",))
UPTIME = MetricFamily(
    "gpuwarden_uptime_seconds", G, "Seconds since the host booted", unit="seconds"
)
BOOT_INFO = MetricFamily("gpuwarden_boot_info", G, "The current boot id, always 1", ("boot_id",))
PREVIOUS_BOOT_LAST_ALIVE = MetricFamily(
    "gpuwarden_previous_boot_last_alive_timestamp_seconds",
    G,
    "When the agent was last alive in the previous boot (present after a reboot was detected)",
    unit="seconds",
)

STATE_NAMESPACE = "system"


@dataclass(frozen=True)
class SystemSettings(CollectorSettings):
    proc_root: Path = setting(Path("/proc"), help="where /proc is mounted (fixture trees in tests)")


def read_meminfo(proc_root: Path) -> dict[str, int]:
    """Fields of /proc/meminfo in bytes (the file says kB and means KiB)."""
    out: dict[str, int] = {}
    for line in (proc_root / "meminfo").read_text().splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            factor = 1024 if len(parts) > 1 and parts[1] == "kB" else 1
            out[name.strip()] = int(parts[0]) * factor
    return out


@dataclass(frozen=True, slots=True)
class SystemReading:
    samples: list[Sample]
    boot_id: str
    uptime_seconds: float
    stored_boot: JSONValue
    """The boot id and last-alive time in the state store before this round wrote its own."""
    stored_alive: JSONValue


class SystemCollector:
    name = "system"

    def __init__(self, settings: SystemSettings, deps: CollectorDeps) -> None:
        self.settings = settings
        self.deps = deps
        self._previous_boot: tuple[str, float] | None = None
        self._checked_boot: str | None = None

    def families(self) -> Sequence[MetricFamily]:
        return (
            MEMORY_TOTAL,
            MEMORY_AVAILABLE,
            SWAP_TOTAL,
            SWAP_FREE,
            LOAD,
            UPTIME,
            BOOT_INFO,
            PREVIOUS_BOOT_LAST_ALIVE,
        )

    def _read(self, now: float) -> SystemReading:
        """Blocking: /proc, then the stored boot and this round's write of it, in one call so
        the state store's I/O stays off the event loop too."""
        root = self.settings.proc_root
        samples: list[Sample] = []
        mem = read_meminfo(root)
        for family, key in (
            (MEMORY_TOTAL, "MemTotal"),
            (MEMORY_AVAILABLE, "MemAvailable"),
            (SWAP_TOTAL, "SwapTotal"),
            (SWAP_FREE, "SwapFree"),
        ):
            if key in mem:
                samples.append(family.sample(mem[key]))
        load = (root / "loadavg").read_text().split()
        for window, value in zip(("1m", "5m", "15m"), load[:3], strict=False):
            samples.append(LOAD.sample(float(value), window))
        uptime = float((root / "uptime").read_text().split()[0])
        samples.append(UPTIME.sample(uptime))
        boot_id = read_boot_id(root)
        samples.append(BOOT_INFO.sample(1, boot_id))
        state = self.deps.state
        stored_boot = state.get(STATE_NAMESPACE, "boot_id")
        stored_alive = state.get(STATE_NAMESPACE, "last_alive")
        # Never raises: a value the disk refuses is the runtime's to keep and write later.
        state.put(STATE_NAMESPACE, "boot_id", boot_id)
        state.put(STATE_NAMESPACE, "last_alive", now)
        return SystemReading(samples, boot_id, uptime, stored_boot, stored_alive)

    async def collect(self, ctx: CollectContext) -> Collection:
        reading = await ctx.call("proc:system", self._read, ctx.now)
        events: list[Event] = []
        stored_boot, stored_alive = reading.stored_boot, reading.stored_alive
        # Once per boot: while writes fail, the store keeps the previous boot's id, which
        # must not raise host_rebooted again every round.
        if (
            self._checked_boot != reading.boot_id
            and isinstance(stored_boot, str)
            and stored_boot != reading.boot_id
        ):
            last_alive = float(stored_alive) if isinstance(stored_alive, (int, float)) else None
            events.append(
                _reboot_event(
                    stored_boot, reading.boot_id, last_alive, ctx.now, reading.uptime_seconds
                )
            )
            if last_alive is not None:
                self._previous_boot = (stored_boot, last_alive)
        self._checked_boot = reading.boot_id
        samples = list(reading.samples)
        if self._previous_boot is not None:
            samples.append(PREVIOUS_BOOT_LAST_ALIVE.sample(self._previous_boot[1]))
        return Collection(samples=samples, events=events)

    async def close(self) -> None:
        return None


def _reboot_event(
    previous: str, current: str, last_alive: float | None, now: float, uptime: float
) -> Event:
    boot_time = now - uptime
    if last_alive is not None:
        alive_text = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(last_alive))
        gap = f"; the agent was last alive at {alive_text}, {boot_time - last_alive:.0f} s before this boot"
    else:
        gap = ""
    boot_text = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(boot_time))
    return Event(
        source="system",
        kind="host_rebooted",
        severity=Severity.WARNING,
        repair_action=RepairAction.NONE,
        subject=current,
        message=f"the host rebooted since the agent last ran: it booted at {boot_text}{gap}",
        action="if nobody planned this reboot, look for its cause in the previous boot's log "
        "(journalctl -b -1 -e; a kernel panic, an Xid, a power or watchdog event)",
        attributes={
            "previous_boot_id": previous,
            "boot_id": current,
            "previous_last_alive": last_alive,
            "boot_time": round(boot_time, 1),
        },
    )


SPEC = CollectorSpec(
    name="system",
    description="memory, swap, load, uptime, boot id",
    settings_type=SystemSettings,
    factory=SystemCollector,
    default_settings=SystemSettings(interval=15.0),
)
