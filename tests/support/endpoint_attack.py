"""Attacks on an HTTP endpoint from the same network, and a scraper that counts its answers.

Loopback only: the attackers connect from 127.0.0.2 and up (other hosts, as the endpoint sees
them), the scraper from 127.0.0.1. Every loop is bounded by a deadline.

- idle: N connections that send nothing, each reopened as soon as the server closes it.
- slowloris: N connections that send a request line and then one header line every 0.3 s.
- flood: N concurrent clients, each sending GET /metrics, reading the answer, again.
- guess: N concurrent clients sending basic auth with wrong passwords, as fast as answered.
- pipeline: N connections that each send 200 GETs at once and never read the answers.
- oversize: N clients sending request heads over 8 KiB, or a 1 MiB body, over and over.
- reset: N clients that connect, send part of a request or all of it, and reset.
- trusted-idle: N connections as idle's, from clients that first scrape once (answered, so
  "served" as a scraper is), then hold idle connections.

Run an attack in its own process (so that it does not share the scraper's CPU time slice):
    python -m tests.support.endpoint_attack KIND HOST PORT SECONDS COUNT [SOURCES]
It prints one JSON line: connections opened and answers read.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.client
import json
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KINDS = ("idle", "slowloris", "flood", "guess", "pipeline", "oversize", "reset", "trusted-idle")


@dataclass
class Tally:
    connections: int = 0
    answers: int = 0


Attack = Callable[[str, int, str, float, Tally], Awaitable[None]]


async def _connect(
    host: str, port: int, source: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(host, port, local_addr=(source, 0))


async def _idle(host: str, port: int, source: str, stop: float, tally: Tally) -> None:
    while time.monotonic() < stop:
        try:
            reader, writer = await _connect(host, port, source)
        except OSError:
            await asyncio.sleep(0.05)
            continue
        tally.connections += 1
        with contextlib.suppress(OSError, TimeoutError):
            await asyncio.wait_for(reader.read(), max(stop - time.monotonic(), 0.01))
        writer.close()


async def _slowloris(host: str, port: int, source: str, stop: float, tally: Tally) -> None:
    while time.monotonic() < stop:
        try:
            reader, writer = await _connect(host, port, source)
        except OSError:
            await asyncio.sleep(0.05)
            continue
        tally.connections += 1
        try:
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            number = 0
            while time.monotonic() < stop and not reader.at_eof():
                number += 1
                writer.write(b"X-%d: y\r\n" % number)
                await writer.drain()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(reader.read(1), 0.3)
        except OSError:
            pass
        writer.close()


async def _get(host: str, port: int, source: str, stop: float, tally: Tally, *, auth: str) -> None:
    request = f"GET /metrics HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n".encode()
    while time.monotonic() < stop:
        try:
            reader, writer = await _connect(host, port, source)
        except OSError:
            await asyncio.sleep(0.01)
            continue
        tally.connections += 1
        try:
            writer.write(request)
            if await asyncio.wait_for(reader.read(), max(stop - time.monotonic(), 0.01)):
                tally.answers += 1
        except (OSError, TimeoutError):
            pass
        writer.close()


async def _flood(host: str, port: int, source: str, stop: float, tally: Tally) -> None:
    await _get(host, port, source, stop, tally, auth="")


async def _guess(host: str, port: int, source: str, stop: float, tally: Tally) -> None:
    header = "Authorization: Basic " + base64.b64encode(b"prometheus:wrong-guess").decode()
    await _get(host, port, source, stop, tally, auth=header + "\r\n")


async def _pipeline(host: str, port: int, source: str, stop: float, tally: Tally) -> None:
    requests = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 200
    while time.monotonic() < stop:
        try:
            reader, writer = await _connect(host, port, source)
        except OSError:
            await asyncio.sleep(0.05)
            continue
        tally.connections += 1
        with contextlib.suppress(OSError):
            writer.write(requests)
            # Never read: wait, with the answers piling up, for the server to give up.
            while time.monotonic() < stop and not writer.is_closing():
                await asyncio.sleep(0.1)
                if reader.exception() is not None or reader.at_eof():
                    break
        writer.close()


OVERSIZE = (
    b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\n" + b"X-Many: v\r\n" * 2000 + b"\r\n",
    b"POST /metrics HTTP/1.1\r\nContent-Length: 1048576\r\n\r\n" + b"b" * (1 << 20),
    b"GET /metrics HTTP/1.1\r\nContent-Length: 1048576\r\n\r\n" + b"b" * (1 << 20),
)


async def _oversize(host: str, port: int, source: str, stop: float, tally: Tally) -> None:
    number = 0
    while time.monotonic() < stop:
        try:
            reader, writer = await _connect(host, port, source)
        except OSError:
            await asyncio.sleep(0.05)
            continue
        tally.connections += 1
        number += 1
        try:
            writer.write(OVERSIZE[number % len(OVERSIZE)])
            await writer.drain()
            if await asyncio.wait_for(reader.read(), max(stop - time.monotonic(), 0.01)):
                tally.answers += 1
        except (OSError, TimeoutError):
            pass
        writer.close()


RESET = (b"", b"GET /metr", b"GET /metrics HTTP/1.1\r\n\r\n", b"GET /metrics HTTP/1.1\r\n" * 20)


async def _reset(host: str, port: int, source: str, stop: float, tally: Tally) -> None:
    number = 0
    while time.monotonic() < stop:
        try:
            _, writer = await _connect(host, port, source)
        except OSError:
            await asyncio.sleep(0.05)
            continue
        tally.connections += 1
        number += 1
        with contextlib.suppress(OSError):
            writer.write(RESET[number % len(RESET)])
            await writer.drain()
            await asyncio.sleep(0.001 * (number % 3))
        with contextlib.suppress(OSError):  # linger 0: close() sends an RST, not a FIN
            writer.get_extra_info("socket").setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
            )
        writer.transport.abort()
        await asyncio.sleep(0.01)


async def _trusted_idle(host: str, port: int, source: str, stop: float, tally: Tally) -> None:
    with contextlib.suppress(OSError, TimeoutError):
        reader, writer = await _connect(host, port, source)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        if await asyncio.wait_for(reader.read(), max(stop - time.monotonic(), 0.01)):
            tally.answers += 1
        writer.close()
    await _idle(host, port, source, stop, tally)


ATTACKS: dict[str, Attack] = {
    "trusted-idle": _trusted_idle,
    "idle": _idle,
    "slowloris": _slowloris,
    "flood": _flood,
    "guess": _guess,
    "pipeline": _pipeline,
    "oversize": _oversize,
    "reset": _reset,
}


async def attack(
    kind: str, host: str, port: int, *, seconds: float, count: int, sources: int
) -> Tally:
    tally = Tally()
    stop = time.monotonic() + seconds
    addresses = [f"127.0.0.{2 + i % sources}" for i in range(count)]
    await asyncio.gather(*(ATTACKS[kind](host, port, a, stop, tally) for a in addresses))
    return tally


def start_attack(
    kind: str, port: int, seconds: float, count: int, sources: int = 1
) -> subprocess.Popen[str]:
    """The attack in a child process; it ends by itself after `seconds`."""
    command = [sys.executable, "-m", "tests.support.endpoint_attack", kind, "127.0.0.1"]
    command += [str(port), str(seconds), str(count), str(sources)]
    return subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, text=True)


def finish_attack(process: subprocess.Popen[str], timeout: float = 30.0) -> Tally:
    out, _ = process.communicate(timeout=timeout)
    if process.returncode != 0:
        raise RuntimeError(f"attack exited with {process.returncode}")
    return Tally(**json.loads(out.strip().splitlines()[-1]))


@dataclass
class Scrapes:
    ok: int = 0
    failed: int = 0

    @property
    def ratio(self) -> float:
        total = self.ok + self.failed
        return self.ok / total if total else 0.0


def scrape(
    port: int,
    seconds: float,
    interval: float = 0.5,
    timeout: float = 2.0,
    authorization: str | None = None,
    *,
    keep: bool = False,
) -> Scrapes:
    """GET /metrics every `interval` s for `seconds` s from 127.0.0.1 on a new connection each
    time (the harder case: it must be let in), or on one kept connection (`keep`: Prometheus'
    way; a new one after a failure), counting answers 200 within `timeout`."""
    result = Scrapes()
    stop = time.monotonic() + seconds
    headers = {"Authorization": authorization} if authorization else {}
    connection: http.client.HTTPConnection | None = None
    while (started := time.monotonic()) < stop:
        if connection is None:
            connection = http.client.HTTPConnection(
                "127.0.0.1", port, timeout=timeout, source_address=("127.0.0.1", 0)
            )
        try:
            connection.request("GET", "/metrics", headers=headers)
            answer = connection.getresponse()
            answer.read()
            ok = answer.status == 200 and time.monotonic() - started <= timeout
        except (OSError, http.client.HTTPException):
            ok = False
        if not (ok and keep):
            connection.close()
            connection = None
        result.ok += ok
        result.failed += not ok
        time.sleep(max(0.0, started + interval - time.monotonic()))
    if connection is not None:
        connection.close()
    return result


@dataclass
class FirstScrapes:
    ok: int = 0
    failed: int = 0
    slowest: float = 0.0
    """Seconds the slowest answered one took."""
    took: list[float] = field(default_factory=list)
    """Seconds each answered one took, in order."""


def first_scrapes(
    port: int, sources: list[str], interval: float = 0.1, timeout: float = 2.0
) -> FirstScrapes:
    """One GET /metrics from each address in `sources`, one after the other: each the first
    scrape of a client the server has never answered (a Prometheus starting, or the second of
    an HA pair), counted when answered 200 within `timeout`."""
    result = FirstScrapes()
    for source in sources:
        started = time.monotonic()
        connection = http.client.HTTPConnection(
            "127.0.0.1", port, timeout=timeout, source_address=(source, 0)
        )
        try:
            connection.request("GET", "/metrics")
            answer = connection.getresponse()
            answer.read()
            took = time.monotonic() - started
            ok = answer.status == 200 and took <= timeout
        except (OSError, http.client.HTTPException):
            ok, took = False, 0.0
        finally:
            connection.close()
        result.ok += ok
        result.failed += not ok
        if ok:
            result.slowest = max(result.slowest, took)
            result.took.append(took)
        time.sleep(max(0.0, started + interval - time.monotonic()))
    return result


def main(argv: list[str]) -> int:
    kind, host, port, seconds, count = argv[:5]
    sources = int(argv[5]) if len(argv) > 5 else 1
    run = attack(kind, host, int(port), seconds=float(seconds), count=int(count), sources=sources)
    tally = asyncio.run(run)
    print(json.dumps({"connections": tally.connections, "answers": tally.answers}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
