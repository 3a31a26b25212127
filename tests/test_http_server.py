"""exporters/http.py: the budget, the deadlines and keep-alive, on real loopback sockets.

Each test runs a ScrapeServer on a free port with a responder it controls, and plays the
clients with plain sockets bound to chosen loopback addresses (to the server, an address is
a client).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from exporters.http import Answer, HeadReader, ScrapeServer, client_key, may_keep_alive, read_head
from tests.support.tls import Authority
from tests.support.waiting import until

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_PYTHON = "/usr/bin/python3"
GET = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
GET_CLOSE = b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


class Gate:
    """A responder that answers 200 while `open` is set: clear it to keep requests busy."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.open.set()

    async def __call__(self, head: bytes, client: str) -> Answer:
        await self.open.wait()
        return 200, {}, b"ok\n"


@contextlib.asynccontextmanager
async def running(server: ScrapeServer) -> AsyncIterator[int]:
    listening = await server.listen("127.0.0.1", 0)
    try:
        yield int(listening.sockets[0].getsockname()[1])
    finally:
        listening.close()


@pytest.fixture
async def served() -> AsyncIterator[tuple[ScrapeServer, Gate, int]]:
    gate = Gate()
    server = ScrapeServer(gate, max_connections=6, per_client=3)
    async with running(server) as port:
        try:
            yield server, gate, port
        finally:
            gate.open.set()


async def connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    client = socket.socket()
    client.bind((source, 0))
    client.setblocking(False)
    await asyncio.get_running_loop().sock_connect(client, ("127.0.0.1", port))
    return client


async def send(client: socket.socket, data: bytes) -> None:
    await asyncio.get_running_loop().sock_sendall(client, data)


async def receive(client: socket.socket, timeout: float = 5.0) -> bytes:
    """One read: b'' once the server closed or reset the connection."""
    try:
        return await asyncio.wait_for(asyncio.get_running_loop().sock_recv(client, 65536), timeout)
    except ConnectionResetError:
        return b""


async def read_all(client: socket.socket, timeout: float = 5.0) -> bytes:
    """Everything until the server closes."""
    data = b""
    while chunk := await receive(client, timeout):
        data += chunk
    return data


async def request(port: int, source: str = "127.0.0.1") -> bytes:
    """One GET with Connection: close on a new connection: the whole answer."""
    client = await connect(port, source)
    with client:
        await send(client, GET_CLOSE)
        return await read_all(client)


class TestDeadlines:
    """A client that does not send its request in time is closed, and counted."""

    async def test_silent_and_slow_heads_are_closed(
        self, served: tuple[ScrapeServer, Gate, int]
    ) -> None:
        server, _, port = served
        server.header_timeout = 0.3
        silent = await connect(port)
        slow = await connect(port)
        await send(slow, b"GET /metrics HTTP/1.1\r\n")  # and never the rest
        with silent, slow:
            assert await read_all(silent) == b""
            assert await read_all(slow) == b""
        assert server.dropped["header_timeout"] == 2
        await until(lambda: server.open_connections == 0, what="both gone")

    async def test_tls_handshake_is_inside_the_deadline_and_the_budget(
        self, tmp_path: Path
    ) -> None:
        """A client that opens the TLS port and never says hello is counted and closed like
        a silent one; a real TLS client is answered."""
        authority = Authority(tmp_path / "ca").create()
        issued = authority.issue("localhost", ip_addresses=("127.0.0.1",))
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(issued.cert, issued.key)
        server = ScrapeServer(Gate(), tls=context)
        server.header_timeout = 0.3
        async with running(server) as port:
            with await connect(port) as silent:
                await until(lambda: server.open_connections == 1, what="counted in handshake")
                assert await read_all(silent) == b""
            assert server.dropped["header_timeout"] == 1
            client = ssl.create_default_context(cafile=str(authority.cert))
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client)
            writer.write(GET_CLOSE)
            assert (await reader.read()).startswith(b"HTTP/1.1 200 ")
            writer.close()


