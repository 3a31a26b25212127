"""A reload counts nothing again: the counters a collector's rebuild takes over are the last
life's, never the ones its own process stored.

A collector rebuilt by a reload (SIGHUP with its settings changed) takes over the counts this
boot's last life of the agent stored (the Xid counts of the NVML thread and of the
kernel_log collector's rounds, the kernel-log finding counters). What the chaos harness found
(seed 309): in the first life on a boot nothing is stored when the GPU collector is first
built, so it took over nothing and was not marked as having done so; the first NVML Xid then
stored its count, and the rebuild after a reload took that count over as the last life's and
added it again: `gpuwarden_xid_errors_total` read 2 for one Xid until a restart made it 1,
which read as a counter falling. Here the agent is a real process on the fake NVML, on a
fresh state dir (its first life on this boot); an Xid from each source, then reloads that
rebuild one collector or both; every counter of the Xids and the kernel-log findings must
read as before the reload.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.program import registry
from tests.support.agent_proc import AgentProcess, http_get
from tests.support.chaos import parse_metrics
from tests.support.fake_nvml_agent import inject_xid, injected
from tests.support.kmsg import kmsg_record
from tests.support.waiting import wait_until

COUNTED = (
    "gpuwarden_xid_errors_total",
    "gpuwarden_xid_confirmed_total",
    "gpuwarden_kernel_log_findings_total",
    "gpuwarden_sxid_errors_total",
)
PCI = "0000:18:00.0"


@dataclass
class Host:
    agent: AgentProcess
    devices: Path
    klog: Path
    intervals: dict[str, float]
    seq: int = 1

    def config(self) -> str:
        others = "".join(
            f"[collectors.{name}]\nenabled = false\n"
            for name in registry.COLLECTORS
            if name not in ("gpu", "kernel_log")
        )
        return (
            f"[collectors.gpu]\ninterval = {self.intervals['gpu']}\nevent_wait_ms = 100\n"
            'sysfs_root = "/nonexistent"\n'
            f'[collectors.kernel_log]\npath = "{self.klog}"\n'
            f"interval = {self.intervals['kernel_log']}\n{others}"
        )

    def metrics(self) -> str:
        status, text = http_get(self.agent.metrics_url)
        assert status == 200
        return text

    def value(self, name: str, **labels: str) -> float | None:
        for (metric, have), value in parse_metrics(self.metrics()).items():
            if metric == name and labels.items() <= dict(have).items():
                return value
        return None

    def counted(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {k: v for k, v in parse_metrics(self.metrics()).items() if k[0] in COUNTED}

    def nvml_xid(self, code: int) -> None:
        request = inject_xid(self.devices, 0, code)
        wait_until(lambda: injected(request), 10.0, f"the fake to deliver Xid {code}")

    def kmsg_xid(self, code: int) -> None:
        self.seq += 1
        line = f"NVRM: Xid (PCI:{PCI[:-2]}): {code}, pid=4242, name=train.py, Ch 00000010"
        with self.klog.open("ab") as handle:
            handle.write(kmsg_record(self.seq, line, level=3))

    def reload(self, *changed: str) -> None:
        for name in changed:
            self.intervals[name] = round(self.intervals[name] + 0.1, 1)
        self.agent.config_text = self.config()
        self.agent.write_config()
        self.agent.signal(signal.SIGHUP)
        for name in changed:
            wait_until(
                lambda n=name: (  # type: ignore[misc]
                    self.value("gpuwarden_collector_interval_seconds", collector=n)
                    == self.intervals[n]
                ),
                15.0,
                f"{name}'s new interval in force",
            )
        self.rounds_of(*changed)

    def rounds_of(self, *names: str) -> None:
        """Two more rounds of each: a rebuilt collector has taken over what it takes over."""
        for name in names:
            runs = self.value("gpuwarden_collector_runs_total", collector=name) or 0.0
            wait_until(
                lambda n=name, r=runs: (  # type: ignore[misc]
                    (self.value("gpuwarden_collector_runs_total", collector=n) or 0.0) >= r + 2
                ),
                20.0,
                f"{name}'s rounds after the reload",
            )


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    devices = tmp_path / "dev"
    devices.mkdir()
    klog = tmp_path / "kmsg-records"
    klog.write_bytes(kmsg_record(1, "Linux version 6.8.0 (boot)"))
    made = Host(
        AgentProcess(
            tmp_path / "agent", entry=["-m", "tests.support.fake_nvml_agent", str(devices), "1"]
        ),
        devices,
        klog,
        {"gpu": 0.5, "kernel_log": 0.5},
    )
    made.agent.config_text = made.config()
    made.agent.start(timeout=30.0)
    made.rounds_of("gpu", "kernel_log")
    yield made
    made.agent.stop()


def by_nvml(host: Host) -> None:
    host.nvml_xid(79)
    wait_until(
        lambda: host.value("gpuwarden_xid_errors_total", pci_bus_id=PCI, xid="79") == 1.0,
        15.0,
        "NVML's Xid counted",
    )


def by_kernel_log(host: Host) -> None:
    host.kmsg_xid(13)
    wait_until(
        lambda: host.value("gpuwarden_xid_errors_total", pci_bus_id=PCI, xid="13") == 1.0,
        15.0,
        "the kernel log's Xid counted",
    )


def by_both(host: Host) -> None:
    by_nvml(host)
    by_kernel_log(host)


SOURCES = {"nvml": by_nvml, "kernel_log": by_kernel_log, "both": by_both}
REBUILT = {"gpu": ("gpu",), "kernel_log": ("kernel_log",), "both": ("gpu", "kernel_log")}


@pytest.mark.slow
@pytest.mark.parametrize("rebuilt", REBUILT)
@pytest.mark.parametrize("source", SOURCES)
def test_a_reload_after_the_first_xids_of_a_boot_counts_none_again(
    host: Host, source: str, rebuilt: str
) -> None:
    SOURCES[source](host)
    host.rounds_of("gpu", "kernel_log")  # each has stored what it stores with its rounds
    before = host.counted()
    assert before, "nothing counted before the reload"
    for _ in range(2):
        host.reload(*REBUILT[rebuilt])
        assert host.counted() == before, host.agent.log()[-3000:]
