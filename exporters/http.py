"""The small HTTP/1.1 server under the agent's /metrics and the watcher's /metrics, built so
that the scraper is served first, whatever else connects.

Both endpoints answer a handful of scrapes a minute; a general web framework would add more
than it serves. What matters is that no client can hold the port (docs/alerts.md advises
0.0.0.0:9445 for a remote Prometheus, so anything on the network may connect):

- A request head's lines end in CRLF or a bare LF (read_head): a client sending LF is
  answered at once, not left to wait out the header deadline.
- A head with a bare CR, a control byte in a field, a folded line (obs-fold) or a field line
  that is not `name: value` is answered 400 and its connection closed (malformed): RFC 9112
  sections 2.2 and 5.2 let a server refuse these, and a proxy in front may frame them
  otherwise than we do.
- A connection has HEADER_TIMEOUT (TLS handshake included) to send a whole request head, and
  SEND_TIMEOUT to take its response; between keep-alive requests it may wait IDLE_TIMEOUT.
- A connection waiting for a request head (new, or idle between requests) costs the server
  nothing but a socket, so it is the one given up when room is needed: a new connection over
  the budget evicts a waiting one: one draining (answered, its unread rest still coming)
  first; else one of a client never served (no answer below 400 yet; the last
  SERVED_CLIENTS served are remembered), while there is one; of those, one of the client
  holding the most connections, then one never answered, then the oldest. A slowloris or a
  crowd of idle sockets, from one address or from more than the budget, then only ever
  evicts itself: a scraper has been served since its first scrape, so neither its new
  connection (before its request is read, a burst of connects could make it the oldest
  waiting) nor its kept one, idle between scrapes, goes while a stranger's waits. Being
  served trusts TRUSTED_PER_CLIENT waiting connections of a client, no more (a flooder that
  scraped once gets no free pass). A client whose connections were given up waiting before
  goes before one whose were not, and a connection whose request head has come, unread, is
  never given up: so a new scraper's first scrape gets through a crowd too.
- At most PER_CLIENT connections per client (an IPv4 address, an IPv6 /64): the next one
  evicts that client's own oldest waiting connection, or is refused (503) while all of them
  are being answered.
- Keep-alive for HTTP/1.1 clients (Prometheus reuses its connection), at most MAX_REQUESTS a
  connection; a request with a body, HTTP/1.0 or `Connection: close` ends it. A head over
  MAX_REQUEST_BYTES is answered 431; a request that leaves bytes unread (that, or a body)
  ends with its answer, then up to LINGER_TIMEOUT of reading and dropping what still comes.
- The listen backlog is large: under a flood of connects a short one drops the scraper's SYN,
  and the kernel's retry comes a second later.
- Out of files (EMFILE on accept: a low limit, or files held elsewhere in the process), the
  server gives up a waiting connection to make room, or its listener waits, and says so at
  most once a minute (exporters/listener.py: asyncio's own went on trying, a logged
  traceback each).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import re
import socket
import ssl
import time
import urllib.parse
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from agent.contracts.errors import ConfigError
from agent.contracts.model import MetricFamily, MetricType, Sample
from exporters.listener import ACCEPT_FAILURES, BACKLOG, AcceptFailures, Listener

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MAX_REQUEST_BYTES = 8192
HEADER_TIMEOUT = 2.0
"""Seconds from accept to a whole request head (a scraper's takes milliseconds)."""
SEND_TIMEOUT = 5.0
"""Seconds a client has to take its response."""
IDLE_TIMEOUT = 75.0
"""Seconds a kept-alive connection may wait for its next request: more than a scrape
interval of 1 min, so that Prometheus reuses its connection."""
LINGER_TIMEOUT = 2.0
"""Seconds a connection that ends with part of its request unread (a body, a head too
large) is read and dropped, so that its client gets to read the answer."""
LINGER_CHUNK = 65536
TOO_LARGE = b"request head too large: at most %d bytes\n" % MAX_REQUEST_BYTES
MAX_CONNECTIONS = 64
PER_CLIENT = 8
SERVED_CLIENTS = 1024
"""Clients remembered as answered (below 400), whose connections are given up last."""
STRUCK_CLIENTS = 1024
"""Clients remembered with the count of their connections given up waiting (evicted, or out
of header time): the most struck go first."""
TRUSTED_PER_CLIENT = 2
"""Waiting connections of one answered client that are given up last: more (a client that
scraped once, then opened hundreds) are given up as a stranger's. Prometheus keeps one a
target; two jobs on one endpoint, two."""
MAX_REQUESTS = 1000
"""Requests on one kept-alive connection; then the response says Connection: close."""
DROP_REASONS = (
    "header_timeout",  # no whole request head (or TLS handshake) within HEADER_TIMEOUT
    "idle_timeout",  # no next request on a kept-alive connection within IDLE_TIMEOUT
    "evicted",  # a waiting connection given up for a new one
    "refused",  # over the budget with nothing to evict (503)
    "send_timeout",  # the response not taken within SEND_TIMEOUT
    "bad_tls",  # the TLS handshake failed
)

Answer = tuple[int, dict[str, str], bytes]
Responder = Callable[[bytes, str], Awaitable[Answer]]
"""(request head, client address) -> the answer. To a HEAD request the server sends the
answer's headers and no body, with the body's length as Content-Length unless it is given."""

_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}
_CLOSED = (
    asyncio.IncompleteReadError,
    asyncio.LimitOverrunError,
    ConnectionError,
    ssl.SSLError,
    OSError,
)


