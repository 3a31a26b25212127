"""`gpuwarden diag`: gather what support needs into one redacted bundle.

Contents (docs/commands.md, "The diagnostic bundle"): manifest, versions, the check report and each
collector's one-round snapshot, `nvidia-smi -q`, the state store's recent events, outbox depth
and key-value state (delivery ledger, counters, cursors, benchmark baselines) read read-only,
benchmark history files, the configuration with secrets removed, and the user's --include files.
Secret files named by `*_file` keys are never opened.
"""

from __future__ import annotations

import asyncio
import platform
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from agent import __version__
from agent.contracts.collector import SharedServices
from agent.contracts.config import Config
from agent.contracts.settings import to_table
from agent.program.commands.config_cmd import effective
from agent.program.config_file import EMBEDDED
from agent.program.diagnose import probes
from agent.program.diagnose.bundle import Bundle, utc_stamp, write_atomically
from agent.program.diagnose.check import (
    NVIDIA_PROC_VERSION,
    PROCESS_GAP_SECONDS,
    CheckOptions,
    run_check,
)
from agent.program.diagnose.checkpoint_findings import checkpoint_index
from agent.program.diagnose.redact import Redactor
from agent.program.diagnose.state_reader import read_state
from agent.runtime.state import DB_NAME
from exporters.http import parse_listen
from exporters.prometheus import PrometheusSettings

BUNDLE_FORMAT = 1
PACKAGES = (
    "gpuwarden",
    "nvidia-ml-py",
    "pynvml",
    "psutil",
    "aiomqtt",
    "paho-mqtt",
    "structlog",
    "tenacity",
    "torch",
)
INCLUDE_LIMIT_BYTES = 64 * 2**20
"""Per --include file: the last 64 MiB of a training log holds the failure."""
STATE_FILE_LIMIT_BYTES = 16 * 2**20
NVIDIA_SMI_TIMEOUT = 30.0
"""nvidia-smi -q takes about 130 ms on a healthy H200 (docs/MEASUREMENTS.md); it hangs with the GPU."""


@dataclass(frozen=True)
class DiagOptions:
    output: Path | None = None
    includes: tuple[Path, ...] = ()
    event_limit: int = 1000
    run_torch_probe: bool = True
    nvidia_proc_version: Path = NVIDIA_PROC_VERSION
    process_gap: float = PROCESS_GAP_SECONDS


def default_output(node_id: str, now: float) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", node_id) or "node"
    return Path.cwd() / f"gpuwarden-diag-{safe}-{utc_stamp(now)}.tar.gz"


def secret_files(config: Config) -> set[Path]:
    """Every path named by a `*_file` key anywhere in the configuration."""
    found: set[Path] = set()

    def walk(table: dict[str, Any]) -> None:
        for key, value in table.items():
            if isinstance(value, dict):
                walk(value)
            elif key.endswith("_file") and isinstance(value, str) and value:
                found.add(Path(value).expanduser().resolve())

    for section in config.sections.values():
        walk(to_table(section, mask_secrets=False))
    for settings in config.collectors.values():
        walk(to_table(settings, mask_secrets=False))
    return found


def collect_versions(nvidia_proc_version: Path) -> dict[str, Any]:
    packages: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            packages[name] = metadata.version(name)  # metadata only: torch is never imported
        except metadata.PackageNotFoundError:
            packages[name] = None
    os_release: dict[str, str] = {}
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            key, sep, value = line.partition("=")
            if sep:
                os_release[key] = value.strip('"')
    except OSError:
        pass
    uname = platform.uname()
    try:
        driver: str | None = nvidia_proc_version.read_text().strip()
    except OSError:
        driver = None
    return {
        "gpuwarden": __version__,
        "os": os_release.get("PRETTY_NAME"),
        "kernel": {"release": uname.release, "version": uname.version, "machine": uname.machine},
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "executable": sys.executable,
        },
        "packages": packages,
        "nvidia_driver_proc": driver,
    }


