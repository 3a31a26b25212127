"""`gpuwarden check`: the start-of-instance checklist, one finding per line.

Read-only by default: the read-only collectors (system, gpu, disk, processes) run their own
code for one round on in-memory state, the kernel log is read with a private cursor, the state
store is opened read-only, nothing is written. `--io-test DIR` (the io_probe collector's 64 MiB
write) and `--bench` (one benchmark run) are the opt-in tests that do change something.

GPUs expected: `--expect-gpus N` if given; else none when `[collectors.gpu] enabled = false`;
else `[collectors.gpu] expected_gpus` when set; else at least one. Where GPUs are expected, a
missing NVIDIA driver or fewer GPUs is a FAIL with the action to take; where none are, the GPU
lines are a single N/A.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from agent import __version__
from agent.contracts.collector import SharedServices
from agent.contracts.config import Config
from agent.contracts.errors import CallStillHung, CallTimedOut
from agent.contracts.pause import PauseHistory, PauseState, PauseWindow
from agent.program.diagnose import probes
from agent.program.diagnose.bench_findings import check_bench
from agent.program.diagnose.checkpoint_findings import check_checkpoints
from agent.program.diagnose.collect_once import CollectorResult, OneShotCollectors
from agent.program.diagnose.findings import Finding, Status, exit_code
from agent.program.diagnose.gpu_findings import classify_gpus
from agent.program.diagnose.host_findings import classify_disk, classify_processes
from agent.program.diagnose.kernel_findings import (
    KernelLogScan,
    classify_kernel_log,
    scan_kernel_log,
    xid_catalog_info,
)
from agent.program.diagnose.nvml_versions import read_nvml_versions
from agent.program.diagnose.state_reader import read_state
from agent.runtime.pause import HISTORY_KEY as PAUSE_HISTORY_KEY
from agent.runtime.pause import KEY as PAUSE_KEY
from agent.runtime.pause import NAMESPACE as PAUSE_NAMESPACE
from agent.runtime.pause import ended_pauses
from collectors import io_probe, system
from collectors._nvml import NvmlBackend
from collectors._procfs import read_boot_id
from collectors.gpu.collector import GpuSettings
from collectors.io_probe import IoProbeSettings
from collectors.kernel_log.kmsg import KmsgIO
from exporters.http import parse_listen
from exporters.mqtt_settings import MqttSettings
from exporters.prometheus import PrometheusSettings

NVIDIA_PROC_VERSION = Path("/proc/driver/nvidia/version")

# Memory thresholds: MemAvailable under 10% of RAM leaves little room for data loaders and
# pinned buffers; under 5% the OOM killer is close. A heuristic, not a vendor figure.
MEMORY_WARN_FRACTION = 0.10
MEMORY_FAIL_FRACTION = 0.05
OUTBOX_WARN_DEPTH = 1000
"""Undelivered outbox entries: beyond this the MQTT path has been down for a while."""
PROCESS_GAP_SECONDS = 2.0
"""Two looks at the process table this far apart: a process in D state in both is stuck for
at least that long (a D sleep for one disk read lasts milliseconds)."""
IO_TEST_TIMEOUT = 120.0
KERNEL_LOG_TIMEOUT = 30.0
"""Reading a full ring buffer (a few MiB) takes well under a second."""


@dataclass(frozen=True)
class CheckOptions:
    io_test_dir: Path | None = None
    bench: bool = False
    expect_gpus: int | None = None
    """From the command line; None: decided by the configuration (module docstring)."""
    python: str | None = None
    """The interpreter whose torch is checked (a training venv, say); None: the one the
    benchmark child runs under (`[collectors.benchmark] python`, else gpuwarden's own)."""
    torch: bool = True
    nvidia_proc_version: Path = NVIDIA_PROC_VERSION
    process_gap: float = PROCESS_GAP_SECONDS
    kmsg_io: KmsgIO | None = None
    """A stand-in for /dev/kmsg (tests); None: the configured kernel log."""


JSON_SCHEMA_VERSION = 2
"""check --json's shape. 2: schema_version, time, version; each finding's stable `id`, with
its `subject` and `data` apart from it (1, unversioned: `name` only, holding the data)."""


def rfc3339(when: float) -> str:
    """UTC, to the second, with a Z: 2026-12-01T11:38:47Z."""
    return datetime.fromtimestamp(when, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class CheckReport:
    node_id: str
    started: float = field(default_factory=time.time)
    """When the check started, seconds since the epoch."""
    findings: list[Finding] = field(default_factory=list)
    collectors: dict[str, CollectorResult] = field(default_factory=dict)
    torch_probe: dict[str, Any] | None = None
    nvidia_versions: dict[str, str] = field(default_factory=dict)
    kernel_log: KernelLogScan | None = None
    hung_calls: list[str] = field(default_factory=list)
    """Blocking calls that did not return: their threads would hold the process at exit."""

    @property
    def exit_code(self) -> int:
        return exit_code(self.findings)

    def counts(self) -> dict[str, int]:
        out = {s.value: 0 for s in Status}
        for finding in self.findings:
            out[finding.status.value] += 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": JSON_SCHEMA_VERSION,
            "time": rfc3339(self.started),
            "version": __version__,
            "node": self.node_id,
            "exit_code": self.exit_code,
            "counts": self.counts(),
            "findings": [f.to_dict() for f in self.findings],
            "xid_catalog": xid_catalog_info(),
        }


def expected_gpus(config: Config, options: CheckOptions) -> int | None:
    """0: none expected; N: exactly N; None: at least one."""
    if options.expect_gpus is not None:
        return options.expect_gpus
    gpu = config.collectors.get("gpu")
    if gpu is None or not gpu.enabled:
        return 0
    if isinstance(gpu, GpuSettings) and gpu.expected_gpus:
        return gpu.expected_gpus
    return None


def classify_system(result: CollectorResult) -> list[Finding]:
    if result.error:
        return [
            Finding("host", "memory", Status.WARN, f"cannot read /proc/meminfo: {result.error}")
        ]
    total = result.values(system.MEMORY_TOTAL.name)
    available = result.values(system.MEMORY_AVAILABLE.name)
    if not total or not available or total[0].value <= 0:
        return [Finding("host", "memory", Status.NA, "MemAvailable not reported by this kernel")]
    fraction = available[0].value / total[0].value
    detail = f"{available[0].value / 2**30:.1f} GiB available of {total[0].value / 2**30:.1f} GiB ({fraction:.0%})"
    if fraction < MEMORY_FAIL_FRACTION:
        return [
            Finding(
                "host",
                "memory",
                Status.FAIL,
                detail,
                "find the processes holding memory (ps aux --sort=-rss | head)",
            )
        ]
    if fraction < MEMORY_WARN_FRACTION:
        return [
            Finding(
                "host",
                "memory",
                Status.WARN,
                detail,
                "little headroom for data loaders; check for leftover processes",
            )
        ]
    return [Finding("host", "memory", Status.OK, detail)]


def kernel_module(path: Path) -> str | None:
    """The NVIDIA kernel module's own /proc file: present exactly when it is loaded."""
    try:
        first = path.read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    return " ".join(first.split(":", 1)[-1].split())


def check_state(config: Config) -> list[Finding]:
    findings = [probes.check_state_dir(config.state_dir)]
    snapshot = read_state(config.state_dir, event_limit=0)
    if not snapshot.available:
        status = Status.NA if "has not run" in snapshot.reason else Status.WARN
        findings.append(
            Finding(
                "state",
                "state store",
                status,
                snapshot.reason,
                "" if status is Status.NA else "run gpuwarden diag and send the bundle",
            )
        )
        return findings
    depth = sum(snapshot.outbox_depth.values())
    detail = f"schema {snapshot.schema_version}, outbox depth {depth}"
    if snapshot.outbox_oldest_age_seconds is not None:
        detail += f", oldest entry {snapshot.outbox_oldest_age_seconds:.0f} s old"
    status = Status.WARN if depth > OUTBOX_WARN_DEPTH else Status.OK
    findings.append(
        Finding(
            "state",
            "state store",
            status,
            detail,
            "the MQTT sink has not delivered for a while: check the broker line"
            if status is Status.WARN
            else "",
        )
    )
    return findings


async def check_network(config: Config) -> list[Finding]:
    jobs: list[Awaitable[Finding]] = []
    prometheus = config.sections.get("prometheus")
    if isinstance(prometheus, PrometheusSettings) and prometheus.enabled:
        host, port = parse_listen(prometheus.listen)
        jobs.append(probes.check_prometheus_listen(host, port, prometheus.serves_tls()))
    mqtt = config.sections.get("mqtt")
    mqtt_on = isinstance(mqtt, MqttSettings) and mqtt.enabled
    if isinstance(mqtt, MqttSettings) and mqtt_on:
        address = mqtt.address
        files = probes.TlsFiles(mqtt.ca_file, mqtt.cert_file, mqtt.key_file)
        jobs.append(
            probes.check_broker(probes.Endpoint(address.host, address.port, address.tls), files)
        )
    findings = list(await asyncio.gather(*jobs))
    if not mqtt_on:
        findings.append(
            Finding(
                "network", "MQTT broker", Status.SKIP, "MQTT is not enabled in the configuration"
            )
        )
    return findings


def torch_python(config: Config, options: CheckOptions) -> tuple[str, str]:
    """The interpreter whose torch is checked, and where it was named (for the action)."""
    if options.python is not None:
        return options.python, "--python"
    configured = config.collectors.get("benchmark")
    python = getattr(configured, "python", "")
    if isinstance(python, str) and python:
        return python, "[collectors.benchmark] python"
    return sys.executable, "--python"


async def probe_torch(config: Config, options: CheckOptions) -> dict[str, Any] | None:
    """The torch child's answer; None when not asked for."""
    if not options.torch:
        return None
    python, _ = torch_python(config, options)
    if python == sys.executable:
        try:
            metadata.version("torch")  # metadata only: a missing torch needs no child
        except metadata.PackageNotFoundError:
            return {"missing": "torch"}
    return await probes.run_torch_probe(python)


def torch_line(
    probe: dict[str, Any] | None,
    gpus_expected: bool,
    python: tuple[str, str],
    versions: dict[str, str],
) -> Finding:
    """`python`: the interpreter checked and where it was named (torch_python)."""
    if probe is None:
        line = Finding("torch", "torch on this driver", Status.SKIP, "not asked for (--no-torch)")
    else:
        line = probes.classify_torch(
            probe, gpus_expected, python[0], versions.get("cuda_driver_version"), python[1]
        )
    return dataclasses.replace(line, check="torch")


async def check_io(runner: OneShotCollectors, directory: Path | None) -> list[Finding]:
    if directory is None:
        return [Finding("io", "write probe", Status.SKIP, "not asked for (--io-test DIR)")]
    settings = IoProbeSettings(
        enabled=True, directories=(str(directory.resolve()),), timeout=IO_TEST_TIMEOUT
    )
    result = await runner.run("io_probe", settings)
    name = f"write probe {directory}"
    return [
        dataclasses.replace(f, check="write_probe", subject=str(directory))
        for f in _io_lines(result, settings, name)
    ]


def _io_lines(result: CollectorResult, settings: IoProbeSettings, name: str) -> list[Finding]:
    if result.error:
        return [Finding("io", name, Status.WARN, result.error, "check the file system behind it")]
    if result.events:
        return [
            Finding("io", name, Status.WARN, e.message, e.action, e.repair_action)
            for e in result.events
        ]
    throughput = result.values(io_probe.THROUGHPUT.name)
    latency = result.values(io_probe.SYNC_LATENCY.name)
    if not throughput:
        return [Finding("io", name, Status.WARN, "the probe gave no measurement")]
    detail = f"{settings.size_mib} MiB written and fdatasynced at {throughput[0].value / 2**20:.0f} MiB/s"
    if latency:
        detail += f"; one 4 KiB write + fdatasync took {latency[0].value * 1000:.1f} ms"
    return [Finding("io", name, Status.OK, detail)]


async def run_collectors(
    runner: OneShotCollectors, config: Config, expected: int | None, options: CheckOptions
) -> dict[str, CollectorResult]:
    jobs: dict[str, Awaitable[CollectorResult]] = {
        "system": runner.run("system"),
        "disk": runner.run("disk"),
        "processes": runner.run("processes", rounds=2, gap=options.process_gap),
    }
    if expected != 0:
        gpu = config.collectors.get("gpu")
        settings = gpu if isinstance(gpu, GpuSettings) else GpuSettings()
        # No event thread in a one-shot round: it would only be started to be stopped.
        jobs["gpu"] = runner.run("gpu", dataclasses.replace(settings, event_thread=False))
    results = await asyncio.gather(*jobs.values())
    return dict(zip(jobs, results, strict=True))


def gpu_lines(
    results: dict[str, CollectorResult],
    expected: int | None,
    options: CheckOptions,
    versions: dict[str, str],
) -> list[Finding]:
    if expected == 0:
        return [
            Finding(
                "gpu",
                "GPUs",
                Status.NA,
                "none expected on this host (--expect-gpus 0, or [collectors.gpu] enabled = false)",
            )
        ]
    return classify_gpus(
        results["gpu"], expected, kernel_module(options.nvidia_proc_version), versions
    )


async def nvidia_versions(runner: OneShotCollectors) -> dict[str, str]:
    """After the gpu round: the shared backend is started if the driver answered."""
    backend = runner.shared.find(NvmlBackend)
    if backend is None or not backend.up:
        return {}
    try:
        return await runner.call("nvml:versions", read_nvml_versions, backend)
    except (CallTimedOut, CallStillHung):
        return {}


PAUSED_SKIP = "not run: the running agent has the GPUs paused (gpuwarden pause)"


def running_pause(config: Config, now: float | None = None) -> PauseState | None:
    """The running agent's pause (`gpuwarden pause`), as its state store holds it: this boot's
    and before its deadline. None otherwise, or when the store cannot tell."""
    snapshot = read_state(config.state_dir, event_limit=0)
    record = snapshot.kv.get(PAUSE_NAMESPACE, {}).get(PAUSE_KEY) if snapshot.available else None
    if not isinstance(record, dict):
        return None
    try:
        state = PauseState(float(record["since"]), float(record["until"]), str(record["reason"]))
        boot = str(record.get("boot", ""))
    except (KeyError, TypeError, ValueError):
        return None
    try:
        this_boot = read_boot_id(Path("/proc"))
    except OSError:
        this_boot = ""
    if (boot and this_boot and boot != this_boot) or state.until <= (now or time.time()):
        return None
    return state


def pause_history(config: Config, now: float | None = None) -> PauseHistory:
    """The running agent's pauses as its state store keeps them (the one of this boot, in
    force or ended at its deadline while the agent was down, and the ended ones): the GPU
    findings the kernel log holds from them are not judged. Empty when the store cannot
    tell."""
    snapshot = read_state(config.state_dir, event_limit=0)
    kept = snapshot.kv.get(PAUSE_NAMESPACE, {}) if snapshot.available else {}
    windows, _ = ended_pauses(kept.get(PAUSE_HISTORY_KEY))
    record = kept.get(PAUSE_KEY)
    try:
        this_boot = read_boot_id(Path("/proc"))
    except OSError:
        this_boot = ""
    if isinstance(record, dict):
        try:
            since, until = float(record["since"]), float(record["until"])
            boot = str(record.get("boot", ""))
        except (KeyError, TypeError, ValueError):
            return PauseHistory(windows)
        if not (boot and this_boot and boot != this_boot):
            ended = None if until > (now or time.time()) else until
            windows.append(PauseWindow(since, ended, str(record.get("reason", ""))))
    return PauseHistory(windows)


def paused_lines(state: PauseState) -> list[Finding]:
    until = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(state.until))
    why = f" ({state.reason})" if state.reason else ""
    detail = (
        f"the running agent has the GPUs released until {until}{why}: check does not open "
        "them meanwhile (a GPU reset or MIG change is under way)"
    )
    return [
        Finding("gpu", "GPUs", Status.SKIP, detail, "gpuwarden resume ends the pause"),
    ]