class TestBudget:
    """Waiting connections give way to new ones; connections being answered never do."""

    async def test_full_budget_evicts_the_oldest_waiting_of_the_heaviest_client(
        self, served: tuple[ScrapeServer, Gate, int]
    ) -> None:
        server, _, port = served
        # The budget is 6: .3 connects first, then .2 takes its cap of 3, then .4.
        idle = [await connect(port, "127.0.0.3") for _ in range(2)]
        idle += [await connect(port, "127.0.0.2") for _ in range(3)]
        idle += [await connect(port, "127.0.0.4")]
        await until(lambda: server.open_connections == 6, what="budget full")
        try:
            assert (await request(port, "127.0.0.1")).startswith(b"HTTP/1.1 200 ")
            assert server.dropped["evicted"] == 1
            assert await receive(idle[2]) == b""  # .2's oldest, though .3's are older
            await send(idle[0], GET)
            assert (await receive(idle[0])).startswith(b"HTTP/1.1 200 ")
        finally:
            for client in idle:
                client.close()

    async def test_client_at_its_cap_evicts_its_own_oldest(
        self, served: tuple[ScrapeServer, Gate, int]
    ) -> None:
        server, _, port = served
        mine = [await connect(port, "127.0.0.2") for _ in range(3)]
        other = await connect(port, "127.0.0.3")
        await until(lambda: server.open_connections == 4, what="connected")
        try:
            mine.append(await connect(port, "127.0.0.2"))
            assert await receive(mine[0]) == b""
            for client in (mine[-1], other):  # the newest, and another client's, are served
                await send(client, GET)
                assert (await receive(client)).startswith(b"HTTP/1.1 200 ")
            assert server.dropped["evicted"] == 1
        finally:
            for client in [*mine, other]:
                client.close()

    async def test_connections_being_answered_are_never_evicted(
        self, served: tuple[ScrapeServer, Gate, int]
    ) -> None:
        """With a client's cap taken by requests being answered, its next connection is
        refused 503, and the requests are answered."""
        server, gate, port = served
        gate.open.clear()
        busy = [await connect(port, "127.0.0.2") for _ in range(3)]
        for client in busy:
            await send(client, GET_CLOSE)
        await until(lambda: server.open_connections == 3, what="busy")
        try:
            assert (await request(port, "127.0.0.2")).startswith(b"HTTP/1.1 503 ")
            assert server.dropped == {"refused": 1}
            gate.open.set()
            for client in busy:
                assert (await read_all(client)).startswith(b"HTTP/1.1 200 ")
        finally:
            for client in busy:
                client.close()


class TestKeptScraper:
    """A connection that has been answered and is kept for the next request (a scraper's:
    Prometheus keeps its connection between scrapes) gives way only after every connection
    that never sent a request: evicted, its next request, in flight, would be reset (a
    failed scrape), and a crowd of one-connection clients made it the oldest waiting one."""

    @pytest.mark.parametrize("opening", [b"", b"GET /metrics HTTP/1.1\r\n"], ids=["idle", "slow"])
    async def test_the_budget_evicts_new_connections_first(
        self, served: tuple[ScrapeServer, Gate, int], opening: bytes
    ) -> None:
        server, _, port = served
        with await connect(port) as scraper:
            await send(scraper, GET)
            assert b"keep-alive" in await receive(scraper)
            # Five clients of one connection each, then more: the budget (6) is full.
            crowd = [await connect(port, f"127.0.0.{2 + i}") for i in range(8)]
            try:
                for client in crowd:
                    if opening:
                        await send(client, opening)
                await until(lambda: server.dropped["evicted"] == 3, what="three evicted")
                await send(scraper, GET)
                assert (await receive(scraper)).startswith(b"HTTP/1.1 200 ")
            finally:
                for client in crowd:
                    client.close()

    @pytest.mark.parametrize("opening", [b"", b"GET /metrics HTTP/1.1\r\n"], ids=["idle", "slow"])
    async def test_a_served_clients_new_connection_outlives_a_crowd_of_hosts(
        self, served: tuple[ScrapeServer, Gate, int], opening: bytes
    ) -> None:
        """Between a scraper's connect and its request come more hosts than the budget, one
        connection each (none holds the most): the crowd gives way to itself, not to the
        client already served, whose new connection was the oldest waiting 6 connects on."""
        server, _, port = served
        assert (await request(port)).startswith(b"HTTP/1.1 200 ")  # served once, and gone
        with await connect(port) as scraper:
            await until(lambda: server.open_connections == 1, what="the scraper connected")
            crowd = [await connect(port, f"127.0.0.{2 + i}") for i in range(12)]
            try:
                for client in crowd:
                    if opening:
                        await send(client, opening)
                await until(lambda: server.dropped["evicted"] == 7, what="seven evicted")
                await send(scraper, GET)
                assert (await receive(scraper)).startswith(b"HTTP/1.1 200 ")
            finally:
                for client in crowd:
                    client.close()

    async def test_a_client_at_its_cap_gives_up_a_new_connection_first(
        self, served: tuple[ScrapeServer, Gate, int]
    ) -> None:
        server, _, port = served
        with await connect(port) as scraper:
            await send(scraper, GET)
            assert b"keep-alive" in await receive(scraper)
            mine = [await connect(port) for _ in range(4)]  # its cap is 3
            try:
                await until(lambda: server.dropped["evicted"] == 2, what="two evicted")
                await send(scraper, GET)
                assert (await receive(scraper)).startswith(b"HTTP/1.1 200 ")
                assert await receive(mine[0]) == b""
            finally:
                for client in mine:
                    client.close()


