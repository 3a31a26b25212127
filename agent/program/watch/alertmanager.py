"""The watcher's alerts, posted to every member of an Alertmanager cluster (API v2).

As Prometheus does it: each member gets every alert (the members gossip notifications, not
alerts, so one missing member must not lose an alert), active alerts are posted again every
`alertmanager_resend_interval` seconds without `endsAt` (Alertmanager then holds each for its
`resolve_timeout`, 5 min by default, from the last post), and a cleared alert is posted once
with `endsAt` = when it cleared.

Times across a step of the watcher's wall clock: Alertmanager judges `endsAt` by its own clock,
and a `startsAt` that moves is another interval of the alert. An alert keeps the `startsAt` of
its first post for as long as it is active (the fleet moves its `since` with a step: news to
nobody), and its `endsAt` is the earlier of when it cleared on the clock as it is now and on
the clock as it was at the raise (the step taken back, by the monotonic clock): whichever of
the two was wrong, a cleared alert is never held active by an `endsAt` ahead of
Alertmanager's clock, and it is never before the `startsAt`.

Times on a member whose clock disagrees with the watcher's: each answer's `Date` header says
the member's clock, kept against the watcher's monotonic clock (`Member.mono_offset`), so a
step of the watcher's wall clock does not change it. Where the two wall clocks differ by more
than SKEW_TOLERANCE, an alert's times are posted on the member's clock (when it began and
when it cleared, by the monotonic clock), never after the member's now: a watcher whose clock
runs ahead of the member's by more than `resolve_timeout` would otherwise post a `startsAt`
beyond the end Alertmanager gives an active alert, and have every alert refused (HTTP 400),
and one ahead by less would hold every cleared alert active for the difference. A batch
refused by an answer that first told the member's clock is posted again on it, not dropped.

Labels are only what two watchers of the same fleet agree on (alertname, node, severity, kind,
repair_action): their posts then have the same fingerprint, and Alertmanager notifies once for
both (the high-availability setup). Annotations (summary, action, runbook_url) may differ;
Alertmanager keeps the latest.

One task per member, each with its own queue (the latest state of each alert, so an alert that
flaps while a member is down is one entry, not one per change; at most MAX_PENDING, the
oldest dropped and counted) and its own backoff ([watch] reconnect_min/max, the watcher's one
retry policy). A post runs in a daemon thread of its own (urllib, a timeout per socket
operation), so neither the event loop nor the watcher's exit waits on a member. A failure is counted per member and reason, and
logged once per outage (and when its reason changes), not once per retry.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import email.utils
import json
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import structlog

from agent.contracts.config import read_secret
from agent.contracts.errors import ConfigError
from agent.contracts.model import MetricFamily, MetricType, Sample
from agent.contracts.settings import check_files
from agent.program.watch.fleet import Alert, AlertChange
from agent.program.watch.settings import WatchSettings
from exporters.exposition import Block
from exporters.mqtt_client import Backoff, tls_context

log = structlog.get_logger(component="watch")
T = TypeVar("T")

API_PATH = "/api/v2/alerts"
MAX_PENDING = 10_000
"""Alerts queued per member at most (distinct alerts: a change replaces its own entry)."""
BATCH = 500
"""Alerts per POST: a fleet-wide outage is a few posts, not one huge body or thousands."""
SKEW_TOLERANCE = 2.0
"""Seconds the watcher's and a member's wall clocks may differ before alerts are posted on the
member's clock: its `Date` header says whole seconds, and clocks on NTP agree far better."""
FAILURE_REASONS = (
    "connect",
    "timeout",
    "tls",
    "unauthorized",
    "rejected",
    "server_error",
    "error",
)
FAILURE_TEXT = {
    "connect": "cannot connect to the Alertmanager member",
    "timeout": "the Alertmanager member did not answer in time",
    "tls": "TLS with the Alertmanager member failed (certificate, CA file, host name)",
    "unauthorized": "the Alertmanager member refused the credentials",
    "rejected": "the Alertmanager member rejected the alerts as invalid; they are dropped",
    "server_error": "the Alertmanager member answered with a server error",
    "error": "posting to the Alertmanager member failed",
}