def response(status: int, headers: dict[str, str], body: bytes, keep_alive: bool = False) -> bytes:
    """A whole response; `Content-Length` may be given (HEAD: the length GET would send)."""
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}"]
    merged = {
        "Content-Type": "text/plain; charset=utf-8",
        "Content-Length": str(len(body)),
        **headers,
        "Connection": "keep-alive" if keep_alive else "close",
    }
    lines += [f"{k}: {v}" for k, v in merged.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def request_line(head: bytes) -> tuple[str, str] | Answer:
    """(method, path without query) of a GET or HEAD, or the error answer to send."""
    if len(head) > MAX_REQUEST_BYTES:
        return 431, {}, b"request header too large\n"
    parts = head.decode("latin-1").split("\r\n", 1)[0].split(" ")
    if len(parts) != 3:
        return 400, {}, b"bad request\n"
    method, target, _ = parts
    if method not in ("GET", "HEAD"):
        return 405, {"Allow": "GET, HEAD"}, b"method not allowed\n"
    return method, target_path(target)


_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_REQUEST_LINE = re.compile(_TOKEN + rb" [\x21-\x7e\x80-\xff]+ HTTP/[0-9]\.[0-9]")
"""method SP request-target SP HTTP-version (RFC 9112 section 3): no control byte, one space."""
_FIELD_LINE = re.compile(_TOKEN + rb":[\t\x20-\x7e\x80-\xff]*")
"""field-name ":" field-value (RFC 9112 section 5, RFC 9110 section 5.5): a token, the colon
right after it, a value of visible bytes, obs-text, SP and HTAB: no control byte, no CR."""


REJECT_REASONS = {
    "bad_request_line": "bad request line",  # not method SP target SP version, or a control byte
    "obs_fold": "folded header line (obs-fold)",  # a field line starting with SP or HTAB
    "bad_header_line": "bad header line",  # not name ":" value, or a control byte in it
}
"""Why a request head was answered 400 (malformed()): the reason, as counted, and as the
answer says it."""


def malformed(head: bytes) -> str | None:
    """Why a request head (as read_head returns it) is not one (a key of REJECT_REASONS), or
    None. A bare CR, a control byte in a field, a folded line (obs-fold) or a field line
    without its colon are refused, not mended: a proxy in front may read such a head
    otherwise than we would (request smuggling), and no scraper sends one."""
    first, *fields = head[:-4].split(b"\r\n")
    if _REQUEST_LINE.fullmatch(first) is None:
        return "bad_request_line"
    for line in fields:
        if line[:1] in (b" ", b"\t"):
            return "obs_fold"
        if _FIELD_LINE.fullmatch(line) is None:
            return "bad_header_line"
    return None


def target_path(target: str) -> str:
    """The path a request target names, without its query: from the origin form
    (`/metrics?x`) or the absolute form (`http://node:9445/metrics`, which a server must
    take: RFC 9112 section 3.2.2), percent-decoded (`/%6detrics` is `/metrics`)."""
    path = target.split("?", 1)[0]
    scheme, sep, rest = path.partition("://")
    if sep and scheme.lower() in ("http", "https"):
        path = "/" + rest.partition("/")[2]
    return urllib.parse.unquote(path)


def header_values(head: bytes, name: str) -> list[str]:
    """The values of every header `name` (case-insensitive) in a request head."""
    wanted = name.lower()
    values = []
    for line in head.decode("latin-1").split("\r\n")[1:]:
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() == wanted:
            values.append(value.strip())
    return values


def accepts_gzip(head: bytes) -> bool:
    """Whether the request's Accept-Encoding headers take gzip: listed (or `*`) with a
    q-value above 0 and not refused by name (RFC 9110 section 12.5.3; names are
    case-insensitive)."""
    weights: dict[str, float] = {}
    for value in header_values(head, "accept-encoding"):
        for item in value.split(","):
            name, _, params = item.partition(";")
            weight = 1.0
            for param in params.split(";"):
                key, sep, number = param.partition("=")
                if sep and key.strip().lower() == "q":
                    try:
                        weight = float(number.strip())
                    except ValueError:
                        weight = 0.0  # not a q-value: not an acceptance
            if name.strip():
                weights[name.strip().lower()] = weight
    for name in ("gzip", "x-gzip"):
        if name in weights:
            return weights[name] > 0
    return weights.get("*", 0.0) > 0


def may_keep_alive(head: bytes) -> bool:
    """Whether the connection may carry another request after this one: an HTTP/1.1 GET or
    HEAD without a body (one we do not read would be taken for the next request) and without
    `Connection: close`."""
    if len(request_line(head)) == 3:  # an error answer
        return False
    if not head.split(b"\r\n", 1)[0].endswith(b" HTTP/1.1"):
        return False
    if has_body(head):
        return False
    return not any("close" in v.lower() for v in header_values(head, "connection"))


def has_body(head: bytes) -> bool:
    """Whether the request says a body follows its head (which the server never reads)."""
    return bool(header_values(head, "transfer-encoding")) or any(
        v != "0" for v in header_values(head, "content-length")
    )


async def read_head(reader: asyncio.StreamReader) -> bytes:
    """The next request head, its lines ended by CRLF or a bare LF (RFC 9112 section 2.2: a
    recipient may take a bare LF for a line's end; a hand-made client, `printf ... | nc`,
    sends those), empty lines before the request line skipped (section 2.2 too). Returned
    with CRLF endings, as every parser here expects. LimitOverrunError when it would be over
    MAX_REQUEST_BYTES; IncompleteReadError when the client closes first."""
    lines: list[bytes] = []
    size = 2  # the empty line that ends the head
    while True:
        line = await reader.readuntil(b"\n")  # LimitOverrunError past the reader's limit
        if isinstance(reader, HeadReader):
            reader.taken += len(line)
        text = line[:-2] if line.endswith(b"\r\n") else line[:-1]
        size += len(text) + 2
        if size > MAX_REQUEST_BYTES:
            raise asyncio.LimitOverrunError("request head too large", 0)
        if text:
            lines.append(text)
        elif lines:
            return b"\r\n".join(lines) + b"\r\n\r\n"


class HeadReader(asyncio.StreamReader):
    """A StreamReader told by its protocol of the bytes that come (`arrived`: what the
    transport read, or TLS decrypted), which notes where the last empty line in them ends,
    while read_head counts what it takes: `head_here` says a whole request head has come and
    is not read yet, with no look at the reader's buffer and no system call. An empty line
    (LF LF, LF CR LF) cut between two reads is found too."""

    def __init__(self) -> None:
        super().__init__(limit=MAX_REQUEST_BYTES + 2)
        self.received = 0
        """Bytes that came so far."""
        self.head_end = 0
        """Offset in them just past the last empty line (0: none yet)."""
        self.taken = 0
        """Bytes read_head has taken."""
        self._tail = b""  # the last two bytes that came: an empty line may start there

    @property
    def head_here(self) -> bool:
        return self.head_end > self.taken

    def arrived(self, data: bytes) -> None:
        """Bytes about to be fed (feed_data)."""
        end = _after_empty_line(data)
        if end >= 0:
            self.head_end = self.received + end
        elif self._tail:
            end = _after_empty_line(self._tail + data[:2])
            if end >= 0:
                self.head_end = self.received - len(self._tail) + end
        self.received += len(data)
        self._tail = (self._tail + data[-2:])[-2:]


class _HeadProtocol(asyncio.StreamReaderProtocol):
    """Tells its HeadReader what comes, then hands it on as StreamReaderProtocol does."""

    def __init__(self, reader: HeadReader, handle: Callable[..., Awaitable[None]]) -> None:
        super().__init__(reader, handle)
        self._head_reader = reader

    def data_received(self, data: bytes) -> None:
        self._head_reader.arrived(data)
        super().data_received(data)


def _after_empty_line(data: bytes) -> int:
    """The offset just past the last empty line (LF LF, LF CR LF) in `data`; -1 if none."""
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\n\r\n")
    return max(lf + 2 if lf >= 0 else -1, crlf + 3 if crlf >= 0 else -1)


@dataclass(eq=False)
class _Connection:
    client: str
    writer: asyncio.StreamWriter
    reader: HeadReader
    waiting_since: float | None = field(default_factory=time.monotonic)
    """When it began waiting for a request head; None while a request is being answered."""
    answered: int = 0
    """Requests answered on it: a kept connection that has been answered is a scraper's."""
    draining: bool = False
    """Answered and ending, what is left of its request read and dropped (_linger)."""


class ScrapeServer:
    """Serves connections with `respond(request head, client) -> (status, headers, body)`.

    `dropped` counts connections closed early, by reason (DROP_REASONS); `rejected` request
    heads answered 400, by reason (REJECT_REASONS); `accept_failed` accepts that failed, by
    reason (ACCEPT_FAILURES).
    """

    def __init__(
        self,
        respond: Responder,
        *,
        max_connections: int = MAX_CONNECTIONS,
        per_client: int = PER_CLIENT,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._respond = respond
        self.max_connections = max_connections
        self.per_client = per_client
        self.tls = tls
        self.header_timeout = HEADER_TIMEOUT
        self.send_timeout = SEND_TIMEOUT
        self.idle_timeout = IDLE_TIMEOUT
        self.max_requests = MAX_REQUESTS
        self.linger_timeout = LINGER_TIMEOUT
        self._open: dict[_Connection, None] = {}  # in order of arrival
        self._held: Counter[str] = Counter()  # open connections by client (_open's, kept)
        self._served: dict[str, None] = {}  # clients answered below 400, the latest last
        self._struck: dict[str, int] = {}  # connections given up waiting, by client
        self.dropped: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        """Malformed request heads answered 400, by what was wrong (REJECT_REASONS)."""
        self.accept_failures = AcceptFailures(
            "http",
            "cannot accept connections; giving up waiting ones to make room",
            "out of files: raise LimitNOFILE= in the unit, or find what holds them",
        )

    @property
    def accept_failed(self) -> Counter[str]:
        """Accepts that failed, by reason (ACCEPT_FAILURES)."""
        return self.accept_failures.counts

    @property
    def open_connections(self) -> int:
        return len(self._open)

    async def listen(self, host: str, port: int) -> Listener:
        """Listen on host:port (every address the name has, as asyncio's create_server does)
        and serve its connections. TLS, when set, is negotiated inside `handle`, under the
        header deadline and the budget: a server-side `ssl=` would hold handshaking sockets
        outside both."""
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        sockets: list[socket.socket] = []
        try:
            for family, kind, proto, _, address in dict.fromkeys(infos):
                sock = socket.socket(family, kind, proto)
                sockets.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:  # "::" is IPv6 only, as with create_server
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
                sock.listen(BACKLOG)
                sock.setblocking(False)
        except OSError:
            for sock in sockets:
                sock.close()
            raise
        if not sockets:
            raise OSError(errno.EADDRNOTAVAIL, f"no address for {host!r}")
        return Listener(sockets, self._protocol, self._cannot_accept, self.accept_failures.aborted)

    def _protocol(self) -> asyncio.StreamReaderProtocol:
        reader = HeadReader()
        if self.tls is None:
            return _HeadProtocol(reader, self.handle)
        return _PausedUntilTls(reader, self.handle)

    def _cannot_accept(self, exc: OSError) -> bool:
        """An accept failed (out of files, or otherwise): count it, say so at most once a
        minute, and give up a waiting connection to make room. Whether one was given up."""
        self.accept_failures.note(exc)
        victim = self._victim()
        if victim is not None:
            self._evict(victim)
        return victim is not None

    def close(self) -> None:
        """Abort every open connection: their tasks then end by themselves (a task cancelled
        at the loop's end instead makes asyncio log an error for each)."""
        for connection in list(self._open):
            connection.writer.transport.abort()
        self._open.clear()
        self._held.clear()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not isinstance(reader, HeadReader):
            raise TypeError("ScrapeServer.handle takes the readers of its own protocol")
        # One turn of the loop before the budget is applied: a burst of accepts starts every
        # connection's task before any socket is read, and the transports read what their
        # sockets hold on this turn, so that a request that came with the burst is here
        # (HeadReader.head_here) when the burst's evictions are chosen.
        await asyncio.sleep(0)
        connection = self._admit(reader, writer)
        if connection is None:
            self.dropped["refused"] += 1
            if self.tls is not None:  # a plain-text 503 would be noise to a TLS client
                writer.transport.abort()
                return
            # Small enough to fit the socket buffer: no drain, nothing to wait for.
            writer.write(response(503, {}, b"too many connections\n"))
            writer.close()
            return
        try:
            if await self._arrive(connection):
                await self._serve(connection, reader)
        finally:
            self._forget(connection)
            if not connection.writer.transport.is_closing():
                connection.writer.close()

    # -- the budget ------------------------------------------------------------------------

    def _admit(self, reader: HeadReader, writer: asyncio.StreamWriter) -> _Connection | None:
        client = _client_of(writer)
        at_cap = self._held[client] >= self.per_client
        if at_cap:
            victim = _oldest_waiting([c for c in self._open if c.client == client])
        elif len(self._open) >= self.max_connections:
            victim = self._victim()
        else:
            victim = None
        if victim is not None:
            self._evict(victim)
        elif at_cap or len(self._open) >= self.max_connections:
            return None
        connection = _Connection(client, writer, reader)
        self._open[connection] = None
        self._held[client] += 1
        return connection

    def _forget(self, connection: _Connection) -> None:
        if self._open.pop(connection, False) is None:  # it was open
            self._held[connection.client] -= 1
            if not self._held[connection.client]:
                del self._held[connection.client]

    def _victim(self) -> _Connection | None:
        """A waiting connection whose request has not come: one draining (nothing more to
        answer on it, whatever it sends) first, else one that is not trusted (_trusted: a
        client never served, or one holding more than TRUSTED_PER_CLIENT); of those, one of
        the client that holds the most connections, then of the client most often given up
        before (_strike), then one never answered, then the oldest waiting
        (_oldest_waiting); the trusted last. None when every waiting one has its request
        here (HeadReader.head_here). One pass over the table, no sort, no system call.

        Without the first rule, a crowd from more addresses than the budget, one connection
        each, evicted the scraper's new connection: the newest waiting at its connect, it was
        the oldest 64 connects later, before its request was read. A new scraper (never
        answered, so not trusted) was evicted the same way, its request unread: now a
        connection whose request is here is not waiting for its client, and is kept. Its
        request not here yet (its client slower to send than 64 connects of a crowd that
        reconnects at once), it is still given up after those of the crowd's hosts, each of
        which has had connections given up."""
        held, struck = self._held, self._struck
        waiting = [c for c in self._open if c.waiting_since is not None]
        draining = [c for c in waiting if c.draining]
        if draining:
            return min(
                draining,
                key=lambda c: (-held[c.client], -struck.get(c.client, 0), c.waiting_since),
            )
        free = [c for c in waiting if c.reader.head_end <= c.reader.taken]  # not head_here
        trusted = self._trusted(waiting)
        pool = [c for c in free if c not in trusted] if trusted else free
        # The order of _order, inlined (this runs at every accept over the budget): of the
        # non-draining, one never answered first, then the one waiting longest.
        return min(
            pool or free,
            key=lambda c: (
                -held[c.client],
                -struck.get(c.client, 0),
                c.answered > 0,
                c.waiting_since,
            ),
            default=None,
        )

    def _trusted(self, waiting: list[_Connection]) -> set[_Connection]:
        """The waiting connections given up last: of each client served, TRUSTED_PER_CLIENT
        at most, those answered before first, then the newest (one pass: a client's best
        few kept as it goes)."""
        best: dict[str, list[tuple[tuple[bool, int], _Connection]]] = {}
        if not self._served:
            return set()
        for number, connection in enumerate(waiting):
            if connection.client not in self._served:
                continue
            kept = best.setdefault(connection.client, [])
            kept.append(((connection.answered > 0, number), connection))
            if len(kept) > TRUSTED_PER_CLIENT:
                kept.remove(min(kept, key=lambda p: p[0]))
        return {c for kept in best.values() for _, c in kept}

    def _remember(self, client: str) -> None:
        """A client given a good answer (below 400: not a refused password): the last
        SERVED_CLIENTS of them, the most recent last."""
        self._served.pop(client, None)
        self._served[client] = None
        if len(self._served) > SERVED_CLIENTS:
            del self._served[next(iter(self._served))]

    def _strikes(self, connection: _Connection) -> int:
        return self._struck.get(connection.client, 0)

    def _strike(self, client: str) -> None:
        """A connection of `client` given up waiting: counted, the last STRUCK_CLIENTS
        clients remembered (the most recently struck last)."""
        self._struck[client] = self._struck.pop(client, 0) + 1
        if len(self._struck) > STRUCK_CLIENTS:
            del self._struck[next(iter(self._struck))]

    def _evict(self, victim: _Connection) -> None:
        self.dropped["evicted"] += 1
        if not victim.draining:
            self._strike(victim.client)
        self._forget(victim)
        victim.writer.transport.abort()  # its read then ends, and so does its task

    # -- one connection ----------------------------------------------------------------------

    async def _arrive(self, connection: _Connection) -> bool:
        """The TLS handshake, if any; False when it failed or ran out of time."""
        if self.tls is None:
            return True
        try:
            await asyncio.wait_for(connection.writer.start_tls(self.tls), self.header_timeout)
        except TimeoutError:
            self.dropped["header_timeout"] += 1
            connection.writer.transport.abort()
            return False
        except _CLOSED:
            self.dropped["bad_tls"] += 1
            connection.writer.transport.abort()
            return False
        return True

    async def _serve(self, connection: _Connection, reader: asyncio.StreamReader) -> None:
        writer = connection.writer
        deadline, reason = self.header_timeout, "header_timeout"
        for served in range(1, self.max_requests + 1):
            connection.waiting_since = time.monotonic()
            try:
                head = await asyncio.wait_for(read_head(reader), deadline)
            except TimeoutError:
                self._timed_out(connection, reason)
                return
            except asyncio.LimitOverrunError:
                # A head over MAX_REQUEST_BYTES: say so, and take the rest the client sends.
                if await self._send(writer, response(431, {}, TOO_LARGE)):
                    await self._linger(connection, reader)
                return
            except _CLOSED:
                return
            if connection not in self._open:  # evicted while its head came in
                return
            connection.waiting_since = None
            if not await self._well_formed(connection, reader, head):
                return
            keep = served < self.max_requests and may_keep_alive(head)
            status, headers, body = await self._respond(head, connection.client)
            if head.startswith(b"HEAD "):
                # Whatever the path or status: a body after a HEAD answer would be read, by a
                # client keeping the connection, as the start of the next answer.
                headers = {"Content-Length": str(len(body)), **headers}
                body = b""
            if not await self._send(writer, response(status, headers, body, keep)):
                return
            connection.answered += 1
            if status < 400:
                self._remember(connection.client)
            if not keep:
                if has_body(head):  # unread, and perhaps still coming
                    await self._linger(connection, reader)
                return
            # The next request comes a scrape interval later; meanwhile the connection is
            # waiting, so evictable: an idle keep-alive holds no room anyone needs.
            deadline, reason = self.idle_timeout, "idle_timeout"

    async def _well_formed(
        self, connection: _Connection, reader: asyncio.StreamReader, head: bytes
    ) -> bool:
        """Whether the head is a request; if not, it is answered 400 and the connection ends:
        what follows on it is not read as a request (its framing is unknown), but taken and
        dropped."""
        problem = malformed(head)
        if problem is None:
            return True
        self.rejected[problem] += 1
        body = f"bad request: {REJECT_REASONS[problem]}\n".encode()
        if await self._send(connection.writer, response(400, {}, body)):
            await self._linger(connection, reader)
        return False

    def _timed_out(self, connection: _Connection, reason: str) -> None:
        """No request head in time: dropped, and, new, the client struck (_strike)."""
        self.dropped[reason] += 1
        if reason == "header_timeout":
            self._strike(connection.client)
        connection.writer.transport.abort()

    async def _linger(self, connection: _Connection, reader: asyncio.StreamReader) -> None:
        """End a connection whose client may still be sending what was not read (a body, a
        head too large): closed with that unread, it would be reset, and a client still
        sending would never read its answer (RFC 9112 section 9.6). So: no more to send, then
        read and drop what comes, until the client closes or LINGER_TIMEOUT. Waiting for
        nothing, the connection may be evicted meanwhile."""
        connection.waiting_since = time.monotonic()
        connection.draining = True
        writer = connection.writer
        if writer.can_write_eof():  # TLS cannot half-close: its close_notify comes at close
            with contextlib.suppress(*_CLOSED):
                writer.write_eof()
        with contextlib.suppress(TimeoutError, *_CLOSED):
            async with asyncio.timeout(self.linger_timeout):
                while connection in self._open and await reader.read(LINGER_CHUNK):
                    pass

    async def _send(self, writer: asyncio.StreamWriter, data: bytes) -> bool:
        try:
            writer.write(data)
            # A client that never reads would otherwise hold this task and its socket forever.
            await asyncio.wait_for(writer.drain(), self.send_timeout)
        except TimeoutError:
            self.dropped["send_timeout"] += 1
            # close() would wait to flush the unread response first, i.e. forever: abort.
            writer.transport.abort()
            return False
        except _CLOSED:
            return False
        return True


class _PausedUntilTls(_HeadProtocol):
    """Reads nothing until `handle` starts TLS on the connection: a ClientHello read before
    that would land in the plain stream, and the handshake would never see it.

    Python 3.11.2 (Debian 12's, the package's interpreter) adds a new socket transport's
    reader one loop callback after `connection_made`, whether or not the protocol paused it
    there (3.11.7 does not): so the pause is made again on the next turn of the loop, which
    also cancels a read already queued for that turn."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if isinstance(transport, asyncio.ReadTransport):
            transport.pause_reading()
            asyncio.get_running_loop().call_soon(_pause_again, transport)
        super().connection_made(transport)


def _pause_again(transport: asyncio.ReadTransport) -> None:
    """Pause a transport whose reader may have been added despite an earlier pause: resume
    first, as pause_reading() does nothing to a transport it thinks paused."""
    if transport.is_closing():
        return
    transport.resume_reading()
    transport.pause_reading()


def _client_of(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    return client_key(str(peer[0]) if isinstance(peer, tuple) and peer else str(peer))


def client_key(address: str) -> str:
    """The client an address belongs to: an IPv4 address, or an IPv6 /64 (one host gets a
    whole /64, so per-address limits on IPv6 would limit nothing)."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address  # a Unix socket path, say
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def _order(c: _Connection) -> tuple[int, float]:
    """Draining first, then never answered, then the one waiting longest."""
    rank = 0 if c.draining else 1 if c.answered == 0 else 2
    return rank, c.waiting_since or 0.0


def _oldest_waiting(connections: list[_Connection]) -> _Connection | None:
    """The waiting connection to give up first: one draining (nothing more to answer on
    it), then one that never had an answer (a scraper's kept connection has had some, and
    its next request may be on its way: evicted, that one would be reset), then the one
    waiting longest."""
    waiting = [c for c in connections if c.waiting_since is not None]
    if not waiting:
        return None
    return min(waiting, key=_order)


def parse_listen(value: str, key: str = "prometheus.listen") -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port)."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not port_text.isdigit() or not host:
        raise ConfigError(key, f"expected host:port (like 127.0.0.1:9445), got {value!r}")
    port = int(port_text)
    if not 0 < port < 65536:
        raise ConfigError(key, f"port must be 1-65535, got {port}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, port


# -- what the endpoint turned away, on its own /metrics (the agent's and the watcher's) ------

CONNECTIONS_DROPPED = MetricFamily(
    "gpuwarden_http_connections_dropped_total",
    MetricType.COUNTER,
    "Connections to /metrics closed before an answer, by reason (exporters/http.py)",
    ("reason",),
)
ACCEPT_FAILED = MetricFamily(
    "gpuwarden_http_accept_failed_total",
    MetricType.COUNTER,
    "Connections to /metrics that could not be accepted: out_of_files (EMFILE and the like)",
    ("reason",),
)
REQUESTS_REJECTED = MetricFamily(
    "gpuwarden_http_requests_rejected_total",
    MetricType.COUNTER,
    "Request heads to /metrics answered 400 as malformed: bad_request_line, obs_fold, "
    "bad_header_line",
    ("reason",),
)


def endpoint_blocks(server: ScrapeServer) -> list[tuple[MetricFamily, list[Sample]]]:
    """The server's counts of what it turned away, every reason from 0 (a rate() over a series
    that appears late misses its first increase)."""
    return [
        (
            CONNECTIONS_DROPPED,
            [CONNECTIONS_DROPPED.sample(server.dropped[r], r) for r in DROP_REASONS],
        ),
        (
            REQUESTS_REJECTED,
            [REQUESTS_REJECTED.sample(server.rejected[r], r) for r in REJECT_REASONS],
        ),
        (
            ACCEPT_FAILED,
            [ACCEPT_FAILED.sample(server.accept_failed[r], r) for r in ACCEPT_FAILURES],
        ),
    ]
