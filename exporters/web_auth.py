"""Basic authentication and TLS for the Prometheus endpoint.

The users file holds one `user:bcrypt-hash` per line (the hashes Prometheus' web config takes
under `basic_auth_users`, e.g. from `htpasswd -nbBC 12 USER PASSWORD` or Python's
`bcrypt.hashpw`); blank lines and lines starting with `#` are ignored.

bcrypt is slow on purpose (about 0.1-0.3 s per check at cost 10-12) and a scrape comes every
15 s, so a successful check is cached as (user, sha256(password)); the cache holds no password.
An unknown user still costs one bcrypt check against a dummy hash, so response time does not
tell which user names exist.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import secrets
import ssl
import threading
from collections import OrderedDict
from pathlib import Path

import bcrypt

from agent.contracts.errors import GpuwardenError

BCRYPT_HASH = re.compile(r"\$2[aby]\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{53}")
"""Prefix, cost 04-31, 22 characters of salt and 31 of hash in bcrypt's base64: anything else
fails every login (bcrypt.checkpw raises on it), so it is refused when the file is loaded."""
CACHE_SIZE = 64
DEFAULT_COST = 12


def bcrypt_cost(hashed: bytes) -> int | None:
    """The cost of a `$2b$12$...` hash; None if it does not say one."""
    parts = hashed.split(b"$")
    if len(parts) < 4 or not parts[2].isdigit():
        return None
    cost = int(parts[2])
    return cost if 4 <= cost <= 31 else None


def dummy_hash(users: dict[str, bytes]) -> bytes:
    """A hash of a random string at the users' cost: an unknown user then costs as much as a
    known one, so response time does not tell which user names exist (a fixed cost-10 dummy
    answered about 4x faster than users hashed at cost 12)."""
    cost = next((c for c in map(bcrypt_cost, users.values()) if c is not None), DEFAULT_COST)
    return bcrypt.hashpw(secrets.token_bytes(16), bcrypt.gensalt(cost))


class UsersFileError(GpuwardenError, ValueError):
    """The basic-auth users file is malformed; the message names the line."""


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
            raise UsersFileError(
                f"{source}:{number}: the hash of {user!r} is not a bcrypt hash ($2b$, a cost "
                "04-31, $, 53 characters of ./A-Za-z0-9); make one with: "
                "htpasswd -nbBC 12 USER PASSWORD"
            )
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


class BasicAuth:
    def __init__(self, users: dict[str, bytes]) -> None:
        self.users = users
        self.dummy_hash = dummy_hash(users)
        self._cache: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        # cached() runs on the loop and check() in worker threads: without the lock, one
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
        """The full check (blocking: run it in a thread). Caches success."""
        if self.cached(user, password):
            return True
        hashed = self.users.get(user)
        try:
            ok = bcrypt.checkpw(password.encode(), hashed or self.dummy_hash) and hashed is not None
        except ValueError:  # a malformed stored hash
            ok = False
        if ok:
            with self._lock:
                self._cache[(user, hashlib.sha256(password.encode()).digest())] = None
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        return ok


def server_tls_context(cert_file: Path, key_file: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(str(cert_file), str(key_file))
    return context
