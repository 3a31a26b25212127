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
import errno
import gzip
import json
import socket
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
from exporters.http import CONTENT_TYPE, Answer, ScrapeServer, request_line
from exporters.prometheus import PrometheusSettings, PrometheusSink
from tests.support.collectors import scripted_runtime
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
    line = request_line(head)
    if len(line) == 3:
        return line
    path = line[1]
    if path.startswith("/e"):
        return int(path[2:]), {}, b"an error, explained\n"
    if path == "/metrics":
        return 200, {"Content-Type": CONTENT_TYPE}, b"body of /metrics\n"
    return 404, {}, b"not found\n"


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
    "bare": ["/metrics", "/nope", "/e503", "/e429"],
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


# -- what the server does not read ------------------------------------------------------------

MB = 1 << 20


def blocking_exchange(port: int, data: bytes) -> bytes:
    """A plain client: send the whole request, then read the answer until the server
    closes. A send the server reset is a failed exchange (AssertionError), as it is to most
    clients: they never get to read the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as client:
        try:
            client.sendall(data)
        except OSError as exc:
            raise AssertionError(f"the request could not be sent whole: {exc!r}") from exc
        answer = b""
        try:
            while chunk := client.recv(65536):
                answer += chunk
        except ConnectionResetError as exc:
            raise AssertionError(f"reset after {answer[:200]!r}") from exc
        return answer


UNREAD = {
    # A request head over the 8 KiB the server reads: one long header, a long target, many
    # headers, a head so long that it is still being sent when the server answers.
    "header-9KiB": (b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n", 431),
    "target-16KiB": (b"GET /metrics?" + b"q" * 16384 + b" HTTP/1.1\r\n\r\n", 431),
    "2000-headers": (
        b"GET /metrics HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(2000)) + b"\r\n",
        431,
    ),
    "header-8MiB": (b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * (8 * MB) + b"\r\n\r\n", 431),
    # A body the server never reads: refused (POST), or ignored (GET), then the connection
    # ends; the client is still sending it.
    "post-8MiB": (b"POST /metrics HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (8 * MB), 405),
    "get-8MiB-body": (b"GET /metrics HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (8 * MB), 200),
    "put-chunked": (
        b"PUT /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n%s\r\n" % (MB, b"c" * MB) * 8
        + b"0\r\n\r\n",
        405,
    ),
}
BODIES = {"post-8MiB": 8 * MB, "get-8MiB-body": 8 * MB}


class TestUnread:
    """A request the server does not read to its end still gets its answer: a clear 431 for
    a head too large, 405 for a method with a body; the rest of the request is taken and
    dropped while the client sends it (a close with it unread resets the connection, and the
    client, still sending, never reads the answer: RFC 9112 section 9.6)."""

    @pytest.mark.parametrize("shape", list(UNREAD))
    async def test_the_client_reads_its_answer(self, endpoint: Endpoint, shape: str) -> None:
        data, status = UNREAD[shape]
        data += b"b" * BODIES.get(shape, 0)
        answer = await asyncio.to_thread(blocking_exchange, endpoint.port, data)
        replies, rest = split_replies(answer, ["GET"])
        assert [r.status for r in replies] == [status], answer[:300]
        assert rest == b""
        assert b"Connection: close" in answer.split(b"\r\n\r\n", 1)[0]

    async def test_a_scrape_after_each(self, endpoint: Endpoint) -> None:
        """The connection that sent too much is gone; the next one is served."""
        for data, _ in UNREAD.values():
            with contextlib.suppress(AssertionError):
                await asyncio.to_thread(blocking_exchange, endpoint.port, data)
        answer = await exchange(endpoint.port, [get("GET", "/metrics", True)])
        assert [r.status for r in split_replies(answer, ["GET"])[0]] == [200]


# -- the request target -----------------------------------------------------------------------

SAME_AS_METRICS = [
    "/metrics?x",
    "/metrics?",
    "/metrics?format=prometheus&x=%20",
    "/%6detrics",  # percent-encoded unreserved characters are the same characters (RFC 3986)
    "/metric%73",
    "http://127.0.0.1/metrics",  # absolute-form, which a server must take (RFC 9112 3.2.2)
    "HTTP://gpu-node-7:9445/metrics?x=1",
    "https://[::1]:9445/metrics",
]
NOT_METRICS = ["//metrics", "/metrics/", "/metricsx", "/metrics%2F", "http://host/metricsx"]


class TestTarget:
    """The path is the target's, whatever form the target takes; a different path is 404."""

    @pytest.mark.parametrize("target", SAME_AS_METRICS)
    async def test_forms_of_metrics(self, endpoint: Endpoint, target: str) -> None:
        answer = await exchange(endpoint.port, [get("GET", target, True)])
        (reply,), _ = split_replies(answer, ["GET"])
        assert reply.status == 200, answer[:200]
        assert reply.headers["content-type"].startswith("text/plain; version=0.0.4")

    @pytest.mark.parametrize("target", NOT_METRICS)
    async def test_other_paths(self, endpoint: Endpoint, target: str) -> None:
        answer = await exchange(endpoint.port, [get("GET", target, True)])
        (reply,), _ = split_replies(answer, ["GET"])
        assert reply.status == 404, answer[:200]