def queued(port: int, source: str, data: bytes = b"") -> socket.socket:
    """A connection made, and `data` sent, without a turn of the loop: queued in the kernel
    for the server's next burst of accepts, unread."""
    client = socket.socket()
    client.bind((source, 0))
    client.connect(("127.0.0.1", port))  # the kernel completes it; no accept needed
    if data:
        client.sendall(data)
    client.setblocking(False)
    return client


class TestRequestHere:
    """A connection whose whole request head has come is waiting for the server, not for its
    client: it is never the one given up. A burst of accepts admits many connections before
    any is read: a new scraper's (never answered, the oldest, so the first victim by every
    other rule) has its request queued with them, unread."""

    @pytest.mark.parametrize(
        "head",
        [
            GET,
            b"GET /metrics HTTP/1.1\nHost: x\n\n",  # bare LF lines
            b"\r\nGET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",  # an empty line before
            b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: y\r\n" * 300 + b"\r\n",
        ],
        ids=["crlf", "lf", "leading-empty-line", "large"],
    )
    @pytest.mark.parametrize("crowd", [6, 12, 40])
    async def test_a_new_scrapers_request_queued_in_a_burst_is_answered(
        self, served: tuple[ScrapeServer, Gate, int], head: bytes, crowd: int
    ) -> None:
        server, _, port = served
        # The loop does not run between these: one burst, the scraper's connection first.
        scraper = queued(port, "127.0.0.1", head)
        strangers = [queued(port, f"127.0.1.{1 + i}") for i in range(crowd)]
        try:
            assert (await receive(scraper)).startswith(b"HTTP/1.1 200 ")
            # Room made for the rest of the burst from the strangers alone (budget 6).
            await until(
                lambda: server.dropped["evicted"] >= crowd + 1 - 6, what="the crowd evicted"
            )
            assert server.dropped["evicted"] == crowd + 1 - 6
        finally:
            scraper.close()
            for client in strangers:
                client.close()

    async def test_a_request_split_over_sends_is_here_once_whole(
        self, served: tuple[ScrapeServer, Gate, int]
    ) -> None:
        """The end of a head cut between two reads (CRLF, CR LF) is found; half a head is not
        a request (a slowloris's never is), and goes first."""
        server, _, port = served
        half = queued(port, "127.0.0.1", b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        whole = queued(port, "127.0.0.2", b"GET /metrics HTTP/1.1\r\nHost: x\r")
        await until(lambda: server.open_connections == 2, what="both admitted")
        await send(whole, b"\n\r")
        await asyncio.sleep(0.05)
        await send(whole, b"\n")  # the end of its head, alone in a read
        strangers = [queued(port, f"127.0.1.{1 + i}") for i in range(5)]
        try:
            assert (await receive(whole)).startswith(b"HTTP/1.1 200 ")
            assert await receive(half) == b""  # evicted: the oldest, and only half here
        finally:
            for client in [half, whole, *strangers]:
                client.close()


HEADS = [GET, b"GET /metrics HTTP/1.1\nHost: x\n\n", b"\r\n" + GET, b"GET / HTTP/1.1\r\n\n"]


def feed(reader: HeadReader, data: bytes) -> None:
    """As its protocol does (_HeadProtocol.data_received)."""
    reader.arrived(data)
    reader.feed_data(data)


class TestHeadReader:
    """HeadReader.head_here: a whole head fed and not read, however the reads cut it."""

    @pytest.mark.parametrize("head", HEADS)
    async def test_here_exactly_once_its_last_byte_came_whatever_the_cuts(
        self, head: bytes
    ) -> None:
        for first in range(1, len(head)):
            for second in range(first, len(head)):
                reader = HeadReader()
                here = []
                for part in (head[:first], head[first:second], head[second:]):
                    if part:
                        feed(reader, part)
                        here.append(reader.head_here)
                assert here[-1] and not any(here[:-1]), (first, second, here)
                assert await read_head(reader) == head.lstrip(b"\r\n").replace(
                    b"\r\n", b"\n"
                ).replace(b"\n", b"\r\n")
                assert not reader.head_here

    async def test_pipelined_heads_are_here_until_each_is_read(self) -> None:
        reader = HeadReader()
        feed(reader, GET + GET + b"GET /metrics HTTP/1.1\r\n")  # two whole, a part
        here = [reader.head_here]
        for _ in range(2):
            await read_head(reader)
            here.append(reader.head_here)
        feed(reader, b"\r\n")  # the part made whole
        here.append(reader.head_here)
        assert here == [True, True, False, True]


class TestCounts:
    """A client's connections are counted as they open and end, however they end: a count
    left behind would hold the client at its cap (refused 503) with nothing open."""

    @pytest.mark.parametrize("ending", ["answered", "client-closed", "header-timeout", "evicted"])
    async def test_a_client_gets_its_whole_cap_after_its_connections_ended(
        self, served: tuple[ScrapeServer, Gate, int], ending: str
    ) -> None:
        server, _, port = served
        server.header_timeout = 0.3 if ending in ("header-timeout", "evicted") else 2.0
        for _ in range(3):
            # Its cap is 3: a fourth evicts the first.
            count = 4 if ending == "evicted" else 3
            clients = [await connect(port, "127.0.0.2") for _ in range(count)]
            for client in clients:
                if ending == "answered":
                    await send(client, GET_CLOSE)
                    assert (await read_all(client)).startswith(b"HTTP/1.1 200 ")
                elif ending in ("header-timeout", "evicted"):
                    assert await read_all(client) == b""  # timed out, or the 4th evicted one
                client.close()
            await until(lambda: server.open_connections == 0, what="all ended")
        server.header_timeout = 30.0
        dropped = dict(server.dropped)
        mine = [await connect(port, "127.0.0.2") for _ in range(3)]
        try:
            await until(lambda: server.open_connections == 3, what="the cap admitted")
            assert server.dropped == dropped  # none refused, none evicted
        finally:
            for client in mine:
                client.close()


class TestDraining:
    """A connection answered and ending, its unread body still coming (read and dropped for
    up to the linger time), is the first given up: nothing more will be answered on it."""

    async def test_the_budget_evicts_a_draining_connection_first(
        self, served: tuple[ScrapeServer, Gate, int]
    ) -> None:
        server, _, port = served
        with await connect(port, "127.0.0.2") as poster:
            await send(poster, b"POST /metrics HTTP/1.1\r\nContent-Length: 1000000\r\n\r\nxx")
            assert b"Connection: close" in await receive(poster)  # answered; body unread
            crowd = [await connect(port, f"127.0.0.{3 + i}") for i in range(6)]
            try:
                await until(lambda: server.dropped["evicted"] == 1, what="one evicted")
                await send(crowd[0], GET)
                assert (await receive(crowd[0])).startswith(b"HTTP/1.1 200 ")
            finally:
                for client in crowd:
                    client.close()


class TestKeepAlive:
    """HTTP/1.1 connections carry several requests, up to a cap; idle ones give way."""

    async def test_requests_on_one_connection_up_to_the_cap(
        self, served: tuple[ScrapeServer, Gate, int]
    ) -> None:
        server, _, port = served
        server.max_requests = 3
        with await connect(port) as client:
            answers = []
            for _ in range(3):
                await send(client, GET)
                answers.append(await receive(client))
            assert [b"Connection: keep-alive" in a for a in answers] == [True, True, False]
            assert b"Connection: close" in answers[-1]
            assert await receive(client) == b""  # closed after the last one

    async def test_idle_keep_alive_times_out_and_gives_way(
        self, served: tuple[ScrapeServer, Gate, int]
    ) -> None:
        server, _, port = served
        server.idle_timeout = 0.3
        with await connect(port) as client:
            await send(client, GET)
            assert b"keep-alive" in await receive(client)
            assert await receive(client) == b""
        assert server.dropped["idle_timeout"] == 1
        # Idle between requests is waiting: a full budget evicts it.
        server.idle_timeout = 60.0
        kept = [await connect(port, f"127.0.0.{2 + i}") for i in range(6)]
        try:
            for client in kept:
                await send(client, GET)
                assert b"keep-alive" in await receive(client)
            assert (await request(port, "127.0.0.1")).startswith(b"HTTP/1.1 200 ")
            assert server.dropped["evicted"] == 1
        finally:
            for client in kept:
                client.close()

    @pytest.mark.parametrize(
        ("head", "keep"),
        [
            (GET, True),
            (b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n", True),
            (GET_CLOSE, False),
            (b"GET /metrics HTTP/1.1\r\nConnection: Close\r\n\r\n", False),
            (b"GET /metrics HTTP/1.0\r\n\r\n", False),
            (b"GET /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\n", False),
            (b"GET /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n", True),
            (b"GET /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", False),
            (b"POST /metrics HTTP/1.1\r\n\r\n", False),
            (b"garbage\r\n\r\n", False),
        ],
    )
    def test_what_may_keep_the_connection(self, head: bytes, keep: bool) -> None:
        """Only a body-less HTTP/1.1 GET or HEAD that did not ask to close: an unread body
        would be taken for the next request."""
        assert may_keep_alive(head) is keep


@pytest.mark.parametrize(
    ("address", "client"),
    [
        ("192.0.2.7", "192.0.2.7"),
        ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),
        ("2001:db8:1:2:ffff::9", "2001:db8:1:2::/64"),
        ("fe80::1%eth0", "fe80::/64"),
        ("::ffff:192.0.2.7", "192.0.2.7"),
        ("/run/socket", "/run/socket"),
    ],
)
def test_a_client_is_an_ipv4_address_or_an_ipv6_64(address: str, client: str) -> None:
    """One IPv6 host holds a whole /64: counted per address, it would have no limit."""
    assert client_key(address) == client


# The interpreters the agent runs on here: the venv's, and the system's the Debian package's
# venv is made from (Debian 12: 3.11.2, whose socket transport ignores a pause made in
# connection_made: a ClientHello read as plain data and the handshake timing out).
INTERPRETERS = sorted(
    {sys.executable, *([PACKAGE_PYTHON] if Path(PACKAGE_PYTHON).exists() else [])}
)


@pytest.mark.parametrize("python", INTERPRETERS)
def test_every_tls_handshake_succeeds_under_each_interpreter(python: str, tmp_path: Path) -> None:
    authority = Authority(tmp_path / "ca").create()
    issued = authority.issue("localhost", ip_addresses=("127.0.0.1",))
    done = subprocess.run(
        [
            python,
            "-m",
            "tests.support.tls_handshakes",
            str(issued.cert),
            str(issued.key),
            str(authority.cert),
            "20",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert (result["ok"], result["failures"]) == (20, []), result
