"""The Prometheus endpoint: /metrics rendered from the last snapshot, /healthz that never lies.

A small asyncio HTTP/1.1 server (exporters/http.py: the scraper first, whatever else connects)
so that a scrape is served on the agent's own loop and never waits on hardware. Each scrape
renders the snapshot afresh (exporters/exposition.py), so series of a GPU or a mount that went
away do not linger, then this process's process_* series.
"""

from __future__ import annotations

import gzip
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from agent.contracts.errors import ConfigError
from agent.contracts.model import MetricFamily, MetricType, Sample
from agent.contracts.settings import check_files, setting
from agent.contracts.sink import SinkContext, SinkSpec
from exporters.exposition import ProcessMetrics, snapshot_text
from exporters.http import (
    ACCEPT_FAILED,
    CONNECTIONS_DROPPED,
    CONTENT_TYPE,
    REQUESTS_REJECTED,
    Answer,
    ScrapeServer,
    accepts_gzip,
    endpoint_blocks,
    header_values,
    parse_listen,
    request_line,
)
from exporters.listener import Listener
from exporters.web_auth import (
    REFUSAL_REASONS,
    AuthGate,
    UsersFileError,
    WebConfig,
    load_users,
    load_web_config,
    server_tls_context,
)

log = structlog.get_logger(component="prometheus")

AUTH_REFUSED = MetricFamily(
    "gpuwarden_http_auth_refused_total",
    MetricType.COUNTER,
    "Requests refused by basic auth: failed (401), backoff (429), busy (503)",
    ("reason",),
)


@dataclass(frozen=True)
class PrometheusSettings:
    enabled: bool = setting(True, help="serve /metrics and /healthz")
    # 9445: not among the ports that common exporters registered in the Prometheus wiki's
    # default port allocations at the time of writing.
    listen: str = setting("127.0.0.1:9445", help="host:port to listen on")
    tls_cert_file: Path | None = setting(
        None, help="serve HTTPS with this certificate (PEM)", file="certificate"
    )
    tls_key_file: Path | None = setting(
        None,
        help="the certificate's key (PEM, mode 600)",
        file="private_key",
        certificate="tls_cert_file",
    )
    basic_auth_users_file: Path | None = setting(
        None,
        help="require basic auth; lines of user:bcrypt-hash (mode 600)",
        file="secret",
        content=load_users,
    )
    web_config_file: Path | None = setting(
        None,
        help="node_exporter's web-config.yml: basic_auth_users, tls_server_config (mode 600)",
        file="secret",
        content=load_web_config,
    )

    def __post_init__(self) -> None:
        parse_listen(self.listen, "listen")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ConfigError("tls_cert_file", "set tls_cert_file and tls_key_file together")
        if self.web_config_file is not None and (
            self.tls_cert_file is not None or self.basic_auth_users_file is not None
        ):
            raise ConfigError(
                "web_config_file",
                "set web_config_file or tls_cert_file/tls_key_file/basic_auth_users_file, "
                "not both: one file says who may scrape and with which certificate",
            )

    def serves_tls(self) -> bool:
        """Whether the endpoint speaks HTTPS (reads the web config, if one is named)."""
        if self.web_config_file is None:
            return self.tls_cert_file is not None
        try:
            return load_web_config(self.web_config_file).cert_file is not None
        except UsersFileError:
            return False  # the loader refused it already; a probe then says what it finds

    def web(self) -> WebConfig:
        """Users and certificate, from the web config or from the three keys (reads files)."""
        if self.web_config_file is not None:
            return load_web_config(self.web_config_file)
        users = (
            None if self.basic_auth_users_file is None else load_users(self.basic_auth_users_file)
        )
        return WebConfig(users, self.tls_cert_file, self.tls_key_file)