UP = MetricFamily(
    "gpuwarden_watch_alertmanager_up",
    MetricType.GAUGE,
    "1 while the last post to this Alertmanager member succeeded",
    ("url",),
)
PENDING = MetricFamily(
    "gpuwarden_watch_alertmanager_pending_alerts",
    MetricType.GAUGE,
    "Alerts queued for this Alertmanager member",
    ("url",),
)
LAST_SUCCESS = MetricFamily(
    "gpuwarden_watch_alertmanager_last_success_timestamp_seconds",
    MetricType.GAUGE,
    "When a post to this Alertmanager member last succeeded",
    ("url",),
)
SENT = MetricFamily(
    "gpuwarden_watch_alertmanager_sent_alerts_total",
    MetricType.COUNTER,
    "Alerts posted to this Alertmanager member (raised, re-sent and cleared)",
    ("url",),
)
DROPPED = MetricFamily(
    "gpuwarden_watch_alertmanager_dropped_alerts_total",
    MetricType.COUNTER,
    "Alerts dropped for this member: the queue was full, or the member rejected them",
    ("url",),
)
FAILED = MetricFamily(
    "gpuwarden_watch_alertmanager_failures_total",
    MetricType.COUNTER,
    "Failed posts to this Alertmanager member, by reason",
    ("url", "reason"),
)
SKEW = MetricFamily(
    "gpuwarden_watch_alertmanager_clock_skew_seconds",
    MetricType.GAUGE,
    "The watcher's wall clock less this Alertmanager member's (its last answer's Date header)",
    ("url",),
)


def alertname(kind: str) -> str:
    """node_dead -> GpuwardenNodeDead: derived from the kind alone, so two watchers agree."""
    return "Gpuwarden" + "".join(part.capitalize() for part in kind.split("_"))


def _rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def labels_of(alert: Alert) -> dict[str, str]:
    labels = {
        "alertname": alertname(alert.kind),
        "severity": alert.severity.label,
        "kind": alert.kind,
        "repair_action": alert.repair_action.value,
    }
    if alert.node:  # a broker-level alert has no node: an empty label is an absent one
        labels["node"] = alert.node
    return labels


def post_body(
    alert: Alert, ends_at: float | None, runbook_url: str, starts_at: float | None = None
) -> dict[str, object]:
    """One postableAlert of the v2 API (Alertmanager's api/v2/openapi.yaml). `starts_at`:
    the member's time for it, where not the alert's `since`."""
    labels = labels_of(alert)
    annotations = {"summary": alert.message, "action": alert.action}
    if runbook_url:
        name = labels["alertname"]
        annotations["runbook_url"] = runbook_url.format(
            kind=alert.kind, alertname=name, anchor=name.lower(), node=alert.node
        )
    starts = alert.since if starts_at is None else starts_at
    body: dict[str, object] = {
        "labels": labels,
        "annotations": annotations,
        "startsAt": _rfc3339(starts),
    }
    if ends_at is not None:
        body["endsAt"] = _rfc3339(max(ends_at, starts))
    return body


@dataclass(frozen=True)
class Auth:
    header: str | None
    """The Authorization header's value, or None."""
    tls: ssl.SSLContext | None


def load_auth(settings: WatchSettings) -> Auth:
    """Read the secrets and the CA file now: a mistake stops the watcher with the key named
    (exit code 2) instead of a retry loop that can never succeed. Raises ConfigError."""
    check_files(settings, "watch")
    header = None
    if settings.alertmanager_bearer_token_file is not None:
        token = read_secret(
            settings.alertmanager_bearer_token_file, "watch.alertmanager_bearer_token_file"
        )
        header = f"Bearer {token}"
    elif settings.alertmanager_username:
        password = ""
        if settings.alertmanager_password_file is not None:
            password = read_secret(
                settings.alertmanager_password_file, "watch.alertmanager_password_file"
            )
        pair = f"{settings.alertmanager_username}:{password}".encode()
        header = "Basic " + base64.b64encode(pair).decode("ascii")
    context = None
    if any(url.startswith("https:") for url in settings.alertmanager_urls):
        ca = settings.alertmanager_ca_file
        try:
            context = tls_context(None if ca is None else str(ca), None, None)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                "watch.alertmanager_ca_file", f"cannot load the CA file: {exc}"
            ) from None
    return Auth(header, context)


class PostFailed(Exception):
    def __init__(self, reason: str, detail: str, date: float | None = None) -> None:
        super().__init__(detail)
        self.reason = reason
        self.date = date
        """The member's clock as its answer's Date header said, read on the monotonic clock
        (`answered_at`); None without an answer."""


