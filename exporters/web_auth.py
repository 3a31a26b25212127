"""Basic authentication and TLS for the Prometheus endpoint, at the attacker's cost.

Users come from one of two files:
- the users file (`basic_auth_users_file`): one `user:bcrypt-hash` per line (the hashes
  Prometheus' web config takes, e.g. from `htpasswd -nbBC 12 USER PASSWORD`); blank lines and
  lines starting with `#` are ignored;
- the exporter-toolkit web config (`web_config_file`, node_exporter's `--web.config.file`):
  `basic_auth_users: {user: bcrypt-hash}` and `tls_server_config: {cert_file, key_file}`.

bcrypt is slow on purpose (0.1-0.3 s per check at cost 10-12), so a guess must cost the one who
guesses, not the host:
- checks run in one dedicated thread (never asyncio's default executor, which the MQTT
  client's connect shares), at most MAX_PENDING waiting, clients that never failed first:
  beyond that, the worst-ranked request is answered 503 without bcrypt;
- a client address whose credentials failed waits an exponential backoff (429 Retry-After,
  without bcrypt), has at most one check in flight, and its checks rank behind those of
  clients that were refused less often lately;
- every check does the same bcrypt work whatever the user: an unknown user is checked against a
  dummy hash of the highest cost in the file, and a user of a lower cost c is topped up with
  one dummy check at each cost from c to that maximum less one (2^c + ... + 2^(max-1) + 2^c =
  2^max), so the response time does not say which users exist;
- a success is cached as (user, sha256(password)) (a scrape comes every 15 s); the cache holds
  no password, and a cached pair is let in before any backoff.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import hashlib
import hmac
import math
import re
import secrets
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from agent.contracts.errors import ConfigError, GpuwardenError
from agent.contracts.settings import check_files, read_regular, setting

log = structlog.get_logger(component="prometheus")

BCRYPT_HASH = re.compile(r"\$2[aby]\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{53}")
"""Prefix, cost 04-31, 22 characters of salt and 31 of hash in bcrypt's base64: anything else
fails every login (bcrypt.checkpw raises on it), so it is refused when the file is loaded."""
CACHE_SIZE = 64
DEFAULT_COST = 12
AUTH_THREADS = 1
"""One thread: a guessing storm then costs the host at most one core, whatever its size."""
MAX_PENDING = 2
"""Checks waiting for the auth thread; beyond it the worst-ranked is answered 503."""
BACKOFF_FIRST = 0.5
BACKOFF_MAX = 10.0
"""Seconds a client waits after its first failed check, doubled per failure up to this."""
STRIKE_HALF_LIFE = 10.0
"""Seconds in which a client's strikes (refused or failed attempts) halve."""
TRACKED_CLIENTS = 4096
"""Client addresses whose failures are remembered (the oldest forgotten first)."""
THREAD_NAME = "gpuwarden-auth"
REFUSAL_REASONS = (
    "failed",  # checked: wrong user or password (401)
    "backoff",  # not checked: the client failed lately, or has a check in flight (429)
    "busy",  # not checked: the queue held better-ranked checks (503)
)


def bcrypt_cost(hashed: bytes) -> int | None:
    """The cost of a `$2b$12$...` hash; None if it does not say one."""
    parts = hashed.split(b"$")
    if len(parts) < 4 or not parts[2].isdigit():
        return None
    cost = int(parts[2])
    return cost if 4 <= cost <= 31 else None


class UsersFileError(GpuwardenError, ValueError):
    """The basic-auth users file or web config is malformed; the message names the file and
    the line or key."""


_HASH_HELP = (
    "is not a bcrypt hash ($2b$, a cost 04-31, $, 53 characters of ./A-Za-z0-9); make one "
    "with: htpasswd -nbBC 12 USER PASSWORD"
)


