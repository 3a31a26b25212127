"""Host probes for `check` that no collector does: the state dir, the network endpoints the
agent will use, and whether the installed torch runs on this driver (in a child process)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import json
import os
import socket
import ssl
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.program.diagnose.findings import Finding, Status
from collectors.benchmark import torch_probe

CONNECT_TIMEOUT = 3.0
"""Seconds for a TCP connect or TLS handshake: a healthy broker on the same network answers in
milliseconds, and check must finish in seconds."""


def check_state_dir(state_dir: Path) -> Finding:
    """Writable without writing: permission bits for this user, and not a read-only mount."""
    return dataclasses.replace(_state_dir(state_dir), check="state_dir", subject=str(state_dir))


def _state_dir(state_dir: Path) -> Finding:
    name = f"state dir {state_dir}"
    existing = state_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        return Finding(
            "state",
            name,
            Status.FAIL,
            f"{existing} exists and is not a directory",
            f"remove {existing} or point state_dir elsewhere",
        )
    try:
        read_only = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
    except OSError as exc:
        return Finding(
            "state",
            name,
            Status.FAIL,
            f"cannot stat {existing}: {exc.strerror}",
            "check the mount behind state_dir",
        )
    if read_only:
        return Finding(
            "state",
            name,
            Status.FAIL,
            f"{existing} is on a read-only file system",
            "put state_dir on a writable file system (events and the outbox live there)",
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        return Finding(
            "state",
            name,
            Status.FAIL,
            f"{existing} is not writable by uid {os.getuid()}",
            "chown the directory to the gpuwarden user, or set state_dir",
        )
    if existing != state_dir:
        return Finding(
            "state",
            name,
            Status.OK,
            f"does not exist yet; the agent can create it under {existing}",
        )
    return Finding("state", name, Status.OK, "exists and is writable")


# -- network ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    tls: bool


@dataclass(frozen=True)
class TlsFiles:
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None


async def probe_tcp(
    endpoint: Endpoint, files: TlsFiles = TlsFiles(), timeout: float = CONNECT_TIMEOUT
) -> str:
    """Connect (and handshake when TLS); returns a short description, raises OSError."""
    context: ssl.SSLContext | None = None
    if endpoint.tls:
        # As the MQTT sink connects: the system CAs or ca_file, host name checked.
        context = ssl.create_default_context(cafile=str(files.ca_file) if files.ca_file else None)
        if files.cert_file is not None and files.key_file is not None:
            context.load_cert_chain(files.cert_file, files.key_file)
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(
            endpoint.host,
            endpoint.port,
            ssl=context,
            server_hostname=endpoint.host if context else None,
        ),
        timeout,
    )
    del reader
    detail = "TCP connect ok"
    if context is not None:
        tls_object = writer.get_extra_info("ssl_object")
        version = tls_object.version() if tls_object is not None else "?"
        detail = f"TLS handshake ok ({version}, certificate verified)"
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return detail


def describe_network_error(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "no answer (timed out)"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS certificate not accepted: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        return f"TLS handshake failed: {exc.reason or exc}"
    if isinstance(exc, socket.gaierror):
        return f"name does not resolve ({exc.strerror})"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (nothing listens there)"
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return str(exc)


async def check_broker(endpoint: Endpoint, files: TlsFiles = TlsFiles()) -> Finding:
    where = f"{endpoint.host}:{endpoint.port}"
    line = await _broker(endpoint, files, where)
    return dataclasses.replace(line, check="mqtt_broker", subject=where)


async def _broker(endpoint: Endpoint, files: TlsFiles, where: str) -> Finding:
    name = "MQTT broker"
    try:
        detail = await probe_tcp(endpoint, files)
    except (OSError, TimeoutError) as exc:
        return Finding(
            "network",
            f"{name} {where}",
            Status.FAIL,
            describe_network_error(exc),
            "check that the broker runs and that the network and firewall let this host reach "
            f"{where}; events queue in the outbox meanwhile",
        )
    return Finding("network", f"{name} {where}", Status.OK, detail)


async def check_prometheus_listen(host: str, port: int, tls: bool = False) -> Finding:
    """If something answers there, ask /healthz; otherwise make sure the agent could bind."""
    line = await _prometheus_listen(host, port, tls)
    return dataclasses.replace(line, check="prometheus_listen", subject=f"{host}:{port}")


async def _prometheus_listen(host: str, port: int, tls: bool) -> Finding:
    name = f"Prometheus listen {host}:{port}"
    # Only "is the agent serving here?": whether scrapers trust its certificate is theirs to
    # check, so this one probe does not verify it.
    context = _insecure_client_context() if tls else None
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=context), CONNECT_TIMEOUT
        )
    except (OSError, TimeoutError) as exc:
        if not isinstance(exc, ConnectionRefusedError):
            return Finding(
                "network",
                name,
                Status.FAIL,
                describe_network_error(exc),
                "set [prometheus] listen to an address of this host",
            )
        return _check_bindable(name, host, port)
    try:
        writer.write(f"GET /healthz HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
        await writer.drain()
        head = await asyncio.wait_for(reader.read(512), CONNECT_TIMEOUT)
    except (OSError, TimeoutError) as exc:
        return Finding(
            "network",
            name,
            Status.WARN,
            f"something listens there but did not answer /healthz ({describe_network_error(exc)})",
            "check which process holds the port: ss -ltnp",
        )
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    status_line = head.split(b"\r\n", 1)[0].decode("latin-1")
    if " 200 " in f"{status_line} ":
        return Finding("network", name, Status.OK, "the agent is serving (healthz 200)")
    if " 401 " in f"{status_line} ":
        return Finding("network", name, Status.OK, "the agent is serving (basic auth required)")
    if " 503" in status_line:
        return Finding(
            "network",
            name,
            Status.WARN,
            "the agent is serving but reports itself degraded",
            f"curl http://{host}:{port}/healthz for the reasons",
        )
    return Finding(
        "network",
        name,
        Status.WARN,
        f"another server answers there ({status_line or 'no reply'})",
        "check which process holds the port (ss -ltnp), or change [prometheus] listen",
    )


HTTP_LIMIT_BYTES = 32 * 2**20


def _insecure_client_context() -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


async def http_get(
    host: str, port: int, path: str, tls: bool = False, timeout: float = CONNECT_TIMEOUT
) -> tuple[int, bytes]:
    """(status, body) of one HTTP/1.0 GET to the local agent; raises OSError or TimeoutError."""
    context = _insecure_client_context() if tls else None
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(host, port, ssl=context), timeout
    )
    try:
        writer.write(f"GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(HTTP_LIMIT_BYTES), timeout * 3)
    finally:
        writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):
            await writer.wait_closed()
    head, _, body = raw.partition(b"\r\n\r\n")
    parts = head.split(b"\r\n", 1)[0].split()
    status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    return status, body


def _check_bindable(name: str, host: str, port: int) -> Finding:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            action = (
                "set [prometheus] listen to an address of this host"
                if exc.errno == errno.EADDRNOTAVAIL
                else "free the port or change [prometheus] listen"
            )
            return Finding(
                "network",
                name,
                Status.FAIL,
                f"the agent could not listen there: {exc.strerror}",
                action,
            )
    return Finding(
        "network", name, Status.OK, "the agent is not running; the address is free for it"
    )


# -- torch --------------------------------------------------------------------------------------

TORCH_TIMEOUT = 90.0
"""torch import plus CUDA initialisation took 5.5-8 s on the H200 (docs/MEASUREMENTS.md); a cold page
cache on network storage can take much longer."""


async def run_torch_probe(
    python: str = sys.executable, timeout: float = TORCH_TIMEOUT
) -> dict[str, Any]:
    """The child's JSON, or {"error": ...} when it could not give one."""
    try:
        proc = await asyncio.create_subprocess_exec(
            python,
            torch_probe.__file__,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            stdin=asyncio.subprocess.DEVNULL,
        )
    except OSError as exc:
        return {"error": f"cannot run {python}: {exc.strerror}", "not_runnable": True}
    try:
        stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return {"error": f"no answer within {timeout:g} s", "timeout": True}
    lines = stdout.decode(errors="replace").strip().splitlines()
    try:
        result: dict[str, Any] = json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return {"error": f"exit code {proc.returncode}: {tail[0]}"}
    return result


