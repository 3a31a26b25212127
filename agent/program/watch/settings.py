"""The `[watch]` table: the broker keys shared with [mqtt] (exporters/mqtt_settings.py), where
the watcher listens, and how quickly silence becomes an alert."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from agent.contracts.config import NODE_ID
from agent.contracts.errors import ConfigError
from agent.contracts.settings import read_file, setting
from exporters.http import parse_listen
from exporters.mqtt_settings import BrokerSettings


def read_inventory(path: Path) -> list[str]:
    """One node id a line; `#` starts a comment; blank lines are skipped. ValueError names
    the file and the line (the loader checks the file with it: agent/contracts/settings.py)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    nodes: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        node = line.split("#", 1)[0].strip()
        if not node:
            continue
        if not NODE_ID.fullmatch(node):
            raise ValueError(f"{path}:{number}: {node!r} is not a node id ([A-Za-z0-9._:-])")
        nodes.append(node)
    return nodes


def check_alertmanager_url(value: str, key: str = "watch.alertmanager_urls") -> None:
    """http(s)://host[:port][/prefix]: a member of an Alertmanager cluster (the path is its
    --web.route-prefix, if any; /api/v2/alerts is appended). Credentials go in the
    alertmanager_*_file keys, where their file mode is checked, never in the URL."""
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(key, f"not a valid URL ({exc}): {value!r}") from None
    if parts.username is not None or parts.password is not None:
        raise ConfigError(
            key,
            "put no user or password in the URL; use alertmanager_username and "
            "alertmanager_password_file, or alertmanager_bearer_token_file",
        )
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(key, f"expected http://host:port or https://host:port, got {value!r}")
    if parts.query or parts.fragment:
        raise ConfigError(key, f"an Alertmanager URL has no query or fragment: {value!r}")
    if port == 0:
        raise ConfigError(key, "port must be 1-65535, got 0")


def load_inventory(path: Path, key: str = "watch.inventory_file") -> list[str]:
    """The inventory, checked as the loader checks `inventory_file` (also for --inventory)."""
    read_file(path, "readable", key)
    try:
        return read_inventory(path)
    except ValueError as exc:
        raise ConfigError(key, str(exc)) from None