# -- line endings ----------------------------------------------------------------------------

LINE_ENDINGS = {
    "bare-lf": b"GET /metrics HTTP/1.1\n\n",
    "lf-everywhere": b"GET /metrics HTTP/1.1\nHost: x\nAccept: */*\n\n",
    "lf-request-line": b"GET /metrics HTTP/1.1\nHost: x\r\n\r\n",
    "lf-in-headers": b"GET /metrics HTTP/1.1\r\nHost: x\nAccept: */*\r\n\r\n",
    "lf-empty-line": b"GET /metrics HTTP/1.1\r\nHost: x\r\n\n",
    "lf-then-crlf": b"GET /metrics HTTP/1.1\nHost: x\n\r\n",
    "empty-line-first": b"\r\nGET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
    "lf-first": b"\nGET /metrics HTTP/1.1\nHost: x\n\n",
}
LF_CLOSE = b"GET /metrics HTTP/1.1\nHost: x\nConnection: close\n\n"


class TestLineEndings:
    """A line of the request head may end in a bare LF, as RFC 9112 section 2.2 lets a
    recipient take it (curl, Prometheus and browsers send CRLF; a hand-made client, `nc` or a
    script, often sends LF): the request is answered at once, as if it had said CRLF, and
    the connection kept. Empty lines before a request line are skipped (section 2.2, too).
    Taken for a line that never ends, the head used to wait out the header deadline and be
    dropped unanswered."""

    @pytest.mark.parametrize("shape", list(LINE_ENDINGS))
    async def test_answered_and_kept(self, endpoint: Endpoint, shape: str) -> None:
        head = LINE_ENDINGS[shape]
        # Twice on one kept connection, then a request whose LF-ended `Connection: close`
        # must be read as such: the server closes after its answer, which ends the exchange.
        answer = await exchange(endpoint.port, [head, head.replace(b"GET", b"HEAD", 1), LF_CLOSE])
        replies, rest = split_replies(answer, ["GET", "HEAD", "GET"])
        assert [r.status for r in replies] == [200, 200, 200], answer[:300]
        assert rest == b""
        assert replies[0].headers["content-type"].startswith("text/plain; version=0.0.4")
        assert replies[0].headers["connection"] == "keep-alive"
        assert replies[2].headers["connection"] == "close"

    async def test_a_head_too_large_in_lf_lines(self, endpoint: Endpoint) -> None:
        """LF lines count against the 8 KiB of a head like CRLF ones."""
        data = b"GET /metrics HTTP/1.1\n" + b"".join(b"X-%d: v\n" % i for i in range(2000)) + b"\n"
        answer = await asyncio.to_thread(blocking_exchange, endpoint.port, data)
        replies, _ = split_replies(answer, ["GET"])
        assert [r.status for r in replies] == [431], answer[:300]


