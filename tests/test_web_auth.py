"""Prometheus endpoint security: the users file, basic auth with bcrypt, TLS."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import ClassVar

import bcrypt
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.contracts.errors import ConfigError
from agent.program import config_file as config_module
from agent.program import registry
from agent.runtime.core import Runtime
from agent.runtime.state import StateStore
from exporters.prometheus import PrometheusSettings, PrometheusSink
from exporters.web_auth import (
    THREAD_NAME,
    AuthGate,
    BasicAuth,
    UsersFileError,
    bcrypt_cost,
    parse_authorization,
    parse_users,
    parse_web_config,
)
from tests.support.ports import free_port
from tests.support.tls import Authority
from tests.support.waiting import until

# cost 4: the minimum, to keep the tests fast; the check is the same at any cost
HASH = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(4)).decode()


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


class TestUsersFile:
    """user:bcrypt-hash lines, comments, and errors that name the line."""

    def test_parses_users_and_skips_comments(self) -> None:
        """Comments and blank lines are ignored; each user maps to its hash."""
        users = parse_users(f"# scrapers\n\nprometheus:{HASH}\n  other : {HASH}  \n")
        assert users == {"prometheus": HASH.encode(), "other": HASH.encode()}

    @pytest.mark.parametrize(
        ("text", "message"),
        [
            ("prometheus", ":1: expected user:bcrypt-hash"),
            ("prometheus:plaintext", ":1: the hash of 'prometheus' is not a bcrypt hash"),
            (f"a:{HASH}\na:{HASH}", ":2: user 'a' appears twice"),
            ("# nobody\n", "no users"),
        ],
    )
    def test_errors_name_the_line(self, text: str, message: str) -> None:
        """A malformed file is refused with the line and what to do."""
        with pytest.raises(UsersFileError, match=message):
            parse_users(text, "users")

    @given(st.text(max_size=200))
    def test_parser_never_crashes(self, text: str) -> None:
        """Any text is a users mapping or a UsersFileError."""
        try:
            users = parse_users(text)
        except UsersFileError:
            return
        assert users
        assert all(h.startswith(b"$2") and len(h) == 60 for h in users.values())


class TestAuthorizationHeader:
    """'Basic base64(user:password)' and nothing else."""

    @given(st.text(min_size=1).filter(lambda u: ":" not in u), st.text())
    def test_round_trip(self, user: str, password: str) -> None:
        """Any user without ':' and any password come back as sent."""
        assert parse_authorization(basic(user, password)) == (user, password)

    @given(st.text(max_size=100))
    def test_garbage_is_none_or_a_pair(self, header: str) -> None:
        """Arbitrary headers never raise."""
        result = parse_authorization(header)
        assert result is None or len(result) == 2

    def test_other_schemes_are_refused(self) -> None:
        """Bearer tokens and undecodable values are not credentials."""
        assert parse_authorization("Bearer abc") is None
        assert parse_authorization("Basic !!!") is None


class TestBasicAuth:
    """bcrypt checks, unknown users, and the cache of successes."""

    def test_right_wrong_unknown_and_cache(self) -> None:
        """Only the right pair passes; a success is cached, a failure never."""
        auth = BasicAuth(parse_users(f"prometheus:{HASH}"))
        assert not auth.cached("prometheus", "s3cret")
        assert auth.check("prometheus", "s3cret")
        assert auth.cached("prometheus", "s3cret")
        assert not auth.check("prometheus", "wrong")
        assert not auth.cached("prometheus", "wrong")
        assert not auth.check("nobody", "s3cret")


class TestSameCostForEveryUser:
    """Known or unknown, cost 4 or cost 10: every check does the same bcrypt work, so the time
    of a wrong answer says nothing of which users exist (on main: 3 ms for a cost-5 user,
    219 ms for an unknown one)."""

    USERS: ClassVar[dict[str, bytes]] = {
        "cheap": bcrypt.hashpw(b"pw", bcrypt.gensalt(4)),
        "middle": bcrypt.hashpw(b"pw", bcrypt.gensalt(7)),
        "dear": bcrypt.hashpw(b"pw", bcrypt.gensalt(10)),
    }

    def test_bcrypt_work_is_the_highest_cost_for_every_user(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The sum of 2^cost over the bcrypt calls of one check, for each kind of user."""
        auth = BasicAuth(dict(self.USERS))
        work: list[int] = []
        checkpw = bcrypt.checkpw

        def counting(password: bytes, hashed: bytes) -> bool:
            work.append(2 ** (bcrypt_cost(hashed) or 0))
            return checkpw(password, hashed)

        monkeypatch.setattr(bcrypt, "checkpw", counting)
        spent = {}
        for user in [*self.USERS, "nobody", ""]:
            work.clear()
            assert not auth.check(user, "wrong")
            spent[user] = sum(work)
        assert set(spent.values()) == {2**10}, spent
        assert auth.check("cheap", "pw")  # and the right password still passes

    def test_wrong_answers_take_about_as_long(self) -> None:
        """The time of a wrong answer (this thread's CPU time: the bcrypt work is done in the
        caller, and another job on a shared machine takes the core, not this thread's time),
        the fastest of 5 taken in turns, within a gross factor of 4: on main it was 64 (cost 4
        against cost 10)."""
        auth = BasicAuth(dict(self.USERS))
        fastest = dict.fromkeys(["cheap", "dear", "nobody"], float("inf"))
        for _ in range(5):
            for user in fastest:
                started = time.thread_time()
                auth.check(user, "wrong")
                fastest[user] = min(fastest[user], time.thread_time() - started)
        assert max(fastest.values()) < 4 * min(fastest.values()), fastest

    def test_dummy_hash_has_the_highest_cost(self) -> None:
        auth = BasicAuth(dict(self.USERS))
        assert bcrypt_cost(auth.dummy_hash) == auth.max_cost == 10


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def wrong_or_right(password: str) -> str:
    return basic("prometheus", password)