def answered_at(date_header: str | None) -> float | None:
    """The member's clock less the watcher's monotonic one, from an answer's Date header just
    received; None where absent or unreadable. The header's whole seconds are truncated, so
    the middle of its second is taken."""
    if not date_header:
        return None
    try:
        when = email.utils.parsedate_to_datetime(date_header)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # "-0000": RFC 5322 says UTC with no more said
        when = when.replace(tzinfo=UTC)
    return when.timestamp() + 0.5 - time.monotonic()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is an error: urllib would follow a 301/302 with a GET, dropping the body."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def _opener(tls: ssl.SSLContext | None) -> urllib.request.OpenerDirector:
    # No proxy from the environment (http_proxy is for the web, not for the cluster's own
    # Alertmanagers; Prometheus uses none either unless told), no redirects.
    return urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=tls), _NoRedirect()
    )


def post(url: str, body: bytes, auth: Auth, timeout: float) -> float | None:
    """POST the alerts (in a worker thread). PostFailed with a reason from FAILURE_REASONS.
    Returns the member's clock less the monotonic one (`answered_at`), or None."""
    request = urllib.request.Request(url, data=body, method="POST")  # noqa: S310 (http(s) only: settings)
    request.add_header("Content-Type", "application/json")
    if auth.header is not None:
        request.add_header("Authorization", auth.header)
    try:
        with _opener(auth.tls).open(request, timeout=timeout) as response:
            date = answered_at(response.headers.get("Date"))
            response.read()
            return date
    except urllib.error.HTTPError as exc:
        date = answered_at(exc.headers.get("Date") if exc.headers is not None else None)
        detail = f"HTTP {exc.code}: {exc.read(300).decode(errors='replace').strip()}"
        if exc.code in (401, 403):
            raise PostFailed("unauthorized", detail, date) from None
        if exc.code >= 500 or exc.code == 429:
            raise PostFailed("server_error", detail, date) from None
        if exc.code >= 400:
            raise PostFailed("rejected", detail, date) from None
        # 3xx: the URL names something else (a proxy's login page, the UI); retried, logged.
        raise PostFailed(
            "error", f"{detail} (redirected: name the member's API URL)", date
        ) from None
    except urllib.error.URLError as exc:
        raise _classify(exc.reason if isinstance(exc.reason, BaseException) else exc) from None
    except (OSError, ValueError) as exc:
        raise _classify(exc) from None


def _classify(exc: BaseException) -> PostFailed:
    if isinstance(exc, ssl.SSLError | ssl.CertificateError):
        return PostFailed("tls", str(exc))
    if isinstance(exc, TimeoutError | socket.timeout):
        return PostFailed("timeout", str(exc) or "timed out")
    if isinstance(exc, ConnectionError | socket.gaierror):
        return PostFailed("connect", str(exc))
    return PostFailed("error", f"{type(exc).__name__}: {exc}")


def in_thread(fn: Callable[..., T], *args: object) -> asyncio.Future[T]:
    """Run `fn` in a daemon thread of its own. A member posts one batch at a time, so this is
    at most one thread per member, and a post hung on a silent member holds only its own.
    Daemon: such a post must not hold the watcher's exit (an executor's threads are joined
    at exit, for up to alertmanager_timeout per socket operation)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(outcome: tuple[T] | BaseException) -> None:
        if future.done():
            return  # cancelled meanwhile (the watcher stops)
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome[0])

    def work() -> None:
        outcome: tuple[T] | BaseException
        try:
            outcome = (fn(*args),)
        except Exception as exc:  # handed to the loop, which raises it in the member's task
            outcome = exc
        with contextlib.suppress(RuntimeError):  # the loop closed first: nobody waits
            loop.call_soon_threadsafe(settle, outcome)

    threading.Thread(target=work, name="watch-am-post", daemon=True).start()
    return future


@dataclass(frozen=True)
class Entry:
    alert: Alert
    ends_at: float | None
    """None: active (posted without endsAt); a time: cleared then."""
    began: float | None = None
    """When the alert began on the monotonic clock (for a member whose clock disagrees)."""
    ended: float | None = None
    """When it cleared on the monotonic clock; None while active."""


@dataclass
class Member:
    """One Alertmanager of the cluster: its queue, its counters, its backoff."""

    base: str
    backoff: Backoff
    pending: OrderedDict[tuple[str, str], Entry] = field(default_factory=OrderedDict)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    sent: int = 0
    dropped: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    failing: str | None = None
    """The reason of the outage in progress; None while posts succeed."""
    last_success: float | None = None
    limit: int = MAX_PENDING
    mono_offset: float | None = None
    """The member's wall clock less the watcher's monotonic one, from its last answer's Date
    header (`answered_at`); None before any answer."""
    starts: dict[tuple[str, str], float] = field(default_factory=dict)
    """Alert -> the startsAt this member holds for it (posted on its clock where they
    disagree): the same in every post while the alert is active."""

    def clock(self) -> float | None:
        """The member's wall clock now (as it last said), or None before it said."""
        return None if self.mono_offset is None else time.monotonic() + self.mono_offset

    def skew(self, wall: float) -> float | None:
        """The watcher's wall clock (`wall`, now) less the member's; None before it said."""
        theirs = self.clock()
        return None if theirs is None else wall - theirs

    def heard(self, mono_offset: float | None) -> bool:
        """Take an answer's clock; True when it tells the member's clock for the first time
        or moved it by more than SKEW_TOLERANCE (the member's clock stepped)."""
        if mono_offset is None:
            return False
        before, self.mono_offset = self.mono_offset, mono_offset
        return before is None or abs(mono_offset - before) > SKEW_TOLERANCE

    @property
    def url(self) -> str:
        return self.base.rstrip("/") + API_PATH

    def queue(self, key: tuple[str, str], entry: Entry) -> None:
        self.pending.pop(key, None)  # to the back: the latest change is sent last
        self.pending[key] = entry
        while len(self.pending) > self.limit:
            self.pending.popitem(last=False)
            self.dropped += 1
        self.wake.set()