class PrometheusSink:
    expected_interval: float | None = None

    def __init__(self, settings: PrometheusSettings, runtime: SinkContext) -> None:
        self.name = "prometheus"
        self.settings = settings
        self.runtime = runtime
        self.process = ProcessMetrics()
        self.scrapes = 0
        self._server: Listener | None = None
        self._gate: AuthGate | None = None
        self.http = ScrapeServer(self._answer)

    def families(self) -> Sequence[MetricFamily]:
        return (CONNECTIONS_DROPPED, REQUESTS_REJECTED, ACCEPT_FAILED, AUTH_REFUSED)

    def samples(self) -> Sequence[Sample]:
        # Every reason always, from 0: a rate() over a series that appears late misses its
        # first increase.
        out = [sample for _, samples in endpoint_blocks(self.http) for sample in samples]
        if self._gate is not None:
            out += [AUTH_REFUSED.sample(self._gate.refused[r], r) for r in REFUSAL_REASONS]
        return out

    def problems(self) -> Sequence[str]:
        return ()

    @property
    def address(self) -> tuple[str, int]:
        if self._server is None or not self._server.sockets:
            return parse_listen(self.settings.listen)
        host, port = self._server.sockets[0].getsockname()[:2]
        return str(host), int(port)

    async def start(self) -> None:
        host, port = parse_listen(self.settings.listen)
        settings = self.settings
        tls: ssl.SSLContext | None = None
        try:
            # The loader checked these files (the same rules as the MQTT key's): again here,
            # for they may have changed since, and a sink can be built without the loader.
            check_files(settings, "prometheus")
            web = settings.web()
            if web.cert_file is not None and web.key_file is not None:
                tls = server_tls_context(web.cert_file, web.key_file, web.min_version)
        except (ConfigError, UsersFileError, OSError, ssl.SSLError) as exc:
            raise OSError(f"prometheus: {exc}") from None
        if web.users is not None:
            self._gate = AuthGate(web.users)
            await self._gate.start()
        self.http.tls = tls
        try:
            self._server = await self.http.listen(host, port)
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"cannot listen on {self.settings.listen}: {exc.strerror}; "
                "is another process using the port? set [prometheus] listen",
            ) from exc
        log.info("serving metrics", listen=f"{self.address[0]}:{self.address[1]}")

    async def run(self) -> None:
        assert self._server is not None
        async with self._server:
            await self._server.serve_forever()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        self.http.close()
        if self._gate is not None:
            self._gate.close()

    def metrics_body(self) -> bytes:
        text = snapshot_text(self.runtime.families(), self.runtime.samples())
        return (text + self.process.text()).encode("utf-8")

    def healthz(self) -> tuple[int, bytes]:
        if not self.runtime.first_round.is_set():
            return 503, b"starting: the first collection round has not finished\n"
        health = self.runtime.health()
        notices = "".join(f"notice: {notice}\n" for notice in health.notices)
        if health.ok:
            return 200, ("ok\n" + notices).encode()
        return 503, ("\n".join(health.problems) + "\n" + notices).encode()

    async def _answer(self, head: bytes, client: str) -> Answer:
        if self._gate is not None:
            # The last Authorization header, as before: a client sends one.
            header = (header_values(head, "authorization") or [""])[-1]
            verdict = await self._gate.verify(client, header)
            if not verdict.allowed:
                return verdict.status, dict(verdict.headers), verdict.body
        return self.respond(head)

    def respond(self, head: bytes) -> Answer:
        """Answer one request head: (status, headers, body)."""
        line = request_line(head)
        if len(line) == 3:
            return line
        _, path = line
        if path == "/metrics":
            started = time.monotonic()
            body = self.metrics_body()
            out_headers = {"Content-Type": CONTENT_TYPE}
            if accepts_gzip(head):
                body = gzip.compress(body, compresslevel=1)
                out_headers["Content-Encoding"] = "gzip"
            self.scrapes += 1
            self.runtime.record_delivery(self.name)
            log.debug("scrape served", seconds=round(time.monotonic() - started, 4))
            # HEAD: the server sends the length of this body, without it (exporters/http.py).
            return 200, out_headers, body
        if path == "/healthz":
            status, body = self.healthz()
            return status, {"Content-Type": "text/plain; charset=utf-8"}, body
        if path == "/":
            return (
                200,
                {"Content-Type": "text/plain; charset=utf-8"},
                (b"gpuwarden: /metrics (Prometheus), /healthz (200 while collection is fresh)\n"),
            )
        return 404, {}, b"not found\n"


SPEC = SinkSpec(
    name="prometheus",
    description="Prometheus /metrics and /healthz endpoint (pull)",
    settings_type=PrometheusSettings,
    factory=PrometheusSink,
)