async def run_check(
    config: Config, options: CheckOptions, shared: SharedServices | None = None
) -> CheckReport:
    """`shared`: the services collectors share (tests put a fake NVML backend there).

    While the running agent has the GPUs paused, nothing here opens them (NVML, the torch
    probe, the benchmark): a health check run by Slurm in the middle of a GPU reset would
    make the reset fail."""
    report = CheckReport(config.node_id)
    paused = running_pause(config)
    if paused is not None:
        options = dataclasses.replace(options, expect_gpus=0, torch=False, bench=False)
    expected = expected_gpus(config, options)
    torch_task = asyncio.create_task(probe_torch(config, options))
    network_task = asyncio.create_task(check_network(config))
    kernel_task = asyncio.create_task(
        asyncio.wait_for(
            asyncio.to_thread(
                scan_kernel_log,
                config.collectors.get("kernel_log"),
                options.kmsg_io,
                pause_history(config),
            ),
            KERNEL_LOG_TIMEOUT,
        )
    )
    runner = OneShotCollectors(
        config.node_id, dict(config.collectors), shared=shared or SharedServices()
    )
    async with runner:
        results = await run_collectors(runner, config, expected, options)
        report.nvidia_versions = await nvidia_versions(runner)
        checkpoint_lines = await check_checkpoints(runner, config)
        io_findings = await check_io(runner, options.io_test_dir)
        bench_findings = (
            await check_bench(runner, config)
            if options.bench
            else [
                Finding(
                    "bench",
                    "matmul benchmark",
                    Status.SKIP,
                    "not asked for (--bench)" if paused is None else PAUSED_SKIP,
                    check="bench",
                )
            ]
        )
        report.hung_calls = runner.hung_calls()
    report.collectors = results
    if paused is not None:
        report.findings.extend(paused_lines(paused))
    else:
        report.findings.extend(gpu_lines(results, expected, options, report.nvidia_versions))
    report.torch_probe = await torch_task
    report.findings.append(
        torch_line(
            report.torch_probe,
            expected != 0,
            torch_python(config, options),
            report.nvidia_versions,
        )
        if paused is None
        else Finding("torch", "torch on this driver", Status.SKIP, PAUSED_SKIP)
    )
    try:
        report.kernel_log = await kernel_task
    except TimeoutError:
        report.kernel_log = KernelLogScan(
            "kernel log", error=f"not read within {KERNEL_LOG_TIMEOUT:g} s"
        )
    report.findings.extend(classify_kernel_log(report.kernel_log))
    host: list[tuple[str, Callable[[CollectorResult], list[Finding]]]] = [
        ("system", classify_system),
        ("disk", classify_disk),
        ("processes", lambda r: classify_processes(r, options.process_gap)),
    ]
    for name, classify in host:
        report.findings.extend(classify(results[name]))
    report.findings.extend(checkpoint_lines)
    report.findings.extend(check_state(config))
    report.findings.extend(await network_task)
    report.findings.extend(io_findings)
    report.findings.extend(bench_findings)
    return report
