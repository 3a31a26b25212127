"""System: memory, swap, load, uptime and boot id, read from /proc."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.collector import CollectContext, CollectorDeps, CollectorSettings, CollectorSpec
from agent.model import Collection, MetricFamily, MetricType, Sample
from agent.settings import setting

G = MetricType.GAUGE

MEMORY_TOTAL = MetricFamily("gpuwarden_memory_total_bytes", G, "MemTotal from /proc/meminfo", unit="bytes")
MEMORY_AVAILABLE = MetricFamily(
    "gpuwarden_memory_available_bytes", G, "MemAvailable from /proc/meminfo", unit="bytes"
)
SWAP_TOTAL = MetricFamily("gpuwarden_swap_total_bytes", G, "SwapTotal from /proc/meminfo", unit="bytes")
SWAP_FREE = MetricFamily("gpuwarden_swap_free_bytes", G, "SwapFree from /proc/meminfo", unit="bytes")
LOAD = MetricFamily("gpuwarden_load_average", G, "Load average over the window", ("window",))
UPTIME = MetricFamily("gpuwarden_uptime_seconds", G, "Seconds since the host booted", unit="seconds")
BOOT_INFO = MetricFamily("gpuwarden_boot_info", G, "The current boot id, always 1", ("boot_id",))


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


class SystemCollector:
    name = "system"

    def __init__(self, settings: SystemSettings, deps: CollectorDeps) -> None:
        self.settings = settings
        self.deps = deps

    def families(self) -> Sequence[MetricFamily]:
        return (MEMORY_TOTAL, MEMORY_AVAILABLE, SWAP_TOTAL, SWAP_FREE, LOAD, UPTIME, BOOT_INFO)

    def _read(self) -> list[Sample]:
        root = self.settings.proc_root
        samples: list[Sample] = []
        mem = read_meminfo(root)
        for family, key in ((MEMORY_TOTAL, "MemTotal"), (MEMORY_AVAILABLE, "MemAvailable"),
                            (SWAP_TOTAL, "SwapTotal"), (SWAP_FREE, "SwapFree")):
            if key in mem:
                samples.append(family.sample(mem[key]))
        load = (root / "loadavg").read_text().split()
        for window, value in zip(("1m", "5m", "15m"), load[:3], strict=False):
            samples.append(LOAD.sample(float(value), window))
        samples.append(UPTIME.sample(float((root / "uptime").read_text().split()[0])))
        boot_id = (root / "sys/kernel/random/boot_id").read_text().strip()
        samples.append(BOOT_INFO.sample(1, boot_id))
        return samples

    async def collect(self, ctx: CollectContext) -> Collection:
        return Collection(samples=await ctx.call("proc:system", self._read))

    async def close(self) -> None:
        return None


SPEC = CollectorSpec(
    name="system",
    description="memory, swap, load, uptime, boot id",
    settings_type=SystemSettings,
    factory=SystemCollector,
    default_settings=SystemSettings(interval=15.0),
)