# -- where it listens -------------------------------------------------------------------------


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


def sink_on(listen: str) -> PrometheusSink:
    runtime, _ = scripted_runtime({"a": "ok"})
    return PrometheusSink(PrometheusSettings(listen=listen), runtime)


class TestListen:
    """The agent listens where it is told, IPv6 included, and a port taken says so."""

    @pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")
    async def test_ipv6(self) -> None:
        sink = sink_on(f"[::1]:{free_port()}")
        await sink.start()
        try:
            assert sink.address[0] == "::1"
            reader, writer = await asyncio.open_connection("::1", sink.address[1])
            writer.write(get("GET", "/metrics", close=True))
            answer = await asyncio.wait_for(reader.read(), 10.0)
            writer.close()
            assert [r.status for r in split_replies(answer, ["GET"])[0]] == [200]
        finally:
            await sink.stop()

    async def test_address_after_stop(self) -> None:
        """Stopped, the sink names the address it was told (its sockets are gone)."""
        port = free_port()
        sink = sink_on(f"127.0.0.1:{port}")
        await sink.start()
        assert sink.address == ("127.0.0.1", port)
        await sink.stop()
        assert sink.address == ("127.0.0.1", port)

    @pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_INET6])
    async def test_port_in_use(self, family: socket.AddressFamily) -> None:
        if family == socket.AF_INET6 and not ipv6_loopback():
            pytest.skip("no IPv6 loopback here")
        host = "127.0.0.1" if family == socket.AF_INET else "::1"
        with socket.socket(family) as taken:
            taken.bind((host, 0))
            taken.listen()
            port = taken.getsockname()[1]
            listen = f"{host}:{port}" if family == socket.AF_INET else f"[{host}]:{port}"
            sink = sink_on(listen)
            with pytest.raises(OSError, match="another process using the port") as raised:
                await sink.start()
            assert raised.value.errno == errno.EADDRINUSE
            assert listen in str(raised.value)
            await sink.stop()


# -- negotiation ------------------------------------------------------------------------------

GZIP = {
    "gzip": True,
    "GZip": True,  # content codings are case-insensitive (RFC 9110 8.4.1)
    "gzip, deflate, br": True,
    "br;q=1.0, gzip;q=0.5": True,
    "*": True,
    "": False,
    "identity": False,
    "gzip;q=0": False,  # q=0: not acceptable (RFC 9110 12.5.3)
    "br, gzip; q=0": False,
    "gzip;q=0.000": False,
    "*;q=0": False,
    "*, gzip;q=0": False,
    "deflate, br": False,
}
ACCEPT = [
    # Prometheus 2.42's, and the protobuf and OpenMetrics-only asks: the text format answers.
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited",
    "application/openmetrics-text;version=1.0.0",
    "text/html",
]


class TestNegotiation:
    """gzip exactly when the client takes it; the text format whatever it asks for."""

    async def test_gzip_when_acceptable(self, tmp_path: Path) -> None:
        """(The agent's endpoint only: the watcher's does not compress.)"""
        async with agent_endpoint(tmp_path) as port:
            for codings, wanted in GZIP.items():
                header = f"Accept-Encoding: {codings}\r\n" if codings else ""
                request = f"GET /metrics HTTP/1.1\r\n{header}Connection: close\r\n\r\n"
                answer = await exchange(port, [request.encode()])
                (reply,), _ = split_replies(answer, ["GET"])
                assert reply.status == 200
                gzipped = reply.headers.get("content-encoding") == "gzip"
                assert gzipped is wanted, (codings, reply.headers)
                body = gzip.decompress(reply.body) if gzipped else reply.body
                assert body.startswith(b"# HELP ")

    @pytest.mark.parametrize("accept", ACCEPT)
    async def test_text_format_whatever_is_asked(self, endpoint: Endpoint, accept: str) -> None:
        request = f"GET /metrics HTTP/1.1\r\nAccept: {accept}\r\nConnection: close\r\n\r\n"
        answer = await exchange(endpoint.port, [request.encode()])
        (reply,), _ = split_replies(answer, ["GET"])
        assert reply.status == 200
        assert reply.headers["content-type"] == CONTENT_TYPE