def run_nvidia_smi() -> tuple[str, str]:
    """(text, note): `nvidia-smi -q` once; a diag bundle is the one place it is worth 130 ms."""
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return "", "nvidia-smi not found on PATH: no nvidia-smi -q output"
    try:
        done = subprocess.run(
            [tool, "-q"],
            capture_output=True,
            text=True,
            errors="replace",
            timeout=NVIDIA_SMI_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return "", f"nvidia-smi -q did not finish within {NVIDIA_SMI_TIMEOUT:g} s (a hung GPU?)"
    except OSError as exc:
        return "", f"cannot run nvidia-smi: {exc.strerror}"
    text = done.stdout + (f"\n--- stderr ---\n{done.stderr}" if done.stderr else "")
    note = "" if done.returncode == 0 else f"nvidia-smi -q exited with code {done.returncode}"
    return text, note


async def add_live_agent(bundle: Bundle, config: Config) -> None:
    """The running agent's /metrics and /healthz: its snapshot, collector health and the
    delivery ledger (kept in memory by the agent, so only a live agent can tell)."""
    prometheus = config.sections.get("prometheus")
    if not isinstance(prometheus, PrometheusSettings) or not prometheus.enabled:
        bundle.notes.append("Prometheus endpoint disabled: no live metrics or delivery ledger")
        return
    host, port = parse_listen(prometheus.listen)
    tls = prometheus.serves_tls()
    for path, member in (("/healthz", "agent/healthz.txt"), ("/metrics", "agent/metrics.txt")):
        try:
            status, body = await probes.http_get(host, port, path, tls)
        except (OSError, TimeoutError) as exc:
            bundle.notes.append(
                f"agent at {prometheus.listen}: {probes.describe_network_error(exc)}; "
                "no live metrics or delivery ledger (is it running?)"
            )
            return
        if status == 401:
            bundle.notes.append(
                f"agent at {prometheus.listen} requires basic auth: no live metrics"
            )
            return
        bundle.add_text(
            member, f"# GET {path}: HTTP {status}\n" + body.decode("utf-8", errors="replace")
        )


def add_config(bundle: Bundle, config: Config) -> None:
    data = effective(config)
    data["_source"] = config.source
    bundle.add_json("config/effective.json", data)
    if config.source != EMBEDDED:
        source = Path(config.source)
        bundle.add_file(f"config/{source.name}", source, STATE_FILE_LIMIT_BYTES)


def add_state(bundle: Bundle, config: Config, event_limit: int) -> None:
    snapshot = read_state(config.state_dir, event_limit=event_limit)
    bundle.add_json("state/summary.json", snapshot.to_dict())
    if snapshot.available:
        bundle.add_json("state/events.json", snapshot.events)
    else:
        bundle.notes.append(f"state store: {snapshot.reason}")
    # Benchmark history and other exported JSON lines live beside the database.
    if config.state_dir.is_dir():
        for path in sorted(config.state_dir.glob("*.jsonl")):
            bundle.add_file(f"state/{path.name}", path, STATE_FILE_LIMIT_BYTES)


def add_includes(bundle: Bundle, config: Config, includes: Sequence[Path]) -> None:
    refused = secret_files(config) | {(config.state_dir / DB_NAME).resolve()}
    for path in includes:
        name = f"include/{path.name or 'file'}"
        resolved = path.expanduser().resolve()
        if resolved in refused:
            bundle.skip(
                name,
                f"{path} is a secret file named by the configuration (or the "
                "state database): never included",
            )
        elif not resolved.is_file():
            bundle.skip(name, f"{path} is not a regular file")
        else:
            bundle.add_file(name, resolved, INCLUDE_LIMIT_BYTES)


async def build_bundle(
    config: Config,
    options: DiagOptions,
    argv: Sequence[str] = (),
    shared: SharedServices | None = None,
) -> tuple[Path, Bundle]:
    """`shared`: services the collectors share (tests put a fake NVML backend there)."""
    now = time.time()
    bundle = Bundle(Redactor())
    check_options = CheckOptions(
        torch=options.run_torch_probe,
        process_gap=options.process_gap,
        nvidia_proc_version=options.nvidia_proc_version,
    )
    smi_task = asyncio.create_task(asyncio.to_thread(run_nvidia_smi))
    report = await run_check(config, check_options, shared)
    versions = collect_versions(options.nvidia_proc_version)
    versions["nvidia"] = report.nvidia_versions  # from NVML, when the driver answered
    if report.torch_probe and "version" in report.torch_probe:
        versions["torch_runtime"] = {
            k: report.torch_probe.get(k) for k in ("version", "cuda_build")
        }
    bundle.add_json("versions.json", versions)
    bundle.add_json("check.json", {**report.to_dict(), "torch_probe": report.torch_probe})
    for name, result in sorted(report.collectors.items()):
        bundle.add_json(f"collectors/{name}.json", result.to_dict())
    if report.kernel_log is not None:
        bundle.add_json("kernel-log/findings.json", report.kernel_log.to_dict())
        lines = report.kernel_log.raw_lines()
        if lines:
            bundle.add_text("kernel-log/nvidia-and-io-lines.txt", "\n".join(lines) + "\n")
        if report.kernel_log.error:
            bundle.notes.append(f"kernel log: {report.kernel_log.error}")
    smi_text, smi_note = await smi_task
    if smi_text:
        bundle.add_text("nvidia-smi-q.txt", smi_text)
    if smi_note:
        bundle.notes.append(smi_note)
    index = await checkpoint_index(config)
    if index is not None:  # names, sizes, steps, checksums and ages; never contents
        bundle.add_json("checkpoints/index.json", index)
    add_config(bundle, config)
    await add_live_agent(bundle, config)
    add_state(bundle, config, options.event_limit)
    add_includes(bundle, config, options.includes)
    header = {
        "format": BUNDLE_FORMAT,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        "node_id": config.node_id,
        "hostname": socket.gethostname(),
        "gpuwarden_version": __version__,
        "command": ["gpuwarden", "diag", *argv],
    }
    bundle.finish(header)
    output = options.output or default_output(config.node_id, now)
    top = output.name.removesuffix(".tar.gz").removesuffix(".tgz") or "gpuwarden-diag"
    write_atomically(output, lambda handle: bundle.write_tar(handle, top, now))
    return output, bundle