def _torch_action(probe: dict[str, Any], python: str, named_by: str = "--python") -> str:
    """What to do for each way the probe can fail: the interpreter is not there, it did not
    answer in time, or it ran and failed. `named_by`: where the interpreter was named."""
    if probe.get("not_runnable"):
        return (
            f"{named_by} {python} is not an interpreter that runs here: give the path of one "
            "(the training environment's bin/python; `command -v python3` finds one)"
        )
    if probe.get("timeout"):
        return (
            "importing torch took longer than the probe waits: a cold page cache or slow "
            "network storage under the environment; run check again once it is warm"
        )
    return f"run {python} -c 'import torch; print(torch.cuda.is_available())' by hand"


def _major(version: str | None) -> int | None:
    head = (version or "").split(".")[0]
    return int(head) if head.isdigit() else None


def classify_torch(
    probe: dict[str, Any],
    gpus_expected: bool,
    python: str,
    cuda_driver: str | None = None,
    named_by: str = "--python",
) -> Finding:
    """`cuda_driver`: the CUDA version the driver supports (NVML), when known; `named_by`:
    where `python` was named (the command line or the configuration)."""
    name = "torch on this driver"
    if "missing" in probe:
        return Finding("torch", name, Status.NA, f"torch is not installed for {python}")
    if "error" in probe:
        status = Status.WARN if probe.get("timeout") else Status.FAIL
        return Finding(
            "torch",
            name,
            status,
            f"the torch probe failed: {probe['error']}",
            _torch_action(probe, python, named_by),
        )
    version, cuda = probe.get("version", "?"), probe.get("cuda_build")
    build = f"torch {version} (CUDA {cuda})" if cuda else f"torch {version} (CPU-only build)"
    if not gpus_expected:
        return Finding("torch", name, Status.NA, f"{build}; no GPU expected on this host")
    if not cuda:
        return Finding(
            "torch",
            name,
            Status.WARN,
            f"{build}: it cannot use the GPUs",
            "install a CUDA build of torch that this driver supports",
        )
    if not probe.get("available"):
        why = "; ".join(probe.get("warnings", [])) or "torch.cuda.is_available() is False"
        built, supported = _major(cuda), _major(cuda_driver)
        if built is not None and supported is not None and built > supported:
            why = f"it was built for CUDA {cuda}, the driver supports CUDA {cuda_driver} at most; {why}"
        return Finding(
            "torch",
            name,
            Status.FAIL,
            f"{build} cannot use the GPUs: {why}",
            "install a torch built for a CUDA version this driver supports, or update the driver",
        )
    arches = set(probe.get("arch_list", []))
    for major, minor in probe.get("capabilities", []):
        if (
            arches
            and f"sm_{major}{minor}" not in arches
            and not any(a.startswith("compute_") for a in arches)
        ):
            return Finding(
                "torch",
                name,
                Status.FAIL,
                f"{build} has no kernels for compute capability {major}.{minor} ({', '.join(sorted(arches))})",
                "install a torch build that includes this GPU architecture",
            )
    if not probe.get("op_ok"):
        return Finding(
            "torch",
            name,
            Status.FAIL,
            f"{build}: a tiny CUDA operation gave a wrong result",
            "run the benchmark (gpuwarden check --bench) and check the kernel log for Xids",
        )
    return Finding(
        "torch", name, Status.OK, f"{build} runs on {probe.get('device_count', 0)} GPU(s)"
    )