# -- malformed heads -------------------------------------------------------------------------

CONTROLS = [*range(0x00, 0x20), 0x7F]
"""The control characters: none may be in a field name, and none but HTAB in a value (RFC
9110 section 5.5); a CR alone, not ending a line, is a bare CR (RFC 9112 section 2.2)."""


def malformed_heads() -> dict[str, bytes]:
    """Request heads a server must answer 400 (or, for a bare CR and obs-fold, mend, which
    this one does not): each control byte in a field name and in a value, a bare CR in the
    request line and in a field, a folded field (obs-fold), a field line without a colon."""
    heads: dict[str, bytes] = {}
    for byte in CONTROLS:
        b = bytes([byte])
        heads[f"name-0x{byte:02x}"] = b"GET /metrics HTTP/1.1\r\nX-" + b + b"Test: v\r\n\r\n"
        if byte != 0x09:  # HTAB is lawful in a value
            heads[f"value-0x{byte:02x}"] = b"GET /metrics HTTP/1.1\r\nX-Test: a" + b + b"b\r\n\r\n"
    heads |= {
        "cr-in-method": b"G\rET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
        "cr-in-target": b"GET /met\rrics HTTP/1.1\r\nHost: x\r\n\r\n",
        "cr-after-target": b"GET /metrics\r HTTP/1.1\r\nHost: x\r\n\r\n",
        "cr-ending-request-line": b"GET /metrics HTTP/1.1\r\r\nHost: x\r\n\r\n",
        "cr-as-line-end": b"GET /metrics HTTP/1.1\rHost: x\r\n\r\n",
        "cr-in-value": b"GET /metrics HTTP/1.1\r\nHost: x\rX-Evil: 1\r\n\r\n",
        "cr-ending-value": b"GET /metrics HTTP/1.1\r\nHost: x\r\r\n\r\n",
        "cr-in-name": b"GET /metrics HTTP/1.1\r\nHo\rst: x\r\n\r\n",
        "cr-alone-on-a-line": b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\r\n\r\n",
        "obs-fold-sp": b"GET /metrics HTTP/1.1\r\nX-Test: a\r\n b\r\n\r\n",
        "obs-fold-htab": b"GET /metrics HTTP/1.1\r\nX-Test: a\r\n\tb\r\n\r\n",
        "space-before-first-field": b"GET /metrics HTTP/1.1\r\n Host: x\r\n\r\n",
        "space-before-colon": b"GET /metrics HTTP/1.1\r\nHost : x\r\n\r\n",
        "no-colon": b"GET /metrics HTTP/1.1\r\nHost x\r\n\r\n",
        "empty-name": b"GET /metrics HTTP/1.1\r\n: x\r\n\r\n",
        "nul-in-target": b"GET /metr\x00ics HTTP/1.1\r\n\r\n",
        "del-in-target": b"GET /metrics\x7f HTTP/1.1\r\n\r\n",
        "tab-in-request-line": b"GET\t/metrics HTTP/1.1\r\n\r\n",
        "two-spaces": b"GET  /metrics HTTP/1.1\r\n\r\n",
        "bad-version": b"GET /metrics HTTP/1.1x\r\n\r\n",
    }
    return heads


MALFORMED = malformed_heads()
WELL_FORMED = [
    b"GET /metrics HTTP/1.1\r\nX-Test: a\tb\r\n\r\n",  # HTAB inside a value
    b"GET /metrics HTTP/1.1\r\nX-Test:\ta b \t\r\n\r\n",  # OWS around a value
    b"GET /metrics HTTP/1.1\r\nX-Test: caf\xc3\xa9 \xff\r\n\r\n",  # obs-text
    b"GET /metrics HTTP/1.1\r\nX-Empty:\r\n\r\n",
    b"GET /metrics HTTP/1.1\r\nX!#$%&'*+-.^_`|~09az: v\r\n\r\n",  # every kind of tchar
    b"GET /metrics HTTP/1.0\r\n\r\n",
]


