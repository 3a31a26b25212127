"""`gpuwarden check`: the start-of-instance checklist, one finding per line.

Read-only by default: collectors run once on in-memory state, the state store is opened
read-only, nothing is written. `--io-test DIR` (a 64 MiB write) and `--bench` (a GPU matmul
run) are the two opt-in tests that do change something.

No GPU: on a host where GPUs are expected (the default, at least one) a missing NVIDIA driver
or fewer GPUs than expected is a FAIL with the action to take; `--expect-gpus 0` says this host
has none on purpose, and the GPU lines become N/A.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from agent import registry
from agent.config import Config
from agent.diagnose import probes
from agent.diagnose.collect_once import CollectorResult, OneShotCollectors
from agent.diagnose.findings import Finding, Status, exit_code
from agent.diagnose.state_reader import read_state
from agent.model import Severity
from exporters.prometheus import parse_listen

NVIDIA_PROC_VERSION = Path("/proc/driver/nvidia/version")

# Memory thresholds: MemAvailable under 10% of RAM leaves little room for data loaders and
# pinned buffers; under 5% the OOM killer is close. A heuristic, not a vendor figure.
MEMORY_WARN_FRACTION = 0.10
MEMORY_FAIL_FRACTION = 0.05
OUTBOX_WARN_DEPTH = 1000
"""Undelivered outbox entries: beyond this the MQTT path has been down for a while."""


@dataclass(frozen=True)
class CheckOptions:
    io_test_dir: Path | None = None
    bench: bool = False
    expect_gpus: int | None = None
    """None: at least one GPU expected. 0: none expected (GPU lines N/A)."""
    python: str = sys.executable
    """The interpreter whose torch is checked (a training venv, say)."""
    torch: bool = True
    nvidia_proc_version: Path = NVIDIA_PROC_VERSION

    @property
    def gpus_expected(self) -> bool:
        return self.expect_gpus is None or self.expect_gpus > 0


@dataclass
class CheckReport:
    node_id: str
    findings: list[Finding] = field(default_factory=list)
    collectors: dict[str, CollectorResult] = field(default_factory=dict)
    torch_probe: dict[str, Any] | None = None

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
            "node": self.node_id,
            "exit_code": self.exit_code,
            "counts": self.counts(),
            "findings": [f.to_dict() for f in self.findings],
        }


# A classifier turns one collector's single round into findings. Collectors without one get
# the generic treatment: their events become findings, a failed round a WARN.
Classifier = Callable[[CollectorResult, CheckOptions], list[Finding]]


def classify_system(result: CollectorResult, options: CheckOptions) -> list[Finding]:
    if result.error:
        return [Finding("host", "memory", Status.WARN, f"cannot read /proc/meminfo: {result.error}")]
    total = result.values("gpuwarden_memory_total_bytes")
    available = result.values("gpuwarden_memory_available_bytes")
    if not total or not available or total[0].value <= 0:
        return [Finding("host", "memory", Status.NA, "MemAvailable not reported by this kernel")]
    fraction = available[0].value / total[0].value
    detail = f"{available[0].value / 2**30:.1f} GiB available of {total[0].value / 2**30:.1f} GiB ({fraction:.0%})"
    if fraction < MEMORY_FAIL_FRACTION:
        return [Finding("host", "memory", Status.FAIL, detail,
                        "find the processes holding memory (ps aux --sort=-rss | head)")]
    if fraction < MEMORY_WARN_FRACTION:
        return [Finding("host", "memory", Status.WARN, detail,
                        "little headroom for data loaders; check for leftover processes")]
    return [Finding("host", "memory", Status.OK, detail)]


def classify_generic(result: CollectorResult, options: CheckOptions) -> list[Finding]:
    if result.error:
        return [Finding("host", f"collector {result.name}", Status.WARN,
                        f"one round failed: {result.error}",
                        f"run `gpuwarden run` with log_level = \"debug\" to see why {result.name} fails")]
    return [
        Finding(result.name, event.subject or event.kind, Status.from_severity(event.severity),
                event.message, event.action)
        for event in result.events if event.severity >= Severity.WARNING
    ]


CLASSIFIERS: dict[str, Classifier] = {
    "system": classify_system,
}


def check_driver(options: CheckOptions) -> list[Finding]:
    """The driver's own /proc file: present exactly when the kernel module is loaded."""
    if not options.gpus_expected:
        return [Finding("driver", "NVIDIA driver", Status.NA, "no GPU expected on this host (--expect-gpus 0)")]
    try:
        first = options.nvidia_proc_version.read_text().splitlines()[0]
    except (OSError, IndexError):
        return [Finding(
            "driver", "NVIDIA driver", Status.FAIL,
            f"no NVIDIA driver is loaded ({options.nvidia_proc_version} is missing): this host has no usable GPU",
            "install or load the NVIDIA driver (nvidia-smi must list the GPUs); "
            "if this host has no GPU on purpose, run check with --expect-gpus 0",
        )]
    return [Finding("driver", "NVIDIA driver", Status.OK, first.split(":", 1)[-1].strip())]