class AlertmanagerSender:
    """Holds the watcher's active alerts and keeps every member told."""

    def __init__(
        self,
        settings: WatchSettings,
        clock: Callable[[], float] = time.time,
        auth: Auth | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.auth = auth if auth is not None else load_auth(settings)  # ConfigError: exit 2
        self.members = [
            Member(url, Backoff(settings.reconnect_min, settings.reconnect_max))
            for url in settings.alertmanager_urls
        ]
        self.active: dict[tuple[str, str], Alert] = {}
        self._offsets: dict[tuple[str, str], float] = {}
        """Active alert -> the wall clock less the monotonic one when it was raised."""
        self._tasks: list[asyncio.Task[None]] = []

    def change(self, change: AlertChange) -> None:
        """An alert raised or cleared (on the event loop, from the evaluation)."""
        alert, key = change.alert, change.alert.key
        offset = self.clock() - time.monotonic()
        posted = self.active.get(key)
        if posted is not None:  # as first posted: the same startsAt, whatever the clock did
            alert = dataclasses.replace(alert, since=posted.since)
        if change.raised:
            self._offsets.setdefault(key, offset)
            self.active[key] = alert
            entry = self._active_entry(key, alert)
        else:
            self.active.pop(key, None)
            raised = self._offsets.pop(key, offset)
            # On the raise's clock, the step since taken back; the earlier of the two.
            entry = Entry(
                alert,
                min(change.at, change.at + raised - offset),
                began=alert.since - raised,
                ended=change.at - offset,
            )
        for member in self.members:
            member.queue(alert.key, entry)

    def _active_entry(self, key: tuple[str, str], alert: Alert) -> Entry:
        return Entry(alert, None, began=alert.since - self._offsets[key])

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._forever(m)) for m in self.members]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _forever(self, member: Member) -> None:
        # The first round posts at once, even nothing: a member that is down or refuses the
        # credentials is reported at start, not at the first alert, and `up` means something.
        # Scheduled on the loop's monotonic clock: a wall-clock step must not stop re-sends.
        loop = asyncio.get_running_loop()
        resend_at = loop.time()
        probe = False
        while True:
            now = loop.time()
            if now >= resend_at:
                for key, alert in self.active.items():
                    member.queue(key, self._active_entry(key, alert))
                resend_at = now + self.settings.alertmanager_resend_interval
                probe = True
            if member.pending or probe:
                if await self._post_batch(member):
                    probe = False
                else:
                    await asyncio.sleep(member.backoff.next_delay())
                continue
            member.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(member.wake.wait(), max(0.0, resend_at - now))

    async def _post_batch(self, member: Member) -> bool:
        batch = list(member.pending.items())[:BATCH]
        runbook = self.settings.alertmanager_runbook_url
        times: dict[tuple[str, str], tuple[float, float | None]] = {}
        try:
            bodies = []
            for key, entry in batch:
                times[key] = self._times(member, key, entry)
                bodies.append(post_body(entry.alert, times[key][1], runbook, times[key][0]))
            body = json.dumps(bodies).encode()
            answer = await in_thread(
                post, member.url, body, self.auth, self.settings.alertmanager_timeout
            )
        except Exception as exc:  # a bug must not end this member's task for good
            failure = exc if isinstance(exc, PostFailed) else PostFailed("error", repr(exc))
            return self._settle_failure(member, batch, times, failure)
        member.heard(answer)
        self._delivered(member, len(batch))
        for key, entry in batch:  # what it now holds, kept while the alert is active
            if entry.ends_at is None:
                member.starts.setdefault(key, times[key][0])
        self._done(member, batch)
        return True

    def _times(
        self, member: Member, key: tuple[str, str], entry: Entry
    ) -> tuple[float, float | None]:
        """The startsAt and endsAt to post to `member`. On the watcher's clock while the two
        agree (within SKEW_TOLERANCE), else on the member's (the monotonic times of the entry
        plus the member's offset); never after the member's now (a startsAt there is
        refused, an endsAt there holds a cleared alert active)."""
        alert, ends = entry.alert, entry.ends_at
        theirs = member.clock()
        skew = member.skew(self.clock())
        on_theirs = skew is not None and abs(skew) > SKEW_TOLERANCE
        held = member.starts.get(key)
        if held is not None:
            starts = held
        elif on_theirs and entry.began is not None and member.mono_offset is not None:
            starts = entry.began + member.mono_offset
        else:
            starts = alert.since
        if ends is not None and on_theirs and entry.ended is not None:
            assert member.mono_offset is not None
            ends = entry.ended + member.mono_offset
        if theirs is not None and on_theirs:
            starts = min(starts, theirs)
            ends = None if ends is None else min(ends, theirs)
        return starts, ends

    def _settle_failure(
        self,
        member: Member,
        batch: list[tuple[tuple[str, str], Entry]],
        sent: dict[tuple[str, str], tuple[float, float | None]],
        exc: PostFailed,
    ) -> bool:
        self._failed(member, exc)
        told = member.heard(exc.date)
        if exc.reason != "rejected":
            return False
        if told and any(self._times(member, key, e) != sent.get(key) for key, e in batch):
            # Refused as posted on a clock the member had not told yet: again, on its
            log.warning(
                "the Alertmanager member's clock disagrees with the watcher's; posting again "
                "on its clock",
                url=member.url,
                skew=member.skew(self.clock()),
            )
            return False
        # Invalid as sent: the same body would be refused forever. Counted and logged.
        member.dropped += len(batch)
        self._done(member, batch)
        return True

    def _done(self, member: Member, batch: list[tuple[tuple[str, str], Entry]]) -> None:
        for key, entry in batch:
            if member.pending.get(key) is entry:  # not changed again while in flight
                del member.pending[key]
            if key not in self.active and key not in member.pending:
                member.starts.pop(key, None)

    def _failed(self, member: Member, exc: PostFailed) -> None:
        member.failures[exc.reason] += 1
        if member.failing != exc.reason:
            log.warning(
                FAILURE_TEXT[exc.reason],
                url=member.url,
                reason=exc.reason,
                error=str(exc)[:300],
                pending=len(member.pending),
            )
        member.failing = exc.reason

    def _delivered(self, member: Member, count: int) -> None:
        member.sent += count
        member.last_success = self.clock()
        member.backoff.reset()
        if member.failing is not None:
            log.info("Alertmanager member reachable again", url=member.url, sent=count)
        member.failing = None

    # -- /metrics ---------------------------------------------------------------------------

    def families(self) -> Sequence[Block]:
        """Built on the event loop (a few series per member), rendered with the fleet's."""
        up: list[Sample] = []
        pending: list[Sample] = []
        last: list[Sample] = []
        sent: list[Sample] = []
        dropped: list[Sample] = []
        failed: list[Sample] = []
        skews: list[Sample] = []
        wall = self.clock()
        for m in self.members:
            skew = m.skew(wall)
            if skew is not None:
                skews.append(SKEW.sample(skew, m.base))
            up.append(UP.sample(0.0 if m.failing or m.last_success is None else 1.0, m.base))
            pending.append(PENDING.sample(float(len(m.pending)), m.base))
            if m.last_success is not None:
                last.append(LAST_SUCCESS.sample(m.last_success, m.base))
            sent.append(SENT.sample(float(m.sent), m.base))
            dropped.append(DROPPED.sample(float(m.dropped), m.base))
            for reason in FAILURE_REASONS:
                failed.append(FAILED.sample(float(m.failures[reason]), m.base, reason))
        return [
            (UP, up),
            (PENDING, pending),
            (LAST_SUCCESS, last),
            (SENT, sent),
            (DROPPED, dropped),
            (FAILED, failed),
            (SKEW, skews),
        ]