class TestMalformedHeads:
    """A head with a control character in a field, a bare CR, a folded line or a field line
    that is not `name: value` is answered 400 and its connection closed (nothing after it on
    that connection is read as a request: a proxy in front may have split the head
    elsewhere, which is how requests are smuggled); the next connection is served. Taken,
    the bytes reached the responder (0x00 in a value, `Host: x\\rX-Evil: 1` read as one
    field) and the connection was kept."""

    async def test_each_is_400_and_closed(self, endpoint: Endpoint) -> None:
        wrong = {}
        for shape, head in MALFORMED.items():
            # A good request after it on the same connection: answered, it would show the
            # connection kept (and the rest of the bad head's bytes read as requests).
            data = await asyncio.wait_for(
                exchange(endpoint.port, [head, get("GET", "/metrics", True)]), 5.0
            )
            replies, rest = split_replies(data, ["GET", "GET"])
            statuses = [r.status for r in replies]
            if statuses != [400] or rest or replies[0].headers.get("connection") != "close":
                wrong[shape] = data[:120]
        assert not wrong, wrong
        # The endpoint still serves a well-formed request.
        answer = await exchange(endpoint.port, [get("GET", "/metrics", True)])
        assert [r.status for r in split_replies(answer, ["GET"])[0]] == [200]

    async def test_lawful_heads_are_served(self, endpoint: Endpoint) -> None:
        for head in WELL_FORMED:
            answer = await exchange(endpoint.port, [head, get("GET", "/metrics", True)])
            replies, rest = split_replies(answer, ["GET", "GET"])
            want = [200] if b"HTTP/1.0" in head else [200, 200]
            assert [r.status for r in replies] == want, (head, answer[:200])
            assert rest == b""


def rejected_counts(metrics: bytes) -> dict[str, float]:
    prefix = 'gpuwarden_http_requests_rejected_total{reason="'
    counts = {}
    for line in metrics.decode().splitlines():
        if line.startswith(prefix):
            reason, _, value = line[len(prefix) :].partition('"} ')
            counts[reason] = float(value)
    return counts


REJECTED = [
    ("bad_request_line", MALFORMED["two-spaces"]),
    ("bad_request_line", MALFORMED["cr-as-line-end"]),
    ("obs_fold", MALFORMED["obs-fold-htab"]),
    ("obs_fold", MALFORMED["space-before-first-field"]),
    ("bad_header_line", MALFORMED["no-colon"]),
    ("bad_header_line", MALFORMED["value-0x00"]),
]


class TestRejectedCounted:
    """The agent's /metrics counts the heads it answered 400, by what was wrong: every reason
    from 0 (a rate() over a series that appears late misses its first increase)."""

    @pytest.mark.parametrize(("reason", "head"), REJECTED, ids=[r for r, _ in REJECTED])
    async def test_each_reason_counts_its_own(
        self, tmp_path: Path, reason: str, head: bytes
    ) -> None:
        async with agent_endpoint(tmp_path) as port:
            before = split_replies(await exchange(port, [get("GET", "/metrics", True)]), ["GET"])
            assert rejected_counts(before[0][0].body) == dict.fromkeys(
                ("bad_request_line", "obs_fold", "bad_header_line"), 0.0
            )
            for _ in range(3):
                (reply,), _ = split_replies(await exchange(port, [head]), ["GET"])
                assert reply.status == 400
            after = split_replies(await exchange(port, [get("GET", "/metrics", True)]), ["GET"])
            counts = rejected_counts(after[0][0].body)
            assert counts.pop(reason) == 3.0
            assert set(counts.values()) == {0.0}, counts

    async def test_every_malformed_head_is_counted_once(self, tmp_path: Path) -> None:
        async with agent_endpoint(tmp_path) as port:
            for head in MALFORMED.values():
                await exchange(port, [head])
            answer = split_replies(await exchange(port, [get("GET", "/metrics", True)]), ["GET"])
            assert sum(rejected_counts(answer[0][0].body).values()) == len(MALFORMED)