class TestAuthGate:
    """The order and the cost of checks: backoff, one at a time, the auth thread."""

    async def test_failures_back_off_per_client_without_bcrypt(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        clock = FakeClock()
        gate = AuthGate(parse_users(f"prometheus:{HASH}"), clock)
        await gate.start()
        calls: list[str] = []
        checkpw = bcrypt.checkpw

        def counting(password: bytes, hashed: bytes) -> bool:
            calls.append(threading.current_thread().name)
            return checkpw(password, hashed)

        monkeypatch.setattr(bcrypt, "checkpw", counting)
        try:
            assert (await gate.verify("10.0.0.1", wrong_or_right("no"))).status == 401
            assert len(calls) == 1
            again = await gate.verify("10.0.0.1", wrong_or_right("no"))
            assert (again.status, dict(again.headers)["Retry-After"]) == (429, "1")
            assert len(calls) == 1  # refused without bcrypt
            # Another address is not held back by this one's failures.
            assert (await gate.verify("10.0.0.2", wrong_or_right("s3cret"))).allowed
            # The backoff doubles with each failure.
            for failures, seconds in [(1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0)]:
                clock.now += seconds + 0.01
                assert (await gate.verify("10.0.0.1", wrong_or_right("no"))).status == 401, failures
                clock.now += seconds * 2 - 0.02
                assert (await gate.verify("10.0.0.1", wrong_or_right("no"))).status == 429
            # A success clears it; the right password of a backed-off client is cached anyway.
            assert (await gate.verify("10.0.0.1", wrong_or_right("s3cret"))).allowed
            assert all(name.startswith(THREAD_NAME) for name in calls), calls
        finally:
            gate.close()

    async def test_a_client_that_never_failed_goes_before_guessers(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """With the auth thread busy and the queue full of guessers' checks, a fresh client's
        check takes the place of the worst-ranked one and is checked next."""
        gate = AuthGate(parse_users(f"prometheus:{HASH}"))
        await gate.start()
        release = threading.Event()
        order: list[bytes] = []
        checkpw = bcrypt.checkpw

        def slow(password: bytes, hashed: bytes) -> bool:
            release.wait(10)
            order.append(password)
            return checkpw(password, hashed)

        monkeypatch.setattr(bcrypt, "checkpw", slow)
        try:
            # Guessers hammering: each refused a few times lately (strikes).
            guessers = [f"10.0.1.{i}" for i in range(6)]
            for address in guessers:
                for _ in range(3):
                    gate._client(address).strike(time.monotonic())
            waiting = [
                asyncio.create_task(gate.verify(a, basic("prometheus", f"guess-{a}")))
                for a in guessers
            ]
            await until(lambda: gate.refused["busy"] >= 3, what="queue full")
            scraper = asyncio.create_task(gate.verify("10.0.9.9", wrong_or_right("s3cret")))
            await asyncio.sleep(0.05)
            release.set()
            assert (await scraper).allowed
            verdicts = await asyncio.gather(*waiting)
            # The check in the thread when the scraper came, then the scraper's.
            assert order[1] == b"s3cret"
            assert sorted(v.status for v in verdicts).count(503) >= 3
        finally:
            release.set()
            gate.close()


class TestCacheConcurrency:
    """cached() on the loop and check() in threads share the cache safely."""

    def test_threads_hammering_the_cache_raise_nothing(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Concurrent inserts, evictions and lookups never raise."""
        monkeypatch.setattr(bcrypt, "checkpw", lambda _p, _h: True)
        auth = BasicAuth({f"u{i}": HASH.encode() for i in range(100)})
        errors: list[BaseException] = []

        def worker(n: int) -> None:
            for j in range(400):
                user, password = f"u{(n * 7 + j) % 100}", f"pw{j % 90}"
                try:
                    auth.cached(user, password)
                    auth.check(user, password)
                except RuntimeError as exc:
                    errors.append(exc)
                    return

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []


class TestEndpoint:
    """/metrics over TLS with basic auth: right credentials 200, wrong 401."""

    async def test_tls_and_basic_auth(self, tmp_path: Path) -> None:
        """HTTPS with the CA: 200 with the right password, 401 with a wrong or no password."""
        authority = Authority(tmp_path / "ca").create()
        server = authority.issue("localhost", dns_names=("localhost",), ip_addresses=("127.0.0.1",))
        users = tmp_path / "users"
        users.write_text(f"prometheus:{HASH}\n")
        users.chmod(0o600)
        port = free_port()
        cfg = config_module.parse(
            {
                "node_id": "n",
                "state_dir": str(tmp_path / "state"),
                "prometheus": {
                    "listen": f"127.0.0.1:{port}",
                    "tls_cert_file": str(server.cert),
                    "tls_key_file": str(server.key),
                    "basic_auth_users_file": str(users),
                },
            }
        )
        runtime = Runtime(
            cfg,
            StateStore.open(cfg.state_dir),
            collectors=registry.COLLECTORS,
            sinks=registry.SINKS,
        )
        await runtime.start()
        context = ssl.create_default_context(cafile=str(authority.cert))

        def get(url: str, authorization: str | None) -> tuple[int, dict[str, str]]:
            request = urllib.request.Request(url)
            if authorization is not None:
                request.add_header("Authorization", authorization)
            try:
                with urllib.request.urlopen(request, timeout=10, context=context) as response:
                    return int(response.status), dict(response.headers)
            except urllib.error.HTTPError as exc:
                return int(exc.code), dict(exc.headers)

        url = f"https://localhost:{port}/metrics"
        try:
            ok = await asyncio.to_thread(get, url, basic("prometheus", "s3cret"))
            assert ok[0] == 200
            again = await asyncio.to_thread(get, url, basic("prometheus", "s3cret"))
            assert again[0] == 200
            wrong = await asyncio.to_thread(get, url, basic("prometheus", "nope"))
            assert wrong[0] == 401
            missing = await asyncio.to_thread(get, url, None)
            assert missing[0] == 401
            assert missing[1]["WWW-Authenticate"] == 'Basic realm="gpuwarden"'
            with pytest.raises(ConnectionError):  # plain HTTP to the TLS port: no answer
                await asyncio.to_thread(
                    urllib.request.urlopen, f"http://127.0.0.1:{port}/metrics", timeout=5
                )
            sink = runtime.sinks["prometheus"]
            assert isinstance(sink, PrometheusSink)
            assert sink.scrapes == 2
            refused = {s.label_values: s.value for s in sink.samples() if "auth" in s.family.name}
            assert refused == {("failed",): 1.0, ("backoff",): 0.0, ("busy",): 0.0}
        finally:
            await runtime.stop()
            runtime.store.close()

    @pytest.mark.parametrize("key", ["tls_key_file", "basic_auth_users_file"])
    async def test_file_others_can_read_stops_the_start(self, tmp_path: Path, key: str) -> None:
        """The key and the users file follow the MQTT key's rule, at start too (a sink built
        without the loader, or a file changed since): private, or refused with the chmod."""
        authority = Authority(tmp_path / "ca").create()
        server = authority.issue("localhost", ip_addresses=("127.0.0.1",))
        users = tmp_path / "users"
        users.write_text(f"prometheus:{HASH}\n")
        users.chmod(0o600)
        table = {
            "listen": f"127.0.0.1:{free_port()}",
            "tls_cert_file": str(server.cert),
            "tls_key_file": str(server.key),
            "basic_auth_users_file": str(users),
        }
        Path(table[key]).chmod(0o644)
        cfg = config_module.parse({"state_dir": str(tmp_path / "state"), "prometheus": table})
        runtime = Runtime(
            cfg,
            StateStore.open(cfg.state_dir),
            collectors=registry.COLLECTORS,
            sinks=registry.SINKS,
        )
        try:
            with pytest.raises(OSError, match=f"prometheus.{key}: .*chmod 600 {table[key]}"):
                await runtime.start()
        finally:
            await runtime.stop()
            runtime.store.close()

    async def test_bad_users_file_stops_the_start(self, tmp_path: Path) -> None:
        """A malformed users file refuses to start the endpoint, naming the line."""
        users = tmp_path / "users"
        users.write_text("prometheus:plain\n")
        users.chmod(0o600)
        cfg = config_module.parse(
            {
                "state_dir": str(tmp_path / "state"),
                "prometheus": {
                    "listen": f"127.0.0.1:{free_port()}",
                    "basic_auth_users_file": str(users),
                },
            }
        )
        runtime = Runtime(
            cfg,
            StateStore.open(cfg.state_dir),
            collectors=registry.COLLECTORS,
            sinks=registry.SINKS,
        )
        with pytest.raises(OSError, match="users:1"):
            await runtime.start()
        await runtime.stop()


@pytest.fixture
async def endpoint(tmp_path: Path) -> AsyncIterator[PrometheusSink]:
    """A running agent with the plain-HTTP endpoint on a free port."""
    cfg = config_module.parse(
        {
            "node_id": "n",
            "state_dir": str(tmp_path / "state"),
            "prometheus": {"listen": f"127.0.0.1:{free_port()}"},
        }
    )
    runtime = Runtime(
        cfg,
        StateStore.open(cfg.state_dir),
        collectors=registry.COLLECTORS,
        sinks=registry.SINKS,
    )
    await runtime.start()
    sink = runtime.sinks["prometheus"]
    assert isinstance(sink, PrometheusSink)
    try:
        yield sink
    finally:
        await runtime.stop()
        runtime.store.close()


class TestEndpointLimits:
    """A client that never reads is dropped; HEAD tells the length GET would send (the budget
    and the deadlines: tests/test_http_server.py)."""

    async def test_client_that_never_reads_is_dropped(
        self, endpoint: PrometheusSink, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A request whose large response is never read is aborted after the timeout."""
        body = b"x" * (16 << 20)  # far more than the socket buffers hold
        monkeypatch.setattr(endpoint.http, "send_timeout", 0.2)
        monkeypatch.setattr(endpoint, "metrics_body", lambda: body)
        with socket.socket() as client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.connect(endpoint.address)
            client.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            await until(lambda: endpoint.http.open_connections == 1, what="served")
            await until(lambda: endpoint.http.open_connections == 0, what="slow client dropped")

            def read_all() -> int:
                client.settimeout(10)
                total = 0
                with contextlib.suppress(ConnectionResetError):
                    while chunk := client.recv(1 << 16):
                        total += len(chunk)
                return total

            assert await asyncio.to_thread(read_all) < len(body)

    async def test_dropped_connections_are_counted_on_metrics(
        self, endpoint: PrometheusSink, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """An attack is visible: a silent client closed at the header deadline is a count."""
        monkeypatch.setattr(endpoint.http, "header_timeout", 0.2)
        with socket.socket() as silent:
            silent.connect(endpoint.address)
            silent.settimeout(10)
            assert await asyncio.to_thread(silent.recv, 100) == b""
        url = "http://{}:{}/metrics".format(*endpoint.address)
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read())
        lines = body.decode().splitlines()
        assert 'gpuwarden_http_connections_dropped_total{reason="header_timeout"} 1.0' in lines
        assert 'gpuwarden_http_connections_dropped_total{reason="evicted"} 0.0' in lines
        assert not any(line.startswith("gpuwarden_http_auth_refused") for line in lines)

    async def test_head_content_length_is_the_get_body_length(
        self, endpoint: PrometheusSink, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """HEAD /metrics: no body, and Content-Length of the GET body."""
        body = b"# a fixed exposition\nmetric 1\n"
        monkeypatch.setattr(endpoint, "metrics_body", lambda: body)
        url = "http://{}:{}/metrics".format(*endpoint.address)

        def fetch(method: str) -> tuple[str | None, bytes]:
            request = urllib.request.Request(url, method=method)
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.headers["Content-Length"], response.read()

        got = await asyncio.to_thread(fetch, "GET")
        head = await asyncio.to_thread(fetch, "HEAD")
        assert got == (str(len(body)), body)
        assert head == (str(len(body)), b"")


NODE_EXPORTER_WEB_CONFIG = """\
# As node_exporter takes it (--web.config.file), from the exporter-toolkit documentation.
tls_server_config:
  cert_file: server.crt
  key_file: "keys/server.key"
  min_version: TLS12

http_server_config:
  http2: false

basic_auth_users:
  prometheus: {hash}
  'grafana': "{hash_2y}"
"""


def write_web_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "web-config.yml"
    path.write_text(text)
    path.chmod(0o600)
    return path


class TestWebConfig:
    """exporter-toolkit's web-config.yml: the file operators already have for node_exporter."""

    def test_node_exporter_file_is_read(self, tmp_path: Path) -> None:
        """Users (bcrypt $2b$ and Go's $2y$), and TLS files relative to the file's directory."""
        hash_2y = "$2y$" + HASH[4:]
        text = NODE_EXPORTER_WEB_CONFIG.format(hash=HASH, hash_2y=hash_2y)
        config = parse_web_config(text, "web.yml", tmp_path)
        assert config.users == {"prometheus": HASH.encode(), "grafana": hash_2y.encode()}
        assert config.cert_file == tmp_path / "server.crt"
        assert config.key_file == tmp_path / "keys" / "server.key"
        assert config.min_version is ssl.TLSVersion.TLSv1_2
        assert BasicAuth(config.users).check("grafana", "s3cret")  # Go's $2y$ verifies

    @pytest.mark.parametrize(
        ("text", "message"),
        [
            ("basic_auth_users: [a\n", r"web\.yml:2:1: not valid YAML"),
            ("- a\n- b\n", "web.yml: the file: expected a mapping"),
            ("basic_auth_user:\n  a: x\n", "web.yml: basic_auth_user: unknown key"),
            (f"basic_auth_users:\n  a: {HASH}\n  a: {HASH}\n", "web.yml:3:3: .*'a' appears twice"),
            (f"basic_auth_users:\n  yes: {HASH}\n", "user name True is not a string"),
            ("basic_auth_users:\n  a: plain\n", "basic_auth_users.a: the hash is not a bcrypt"),
            ("basic_auth_users:\n  a: 12\n", "basic_auth_users.a: the hash is not a bcrypt"),
            ("basic_auth_users: {}\n", "basic_auth_users: no users"),
            ("basic_auth_users: x\n", "basic_auth_users: expected a mapping"),
            (
                "tls_server_config:\n  cert_file: c\n  key_file: k\n"
                "  client_auth_type: RequireAndVerifyClientCert\n",
                "tls_server_config.client_auth_type: not supported by gpuwarden",
            ),
            ("tls_server_config:\n  cert_file: c\n", "tls_server_config.key_file: expected a file"),
            ("tls_server_config:\n  certfile: c\n", "tls_server_config.certfile: unknown key"),
            (
                "tls_server_config:\n  cert_file: c\n  key_file: k\n  min_version: TLS10\n",
                "tls_server_config.min_version: expected TLS12 or TLS13",
            ),
            ("http_server_config:\n  headers: {}\n", "http_server_config.headers: not supported"),
            (f"a: &x {HASH}\nbasic_auth_users:\n  b: *x\n", "aliases"),
            ("# nothing\n", "neither basic_auth_users nor tls_server_config"),
            ("? [a]\n: b\n", r"web\.yml:1:3: not valid YAML: found unhashable key"),
            ("\t- a", "not valid YAML"),
        ],
    )
    def test_malformed_files_are_refused_naming_file_and_key(self, text: str, message: str) -> None:
        with pytest.raises(UsersFileError, match=message):
            parse_web_config(text, "web.yml", Path("/etc/gpuwarden"))

    def toml(self, tmp_path: Path, prometheus: str) -> Path:
        path = tmp_path / "gpuwarden.toml"
        path.write_text(f'state_dir = "{tmp_path / "state"}"\n[prometheus]\n{prometheus}')
        return path

    def test_checked_at_load_like_every_file_key(self, tmp_path: Path) -> None:
        """config check and run refuse a bad web config with the TOML file, the key, the web
        config and its key; the TLS key it names follows the private key rule."""
        authority = Authority(tmp_path / "ca").create()
        server = authority.issue("localhost", ip_addresses=("127.0.0.1",))
        good = f"tls_server_config:\n  cert_file: {server.cert}\n  key_file: {server.key}\n"
        web = write_web_config(tmp_path, good + f"basic_auth_users:\n  p: {HASH}\n")
        toml = self.toml(tmp_path, f'web_config_file = "{web}"\n')
        loaded = config_module.load(toml).section("prometheus", PrometheusSettings)
        assert loaded.web_config_file == web

        write_web_config(tmp_path, good + "basic_auth_users:\n  p: nope\n")
        with pytest.raises(ConfigError) as bad:
            config_module.load(toml)
        assert str(bad.value).startswith(f"{toml}: prometheus.web_config_file: {web}: ")
        assert "basic_auth_users.p: the hash is not a bcrypt hash" in str(bad.value)

        write_web_config(tmp_path, good)
        server.key.chmod(0o644)
        with pytest.raises(
            ConfigError, match=f"tls_server_config.key_file: .*chmod 600 {server.key}"
        ):
            config_module.load(toml)
        server.key.chmod(0o600)

        web.chmod(0o644)  # it holds password hashes: private, like the users file
        with pytest.raises(ConfigError, match=f"prometheus.web_config_file: .*chmod 600 {web}"):
            config_module.load(toml)

    def test_web_config_or_the_three_keys_not_both(self, tmp_path: Path) -> None:
        users = tmp_path / "users"
        users.write_text(f"prometheus:{HASH}\n")
        users.chmod(0o600)
        web = write_web_config(tmp_path, f"basic_auth_users:\n  p: {HASH}\n")
        toml = self.toml(
            tmp_path, f'web_config_file = "{web}"\nbasic_auth_users_file = "{users}"\n'
        )
        with pytest.raises(
            ConfigError, match=r"prometheus\.web_config_file: set web_config_file or"
        ):
            config_module.load(toml)

    async def test_endpoint_serves_tls_and_auth_from_the_web_config(self, tmp_path: Path) -> None:
        authority = Authority(tmp_path / "ca").create()
        server = authority.issue("localhost", ip_addresses=("127.0.0.1",))
        (tmp_path / "tls").mkdir()
        for source, name in ((server.cert, "server.crt"), (server.key, "server.key")):
            target = tmp_path / "tls" / name
            target.write_bytes(source.read_bytes())
            target.chmod(0o600)
        web = write_web_config(
            tmp_path,
            "tls_server_config:\n  cert_file: tls/server.crt\n  key_file: tls/server.key\n"
            f"basic_auth_users:\n  prometheus: {HASH}\n",
        )
        port = free_port()
        cfg = config_module.parse(
            {
                "state_dir": str(tmp_path / "state"),
                "prometheus": {"listen": f"127.0.0.1:{port}", "web_config_file": str(web)},
            }
        )
        runtime = Runtime(
            cfg,
            StateStore.open(cfg.state_dir),
            collectors=registry.COLLECTORS,
            sinks=registry.SINKS,
        )
        await runtime.start()
        context = ssl.create_default_context(cafile=str(authority.cert))

        def get(authorization: str) -> int:
            request = urllib.request.Request(f"https://127.0.0.1:{port}/metrics")
            request.add_header("Authorization", authorization)
            try:
                with urllib.request.urlopen(request, timeout=10, context=context) as response:
                    return int(response.status)
            except urllib.error.HTTPError as exc:
                return int(exc.code)

        try:
            assert await asyncio.to_thread(get, basic("prometheus", "s3cret")) == 200
            assert await asyncio.to_thread(get, basic("prometheus", "nope")) == 401
        finally:
            await runtime.stop()
            runtime.store.close()
