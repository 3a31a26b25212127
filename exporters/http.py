"""The small HTTP/1.1 server under the agent's /metrics and the watcher's /metrics: one request
per connection, every step bounded in time, a cap on open connections.

Both endpoints answer a handful of scrapes a minute; a general web framework would add more
than it serves. What matters is that no client can hold the process: a request head must arrive,
and a response be read, within REQUEST_TIMEOUT, and at most MAX_CONNECTIONS are open at once.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable

from agent.contracts.errors import ConfigError

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MAX_REQUEST_BYTES = 8192
REQUEST_TIMEOUT = 5.0
MAX_CONNECTIONS = 32

Answer = tuple[int, dict[str, str], bytes]
Responder = Callable[[bytes], Awaitable[Answer]]

_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


def response(status: int, headers: dict[str, str], body: bytes) -> bytes:
    """A whole response; `Content-Length` may be given (HEAD: the length GET would send)."""
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}"]
    merged = {
        "Content-Type": "text/plain; charset=utf-8",
        "Content-Length": str(len(body)),
        **headers,
        "Connection": "close",
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
    return method, target.split("?", 1)[0]


class OneShotServer:
    """Serves connections with `respond(request head) -> (status, headers, body)`."""

    def __init__(self, respond: Responder, max_connections: int = MAX_CONNECTIONS) -> None:
        self._respond = respond
        self._slots = asyncio.Semaphore(max_connections)
        self.open_connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._slots.locked():
            # Without a cap, clients that connect and never finish could pin tasks and file
            # descriptors without bound. Small enough to fit the socket buffer: no drain.
            writer.write(response(503, {}, b"too many connections\n"))
            writer.close()
            return
        async with self._slots:
            self.open_connections += 1
            try:
                await self._serve(reader, writer)
            finally:
                self.open_connections -= 1

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT)
        except (
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            TimeoutError,
            ConnectionError,
            ssl.SSLError,
        ):
            writer.close()
            return
        try:
            writer.write(response(*await self._respond(head)))
            # A client that never reads would otherwise hold this task and its socket forever.
            await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT)
        except TimeoutError:
            # close() would wait to flush the unread response first, i.e. forever: abort.
            writer.transport.abort()
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()


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