def parse_users(text: str, source: str = "users file") -> dict[str, bytes]:
    users: dict[str, bytes] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        user, sep, hashed = line.partition(":")
        user, hashed = user.strip(), hashed.strip()
        if not sep or not user:
            raise UsersFileError(f"{source}:{number}: expected user:bcrypt-hash")
        if not BCRYPT_HASH.fullmatch(hashed):
            raise UsersFileError(f"{source}:{number}: the hash of {user!r} {_HASH_HELP}")
        if user in users:
            raise UsersFileError(f"{source}:{number}: user {user!r} appears twice")
        users[user] = hashed.encode("ascii")
    if not users:
        raise UsersFileError(f"{source}: no users; remove basic_auth_users_file to serve openly")
    return users


def load_users(path: Path) -> dict[str, bytes]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsersFileError(f"cannot read {path}: {exc}") from None
    return parse_users(text, str(path))


# -- the exporter-toolkit web config -----------------------------------------------------------


@dataclass(frozen=True)
class WebConfig:
    """What gpuwarden takes from a web-config.yml: users and the server certificate."""

    users: dict[str, bytes] | None
    cert_file: Path | None
    key_file: Path | None
    min_version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_2


@dataclass(frozen=True)
class _WebTls:
    """The TLS files a web config names, checked by the rules of the TOML file keys."""

    cert_file: Path = setting(file="certificate")
    key_file: Path = setting(file="private_key", certificate="cert_file")


