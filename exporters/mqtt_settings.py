"""The broker connection settings shared by the agent's [mqtt] and the watcher's [watch] tables,
and the broker URL they name.

`BrokerSettings` holds every key about reaching and logging in to a broker (URL, credentials,
TLS files, keepalive, client id, reconnect backoff, timeout) with its one validator; both
sections are subclasses, so a rule (no credentials in the URL, TLS files need mqtts://, a
password needs a user name) cannot hold in one and not the other. TLS always verifies the
broker's certificate and host name; there is no switch to turn that off.

The embedded default of [mqtt] is `enabled = false`: with no broker on 127.0.0.1:1883, `make run`
would otherwise log a connection failure forever. A host configuration turns it on
(docs/ARCHITECTURE.md's example does).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from agent.contracts.errors import ConfigError
from agent.contracts.settings import setting

DEFAULT_PORTS = {"mqtt": 1883, "mqtts": 8883}
_TOPIC_LEVEL = re.compile(r"^[^#+/\x00]+$")
_USERINFO = re.compile(r"//[^/?#]*@")


@dataclass(frozen=True, slots=True)
class BrokerAddress:
    host: str
    port: int
    tls: bool


def _hide_userinfo(value: str) -> str:
    """The URL as an error message may show it: a password typed into it stays out of logs."""
    return _USERINFO.sub("//", value)


def parse_url(value: str, key: str = "mqtt.url") -> BrokerAddress:
    """'mqtt://host[:port]' or 'mqtts://host[:port]' -> BrokerAddress.

    Credentials in the URL are refused: the password belongs in password_file, where its file
    mode is checked, not in a configuration file many people can read. They are checked first
    so that no other message repeats them.
    """
    shown = _hide_userinfo(value)
    try:
        parts = urlsplit(value)
    except ValueError as exc:
        raise ConfigError(key, f"not a valid URL ({exc}): {shown!r}") from None
    if parts.username is not None or parts.password is not None:
        raise ConfigError(key, "put no user or password in the URL; use username and password_file")
    try:
        port = parts.port
    except ValueError as exc:
        raise ConfigError(key, f"not a valid URL ({exc}): {shown!r}") from None
    if parts.scheme not in DEFAULT_PORTS:
        raise ConfigError(key, f"expected mqtt://host:port or mqtts://host:port, got {shown!r}")
    if not parts.hostname:
        raise ConfigError(key, f"the URL names no host: {shown!r}")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(key, f"an MQTT URL has no path, query or fragment: {shown!r}")
    if port == 0:
        raise ConfigError(key, "port must be 1-65535, got 0")
    return BrokerAddress(
        parts.hostname, port or DEFAULT_PORTS[parts.scheme], parts.scheme == "mqtts"
    )


def check_topic_prefix(prefix: str, key: str = "mqtt.topic_prefix") -> None:
    levels = prefix.split("/")
    if not prefix or not all(_TOPIC_LEVEL.match(level) for level in levels):
        raise ConfigError(
            key,
            f"expected topic levels separated by '/', without '+', '#' or empty levels, "
            f"got {prefix!r}",
        )


CLIENT_ID_MAX_BYTES = 65535
"""An MQTT string is at most 65535 bytes of UTF-8 (MQTT 5.0, section 1.5.4)."""
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def check_client_id(client_id: str, key: str = "client_id") -> None:
    """MQTT forbids U+0000 in a string and discourages the other control characters; a
    broker may close the connection on them, which would look like a network fault."""
    if _CONTROL.search(client_id):
        raise ConfigError(key, f"a client id cannot contain control characters: {client_id!r}")
    if len(client_id.encode()) > CLIENT_ID_MAX_BYTES:
        raise ConfigError(key, f"a client id is at most {CLIENT_ID_MAX_BYTES} bytes of UTF-8")


@dataclass(frozen=True)
class BrokerSettings:
    """How to reach and log in to the broker: the keys [mqtt] and [watch] have in common."""

    url: str = setting(
        "mqtt://127.0.0.1:1883",
        help="mqtt://host:port or mqtts://host:port; no user or password in it",
    )
    topic_prefix: str = setting("gpuwarden/v1", help="topics are <prefix>/<node>/<kind>")
    username: str = setting("", help="broker user name; empty: anonymous")
    password_file: Path | None = setting(
        None, help="file holding the broker password (mode 600); needs username", file="secret"
    )
    client_id: str = setting(
        "", help="MQTT client id; empty: gpuwarden-<node> (agent), gpuwarden-watch-<host> (watcher)"
    )
    keepalive: int = setting(
        30,
        minimum=5,
        maximum=65535,
        help="seconds; the broker sends the Will after about 1.5 x this of silence (never 0)",
    )
    ca_file: Path | None = setting(
        None, help="CA bundle for mqtts://; empty: the system CAs", file="certificate"
    )
    cert_file: Path | None = setting(
        None, help="client certificate (PEM) for mqtts://", file="certificate"
    )
    key_file: Path | None = setting(
        None,
        help="client key (PEM, mode 600) for mqtts://",
        file="private_key",
        certificate="cert_file",
    )
    reconnect_min: float = setting(1.0, exclusive_minimum=0.0, help="first reconnect delay, s")
    reconnect_max: float = setting(60.0, exclusive_minimum=0.0, help="longest reconnect delay, s")
    connect_timeout: float = setting(
        10.0, exclusive_minimum=0.0, help="seconds for CONNACK, SUBACK and each PUBACK"
    )

    def __post_init__(self) -> None:
        address = parse_url(self.url, "url")
        check_topic_prefix(self.topic_prefix, "topic_prefix")
        check_client_id(self.client_id)
        if (self.cert_file is None) != (self.key_file is None):
            raise ConfigError("cert_file", "set cert_file and key_file together, or neither")
        if not address.tls and any(
            p is not None for p in (self.ca_file, self.cert_file, self.key_file)
        ):
            raise ConfigError("url", "ca_file, cert_file and key_file need an mqtts:// URL")
        if self.password_file is not None and not self.username:
            # the client sends no password without a user name: it would be dropped unsaid
            raise ConfigError("password_file", "a password_file needs a username")
        if self.reconnect_min > self.reconnect_max:
            raise ConfigError("reconnect_min", "must not exceed reconnect_max")

    @property
    def address(self) -> BrokerAddress:
        return parse_url(self.url)


@dataclass(frozen=True)
class MqttSettings(BrokerSettings):
    """[mqtt]: the broker keys plus what the agent's sink alone needs."""

    enabled: bool = setting(False, help="push status, heartbeat, events and metrics to a broker")
    metrics_interval: float = setting(
        60.0, minimum=1.0, maximum=86400.0, help="seconds between metric snapshots"
    )
    metrics_qos: int = setting(0, minimum=0, maximum=1, help="QoS of metric snapshots: 0 or 1")
    outbox_max_entries: int = setting(
        100_000, minimum=10, help="outbox bound; metric snapshots are dropped first, events last"
    )
    outbox_max_bytes: int = setting(
        64 * 1024 * 1024, minimum=4096, help="outbox bound in payload bytes"
    )
    outbox_max_age: float = setting(
        7 * 86400.0, minimum=60.0, help="seconds after which an undelivered entry is dropped"
    )
    publish_window: int = setting(
        100,
        minimum=1,
        maximum=65535,
        help="QoS 1 publishes in flight at once (at most the broker's Receive Maximum)",
    )