@dataclass(frozen=True)
class WatchSettings(BrokerSettings):
    inventory_file: Path | None = setting(
        None,
        help="the nodes, one id a line, # comments; others are counted, not watched; "
        "unset: every node seen",
        file="readable",
        content=read_inventory,
    )
    stale_after_intervals: float = setting(
        3.0,
        minimum=1.5,
        maximum=100.0,
        help="a node is stale when its heartbeat is older than this many of its own intervals",
    )
    default_interval: float = setting(
        15.0,
        exclusive_minimum=0.0,
        maximum=86400.0,
        help="heartbeat interval assumed for a node until its first heartbeat says its own",
    )
    quiet_window: float = setting(
        30.0,
        minimum=0.0,
        maximum=3600.0,
        help="all nodes silent within this many seconds of each other: one fleet alert",
    )
    quiet_min_nodes: int = setting(
        2,
        minimum=2,
        maximum=1_000_000,
        help="the fleet alert needs at least this many nodes; fewer get node alerts",
    )
    broker_grace: float = setting(
        10.0,
        minimum=0.0,
        maximum=3600.0,
        help="seconds without the broker before the broker alert is raised",
    )
    reconnect_grace: float = setting(
        90.0,
        minimum=0.0,
        maximum=86400.0,
        help="after a reconnection, nodes not heard again yet keep their alerts as they were "
        "(and broker_unreachable stays) for up to this many seconds: they are reconnecting too",
    )
    forget_offline_after: float = setting(
        7 * 86400.0,
        minimum=1.0,
        maximum=366 * 86400.0,
        help="a node offline (dead or stopped) and silent this long is forgotten, its alert cleared",
    )
    max_nodes: int = setting(
        100_000,
        minimum=1,
        maximum=10_000_000,
        help="nodes held at most; when full, a new birth replaces heartbeat-only, then long "
        "offline nodes, never one born and beating",
    )
    metrics_node_limit: int = setting(
        10_000,
        minimum=0,
        maximum=10_000_000,
        help="/metrics has per-node series for at most this many nodes (those in trouble "
        "first); fleet totals always",
    )
    alerts_topic: str = setting(
        "", help="where alerts are published; empty: <prefix>/_watch/alerts"
    )
    listen: str = setting("127.0.0.1:9446", help="host:port of the watcher's /metrics; empty: off")
    evaluate_interval: float = setting(
        1.0, minimum=0.05, maximum=60.0, help="seconds between evaluations of every node"
    )
    max_payload_bytes: int = setting(
        65536,
        minimum=256,
        maximum=16 * 1024 * 1024,
        help="larger status or heartbeat payloads are counted as malformed and skipped",
    )
    heartbeat_qos: int = setting(
        0,
        minimum=0,
        maximum=1,
        help="subscription QoS for heartbeats (a lost one is replaced by the next); status is 1",
    )

    alertmanager_urls: tuple[str, ...] = setting(
        (),
        help="every member of the Alertmanager cluster, http(s)://host:port[/prefix]; each "
        "gets every alert (as Prometheus does); empty: alerts go to MQTT only",
    )
    alertmanager_username: str = setting("", help="basic-auth user for Alertmanager")
    alertmanager_password_file: Path | None = setting(
        None, help="basic-auth password for Alertmanager (mode 600); needs the user", file="secret"
    )
    alertmanager_bearer_token_file: Path | None = setting(
        None, help="bearer token for Alertmanager (mode 600); instead of basic auth", file="secret"
    )
    alertmanager_ca_file: Path | None = setting(
        None,
        help="CA bundle for https:// Alertmanager URLs; empty: the system CAs",
        file="certificate",
    )
    alertmanager_timeout: float = setting(
        10.0, exclusive_minimum=0.0, maximum=300.0, help="seconds for each POST to a member"
    )
    alertmanager_resend_interval: float = setting(
        60.0,
        minimum=1.0,
        maximum=3600.0,
        help="active alerts are posted again this often; keep it well below Alertmanager's "
        "resolve_timeout (5 min by default), or Alertmanager resolves them meanwhile",
    )
    alertmanager_runbook_url: str = setting(
        "",
        help="the runbook_url annotation; {kind}, {alertname}, {anchor} (the alertname in lower "
        "case: runbook.md's headings) and {node} are replaced; empty: no runbook_url",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_alertmanager()
        if self.alerts_topic and any(c in self.alerts_topic for c in "+#"):
            raise ConfigError("alerts_topic", "a topic to publish on cannot contain + or #")
        if self.listen:
            parse_listen(self.listen, "listen")

    def _check_alertmanager(self) -> None:
        urls = self.alertmanager_urls
        for url in urls:
            check_alertmanager_url(url, "alertmanager_urls")
        if len(set(urls)) != len(urls):
            raise ConfigError("alertmanager_urls", "a member is named twice")
        if self.alertmanager_password_file is not None and not self.alertmanager_username:
            raise ConfigError("alertmanager_password_file", "needs alertmanager_username")
        if self.alertmanager_bearer_token_file is not None and self.alertmanager_username:
            raise ConfigError(
                "alertmanager_bearer_token_file",
                "use basic auth (alertmanager_username) or a bearer token, not both",
            )
        if self.alertmanager_ca_file is not None and not any(u.startswith("https:") for u in urls):
            raise ConfigError("alertmanager_ca_file", "needs an https:// alertmanager_urls member")
        try:
            self.alertmanager_runbook_url.format(kind="k", alertname="a", anchor="a", node="n")
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError(
                "alertmanager_runbook_url",
                f"only {{kind}}, {{alertname}}, {{anchor}} and {{node}} may be replaced, "
                f"got {exc!r}",
            ) from None

    @property
    def status_topic(self) -> str:
        return f"{self.topic_prefix}/_watch/status"

    @property
    def effective_alerts_topic(self) -> str:
        return self.alerts_topic or f"{self.topic_prefix}/_watch/alerts"