# Keys of exporter-toolkit's web config that gpuwarden does not implement. Ignoring one would
# serve with less than the file asks (no client certificates, other TLS versions): refused.
_UNSUPPORTED_TLS = (
    "client_auth_type",
    "client_ca_file",
    "client_allowed_sans",
    "cipher_suites",
    "curve_preferences",
    "max_version",
    "prefer_server_cipher_suites",
    "cert",
    "key",
)
_MIN_VERSIONS = {"TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}


def _table(data: object, source: str, key: str) -> Mapping[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise UsersFileError(f"{source}: {key}: expected a mapping of names to values")
    return data


def _web_users(data: object, source: str) -> dict[str, bytes] | None:
    if data is None:
        return None
    if not isinstance(data, dict):
        raise UsersFileError(f"{source}: basic_auth_users: expected a mapping of user: bcrypt-hash")
    users: dict[str, bytes] = {}
    for user, hashed in data.items():
        if not isinstance(user, str) or not user:
            raise UsersFileError(
                f"{source}: basic_auth_users: the user name {user!r} is not a string "
                "(quote it: YAML reads yes, no, on, off and numbers as other types)"
            )
        if ":" in user:
            raise UsersFileError(f"{source}: basic_auth_users.{user}: a user name has no ':'")
        if not isinstance(hashed, str) or not BCRYPT_HASH.fullmatch(hashed):
            raise UsersFileError(f"{source}: basic_auth_users.{user}: the hash {_HASH_HELP}")
        users[user] = hashed.encode("ascii")
    if not users:
        raise UsersFileError(
            f"{source}: basic_auth_users: no users; remove the key to serve openly"
        )
    return users


def _web_tls(data: object, source: str, base: Path) -> WebConfig:
    """The TLS part of a web config (users left None)."""
    tls = _table(data, source, "tls_server_config")
    if not tls:
        return WebConfig(None, None, None)
    for key in tls:
        if key in _UNSUPPORTED_TLS:
            raise UsersFileError(
                f"{source}: tls_server_config.{key}: not supported by gpuwarden (it would be "
                "ignored, and the endpoint would serve without it); remove it"
            )
        if key not in ("cert_file", "key_file", "min_version"):
            raise UsersFileError(
                f"{source}: tls_server_config.{key}: unknown key; gpuwarden takes cert_file, "
                "key_file and min_version"
            )
    version = tls.get("min_version", "TLS12")
    if version not in _MIN_VERSIONS:
        raise UsersFileError(
            f"{source}: tls_server_config.min_version: expected TLS12 or TLS13, got {version!r}"
        )
    paths: list[Path] = []
    for key in ("cert_file", "key_file"):
        value = tls.get(key)
        if not isinstance(value, str) or not value:
            raise UsersFileError(
                f"{source}: tls_server_config.{key}: expected a file name (both cert_file and "
                "key_file are needed)"
            )
        # As exporter-toolkit does: a relative path is relative to the web config's directory.
        paths.append(base / value)
    return WebConfig(None, paths[0], paths[1], _MIN_VERSIONS[version])


def parse_web_config(text: str, source: str, base: Path) -> WebConfig:
    """A web-config.yml's text -> WebConfig, or UsersFileError naming `source`, the key (or
    line) and what was expected."""
    from exporters import _web_yaml  # noqa: PLC0415 (yaml loads only for a web config)

    try:
        data = _web_yaml.load(text)
    except _web_yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        raise UsersFileError(f"{source}{where}: not valid YAML: {exc.problem}") from None
    except _web_yaml.YAMLError as exc:
        raise UsersFileError(f"{source}: not valid YAML: {exc}") from None
    top = _table(data, source, "the file")
    for key, value in top.items():
        if key == "http_server_config":
            # http2 only: gpuwarden speaks HTTP/1.1, which every scraper falls back to.
            extra = sorted(set(_table(value, source, key)) - {"http2"})
            if extra:
                raise UsersFileError(f"{source}: {key}.{extra[0]}: not supported by gpuwarden")
        elif key not in ("basic_auth_users", "tls_server_config"):
            raise UsersFileError(
                f"{source}: {key}: unknown key; gpuwarden takes basic_auth_users, "
                "tls_server_config and http_server_config"
            )
    tls = _web_tls(top.get("tls_server_config"), source, base)
    users = _web_users(top.get("basic_auth_users"), source)
    if users is None and tls.cert_file is None:
        raise UsersFileError(
            f"{source}: neither basic_auth_users nor tls_server_config: nothing to serve with"
        )
    return dataclasses.replace(tls, users=users)


def load_web_config(path: Path) -> WebConfig:
    """Read and parse a web config, and check the TLS files it names by the rules of the
    file keys (a private key only its owner reads, loading with its certificate)."""
    try:
        text = read_regular(path).decode("utf-8")
    except (ValueError, OSError) as exc:
        raise UsersFileError(f"cannot read {path}: {exc}") from None
    config = parse_web_config(text, str(path), path.parent)
    if config.cert_file is not None and config.key_file is not None:
        try:
            check_files(_WebTls(config.cert_file, config.key_file), "tls_server_config")
        except ConfigError as exc:
            raise UsersFileError(f"{path}: {exc}") from None
    return config


# -- credentials -------------------------------------------------------------------------------


def parse_authorization(header: str) -> tuple[str, str] | None:
    """'Basic base64(user:password)' -> (user, password); None if it is not that."""
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "basic" or not value:
        return None
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    user, sep, password = decoded.partition(":")
    return (user, password) if sep else None


def _dummy(cost: int) -> bytes:
    import bcrypt  # noqa: PLC0415 (loads with the first users file: tests/test_daemon_imports.py)

    return bcrypt.hashpw(secrets.token_bytes(16), bcrypt.gensalt(cost))


class BasicAuth:
    """The users and the checks; blocking (bcrypt): build and check it in the auth thread."""

    def __init__(self, users: dict[str, bytes]) -> None:
        self.users = users
        costs = {user: bcrypt_cost(hashed) or DEFAULT_COST for user, hashed in users.items()}
        self.max_cost = max(costs.values(), default=DEFAULT_COST)
        lowest = min(costs.values(), default=self.max_cost)
        # One dummy hash per cost from the lowest to the highest in the file.
        self._dummies = {cost: _dummy(cost) for cost in range(lowest, self.max_cost + 1)}
        self.dummy_hash = self._dummies[self.max_cost]
        self._padding = {
            user: tuple(self._dummies[c] for c in range(cost, self.max_cost))
            for user, cost in costs.items()
        }
        self._cache: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        # cached() runs on the loop and check() in the auth thread: without the lock, one
        # iterates the cache while another inserts or evicts ("mutated during iteration").
        self._lock = threading.Lock()

    def cached(self, user: str, password: str) -> bool:
        """True if this exact pair was checked successfully before (cheap: no bcrypt)."""
        key = (user, hashlib.sha256(password.encode()).digest())
        with self._lock:
            for known, _ in self._cache.items():
                if hmac.compare_digest(known[1], key[1]) and known[0] == user:
                    self._cache.move_to_end(known)
                    return True
        return False

    def check(self, user: str, password: str) -> bool:
        """The full check (blocking). Caches success. The same bcrypt work for every user,
        known or not, whatever the cost of its hash (module docstring)."""
        if self.cached(user, password):
            return True
        secret = password.encode()
        hashed = self.users.get(user)
        ok = _checkpw(secret, hashed or self.dummy_hash) and hashed is not None
        for padding in self._padding.get(user, ()):
            _checkpw(secret, padding)
        if ok:
            with self._lock:
                self._cache[(user, hashlib.sha256(secret).digest())] = None
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        return ok


def _checkpw(password: bytes, hashed: bytes) -> bool:
    import bcrypt  # noqa: PLC0415 (a module already loaded: a dictionary look-up)

    try:
        return bcrypt.checkpw(password, hashed)
    except ValueError:  # a malformed stored hash
        return False


@dataclass
class _Client:
    """What a client address did lately: its strikes rank its checks, its failures its
    backoff."""

    strikes: float = 0.0
    at: float = 0.0
    failures: int = 0
    until: float = 0.0

    def strike(self, now: float) -> None:
        self.strikes = self.current(now) + 1.0
        self.at = now

    def current(self, now: float) -> float:
        # Halved every STRIKE_HALF_LIFE s: a client that stops hammering is soon ranked anew.
        return float(self.strikes * 0.5 ** (max(now - self.at, 0.0) / STRIKE_HALF_LIFE))


@dataclass(frozen=True)
class Verdict:
    """allowed, or the answer to send: (status, headers, body)."""

    allowed: bool
    status: int = 200
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""


ALLOWED = Verdict(True)
UNAUTHORIZED = Verdict(
    False, 401, (("WWW-Authenticate", 'Basic realm="gpuwarden"'),), b"unauthorized\n"
)
BUSY = Verdict(False, 503, (("Retry-After", "1"),), b"busy checking credentials\n")


@dataclass(eq=False)
class _Check:
    client: str
    credentials: tuple[str, str]
    rank: tuple[float, int]
    """(strikes of its client, arrival): the lowest is checked first, the highest dropped."""
    done: asyncio.Future[bool | None]
    """True or False once checked; None when dropped for a better-ranked check."""


class AuthGate:
    """Who may spend bcrypt time, in which order, and on which thread (module docstring).

    Checks wait in a queue of MAX_PENDING ordered by their client's strikes (attempts refused
    or failed lately), so a scraper asking every few seconds goes before guessers that hammer,
    and a full queue drops its worst-ranked check rather than the newcomer when the newcomer
    ranks better. One worker task hands the checks one by one to the auth thread.
    """

    def __init__(
        self, users: dict[str, bytes], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._users = users
        self._clock = clock
        self.pool = ThreadPoolExecutor(AUTH_THREADS, thread_name_prefix=THREAD_NAME)
        self._auth: BasicAuth | None = None
        self._queue: list[_Check] = []
        self._wake = asyncio.Event()
        self._worker: asyncio.Task[None] | None = None
        self._arrivals = 0
        self._in_flight: dict[str, _Check] = {}
        self._clients: OrderedDict[str, _Client] = OrderedDict()
        self.refused = dict.fromkeys(REFUSAL_REASONS, 0)

    async def start(self) -> None:
        """Build the dummy hashes (a few bcrypt hashes) in the auth thread, off the loop."""
        loop = asyncio.get_running_loop()
        self._auth = await loop.run_in_executor(self.pool, BasicAuth, self._users)
        self._worker = asyncio.create_task(self._work(), name="auth-checks")

    @property
    def auth(self) -> BasicAuth:
        assert self._auth is not None, "AuthGate.start() first"
        return self._auth

    def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
        # Every waiting request is answered 503, the one in the auth thread too.
        for check in [*self._queue, *self._in_flight.values()]:
            if not check.done.done():
                check.done.set_result(None)
        self._queue.clear()
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def verify(self, client: str, header: str) -> Verdict:
        credentials = parse_authorization(header)
        if credentials is None:
            return UNAUTHORIZED
        if self.auth.cached(*credentials):
            return ALLOWED
        now = self._clock()
        record = self._client(client)
        pending = self._in_flight.get(client)
        if pending is not None and pending.credentials == credentials:
            # The client asks again (its last connection gave up waiting): the same check.
            return self._verdict(await asyncio.shield(pending.done))
        if record.until > now or pending is not None:
            record.strike(now)
            self.refused["backoff"] += 1
            retry = str(max(1, math.ceil(record.until - now)))
            return Verdict(False, 429, (("Retry-After", retry),), b"too many attempts\n")
        check = self._enqueue(client, credentials, record.current(now))
        if check is None:
            record.strike(now)
            self.refused["busy"] += 1
            return BUSY
        self._in_flight[client] = check
        try:
            ok = await asyncio.shield(check.done)
        finally:
            del self._in_flight[client]
            if not check.done.done():  # cancelled (a stop): no one waits for it any more
                check.done.set_result(None)
            if check in self._queue:
                self._queue.remove(check)
        if ok is None:
            record.strike(self._clock())
        else:
            self._record(record, ok)
        return self._verdict(ok)

    def _verdict(self, ok: bool | None) -> Verdict:
        if ok is None:
            self.refused["busy"] += 1
            return BUSY
        if not ok:
            self.refused["failed"] += 1
            return UNAUTHORIZED
        return ALLOWED

    def _enqueue(self, client: str, credentials: tuple[str, str], strikes: float) -> _Check | None:
        self._arrivals += 1
        rank = (strikes, self._arrivals)
        if len(self._queue) >= MAX_PENDING:
            worst = max(self._queue, key=lambda c: c.rank)
            if worst.rank[0] <= strikes:
                return None  # the newcomer is no better than anyone waiting
            self._queue.remove(worst)
            worst.done.set_result(None)
        check = _Check(client, credentials, rank, asyncio.get_running_loop().create_future())
        self._queue.append(check)
        self._wake.set()
        return check

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            if not self._queue:
                self._wake.clear()
                continue
            check = min(self._queue, key=lambda c: c.rank)
            self._queue.remove(check)
            try:
                ok: bool | None = await loop.run_in_executor(
                    self.pool, self.auth.check, *check.credentials
                )
            except Exception:  # a bug in a check must not stop every later one
                log.exception("basic auth check failed")
                ok = None
            if not check.done.done():
                check.done.set_result(ok)

    def _client(self, client: str) -> _Client:
        record = self._clients.pop(client, None) or _Client()
        self._clients[client] = record  # the most recent last: the oldest are forgotten first
        while len(self._clients) > TRACKED_CLIENTS:
            self._clients.popitem(last=False)
        return record

    def _record(self, record: _Client, ok: bool) -> None:
        now = self._clock()
        if ok:
            record.strikes = record.failures = 0
            record.until = 0.0
            return
        record.strike(now)
        record.failures += 1
        record.until = now + min(BACKOFF_FIRST * 2 ** (record.failures - 1), BACKOFF_MAX)


def server_tls_context(
    cert_file: Path, key_file: Path, minimum: ssl.TLSVersion = ssl.TLSVersion.TLSv1_2
) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = minimum
    context.load_cert_chain(str(cert_file), str(key_file))
    return context
