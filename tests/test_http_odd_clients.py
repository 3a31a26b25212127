"""Both HTTP endpoints (the agent's and the watcher's) under odd but lawful clients, on real
loopback sockets: what a client sends on one connection, and how the answers it reads back
are framed.

The servers under test are the real ones: the agent's PrometheusSink inside a running
Runtime, the watcher's MetricsServer, and a bare ScrapeServer with a responder of our own.
The answers are read raw, off the socket, and split into responses by their own framing
(Content-Length; none after HEAD), as a keep-alive client does: a byte too many or too few
is the next response's status line gone wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.program import config_file as config_module
from agent.program import registry
from agent.program.watch.fleet import SETTLE_SECONDS, Fleet
from agent.program.watch.metrics import MetricsServer
from agent.runtime.core import Runtime
from agent.runtime.state import StateStore
from exporters.http import Answer, ScrapeServer
from exporters.prometheus import PrometheusSink
from tests.support.ports import free_port
from tests.support.waiting import until

T0 = 1_700_000_000.0


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes


def split_replies(data: bytes, methods: list[str]) -> tuple[list[Reply], bytes]:
    """The responses in `data`, one per request method sent, framed as a keep-alive client
    frames them; and what is left over (b'' when every byte belonged to a response)."""
    replies = []
    for method in methods:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if not sep:
            break
        lines = head.decode("latin-1").split("\r\n")
        version, status, *_ = lines[0].split(" ")
        assert version == "HTTP/1.1", f"not a status line: {lines[0]!r}"
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = 0 if method == "HEAD" else int(headers.get("content-length", "0"))
        replies.append(Reply(int(status), headers, rest[:length]))
        data = rest[length:]
    return replies, data


async def exchange(port: int, requests: list[bytes]) -> bytes:
    """Send every request on one connection (pipelined), read until the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"".join(requests))
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10.0)
    finally:
        writer.close()


def get(method: str, path: str, close: bool = False) -> bytes:
    last = "Connection: close\r\n" if close else ""
    return f"{method} {path} HTTP/1.1\r\nHost: x\r\n{last}\r\n".encode()


# -- the three servers ------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def agent_endpoint(tmp_path: Path) -> AsyncIterator[int]:
    cfg = config_module.parse(
        {
            "node_id": "n",
            "state_dir": str(tmp_path / "state"),
            "prometheus": {"listen": f"127.0.0.1:{free_port()}"},
        }
    )
    runtime = Runtime(
        cfg, StateStore.open(cfg.state_dir), collectors=registry.COLLECTORS, sinks=registry.SINKS
    )
    await runtime.start()
    try:
        await until(runtime.first_round.is_set, what="the first round")  # /healthz settled
        sink = runtime.sinks["prometheus"]
        assert isinstance(sink, PrometheusSink)
        yield sink.address[1]
    finally:
        await runtime.stop()
        runtime.store.close()


def connected_fleet() -> Fleet:
    fleet = Fleet(now=T0, inventory=("a",))
    fleet.broker_connected(T0 - SETTLE_SECONDS)
    fleet.ingest(
        "gpuwarden/v1/a/status",
        json.dumps({"state": "online", "bdseq": 1, "ts": T0}).encode(),
        False,
        T0,
    )
    return fleet


@contextlib.asynccontextmanager
async def watcher_endpoint() -> AsyncIterator[int]:
    server = MetricsServer(connected_fleet(), "127.0.0.1", 0, clock=lambda: T0)
    await server.start()
    try:
        yield server.port
    finally:
        server.http.close()
        await server.stop()


async def fixed(head: bytes, client: str) -> Answer:
    """A responder whose answer depends on the path only: /e<status> answers that status."""
    path = head.split(b" ", 2)[1].decode()
    if path.startswith("/e"):
        return int(path[2:]), {}, b"an error, explained\n"
    return 200, {}, b"body of " + path.encode() + b"\n"


@contextlib.asynccontextmanager
async def bare_server() -> AsyncIterator[int]:
    server = ScrapeServer(fixed)
    listening = await server.listen("127.0.0.1", 0)
    try:
        yield int(listening.sockets[0].getsockname()[1])
    finally:
        listening.close()
        server.close()


@dataclass(frozen=True)
class Endpoint:
    kind: str
    port: int


@pytest.fixture(params=["agent", "watcher", "bare"])
async def endpoint(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Endpoint]:
    """Each of the three servers, listening on a free loopback port."""
    kind = str(request.param)
    served = {"agent": lambda: agent_endpoint(tmp_path), "watcher": watcher_endpoint}
    async with served.get(kind, bare_server)() as port:
        yield Endpoint(kind, port)


# -- HEAD -------------------------------------------------------------------------------------

PATHS = {
    "agent": ["/metrics", "/healthz", "/", "/nope"],
    "watcher": ["/metrics", "/healthz", "/nope"],
    "bare": ["/metrics", "/e404", "/e503", "/e429"],
}


class TestHead:
    """A HEAD answer has the headers GET would have and no body, on every path and status:
    a body after it is read, by a client keeping the connection, as the start of the next
    answer (a load balancer's `HEAD /healthz` check, then its next check, say)."""

    async def test_head_then_get_on_one_connection(self, endpoint: Endpoint) -> None:
        for path in PATHS[endpoint.kind]:
            data = await exchange(endpoint.port, [get("HEAD", path), get("GET", path, True)])
            replies, rest = split_replies(data, ["HEAD", "GET"])
            assert rest == b"", (path, data)
            head, got = replies
            assert head.status == got.status, path
            assert head.body == b""
            # The length GET sends (a /metrics body may differ between two renderings: its
            # process_* series move; the framing is what matters, checked above).
            if path != "/metrics":
                assert head.headers["content-length"] == str(len(got.body)), path
                assert got.body