def check_state(config: Config) -> list[Finding]:
    findings = [probes.check_state_dir(config.state_dir)]
    snapshot = read_state(config.state_dir, event_limit=0)
    if not snapshot.available:
        status = Status.NA if "has not run" in snapshot.reason else Status.WARN
        findings.append(Finding("state", "state store", status, snapshot.reason,
                                "" if status is Status.NA else "run gpuwarden diag and send the bundle"))
        return findings
    depth = sum(snapshot.outbox_depth.values())
    detail = f"schema {snapshot.schema_version}, outbox depth {depth}"
    if snapshot.outbox_oldest_age_seconds is not None:
        detail += f", oldest entry {snapshot.outbox_oldest_age_seconds:.0f} s old"
    status = Status.WARN if depth > OUTBOX_WARN_DEPTH else Status.OK
    findings.append(Finding("state", "state store", status, detail,
                            "the MQTT sink has not delivered for a while: check the broker line" if status is Status.WARN else ""))
    return findings


async def check_network(config: Config) -> list[Finding]:
    jobs: list[Awaitable[Finding]] = []
    prometheus = config.sections.get("prometheus")
    if prometheus is not None and getattr(prometheus, "enabled", False):
        host, port = parse_listen(prometheus.listen)
        jobs.append(probes.check_prometheus_listen(host, port))
    mqtt = config.sections.get("mqtt")
    if mqtt is not None and getattr(mqtt, "enabled", False):
        ca_file = getattr(mqtt, "ca_file", None)
        jobs.append(probes.check_broker(str(mqtt.url), Path(ca_file) if ca_file else None))
    findings = list(await asyncio.gather(*jobs))
    if mqtt is None or not getattr(mqtt, "enabled", False):
        findings.append(Finding("network", "MQTT broker", Status.SKIP, "MQTT is not enabled in the configuration"))
    return findings


async def check_torch(options: CheckOptions) -> tuple[Finding, dict[str, Any] | None]:
    if not options.torch:
        return Finding("torch", "torch on this driver", Status.SKIP, "not asked for (--no-torch)"), None
    if options.python == sys.executable:
        try:
            metadata.version("torch")
        except metadata.PackageNotFoundError:
            return probes.classify_torch({"missing": "torch"}, options.gpus_expected, options.python), None
    probe = await probes.run_torch_probe(options.python)
    return probes.classify_torch(probe, options.gpus_expected, options.python), probe


def optional_tests(options: CheckOptions) -> list[Finding]:
    findings = []
    if options.io_test_dir is None:
        findings.append(Finding("io", "write probe", Status.SKIP, "not asked for (--io-test DIR)"))
    if not options.bench:
        findings.append(Finding("bench", "matmul benchmark", Status.SKIP, "not asked for (--bench)"))
    return findings


async def run_check(config: Config, options: CheckOptions,
                    collector_names: Sequence[str] | None = None) -> CheckReport:
    report = CheckReport(config.node_id)
    torch_task = asyncio.create_task(check_torch(options))
    network_task = asyncio.create_task(check_network(config))
    names = list(collector_names if collector_names is not None else registry.COLLECTORS)
    async with OneShotCollectors(config.node_id, dict(config.collectors)) as runner:
        results = await asyncio.gather(*(runner.run(name) for name in names))
    report.collectors = {r.name: r for r in results}
    report.findings.extend(check_driver(options))
    torch_finding, report.torch_probe = await torch_task
    report.findings.append(torch_finding)
    for result in results:
        classify = CLASSIFIERS.get(result.name, classify_generic)
        report.findings.extend(classify(result, options))
    report.findings.extend(check_state(config))
    report.findings.extend(await network_task)
    report.findings.extend(optional_tests(options))
    return report
