"""The watcher's alerts on a real Alertmanager whose clock the watcher's does not agree with.

Alertmanager judges every time by its own clock: an alert posted without `endsAt` is active
until its now plus `resolve_timeout` (5 min here), and one whose `startsAt` is later than that
is invalid (HTTP 400: "start time must be before end time"); an `endsAt` in its future keeps a
cleared alert active until then. A watcher host whose clock runs ahead (no NTP, a resumed
virtual machine) by more than `resolve_timeout` would have every alert it raises refused, the
node-dead page among them, and by less would hold every cleared alert active for the skew.
Here the watcher's clock (`wall`, tests/support/clock.py) is off from the start, by minutes to
a day either way, before the sender's first post: what Alertmanager holds must be right on its
own clock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from agent.contracts.model import Severity
from agent.program.watch.alertmanager import AlertmanagerSender, answered_at
from agent.program.watch.fleet import Alert, AlertChange
from tests.support.alertmanager import (
    AlertmanagerServer,
    WebhookReceiver,
    hooked_server,
    stamp,
    started_sender,
)
from tests.support.clock import WallClock
from tests.support.waiting import until

SKEWS = [600.0, 120.0, 86400.0, -600.0]
"""Seconds the watcher's clock is ahead of Alertmanager's (negative: behind)."""
RESEND = 0.3
SINCE = 30.0
"""The alert's condition began this long before it is raised."""


@pytest.fixture
def alertmanager(tmp_path: Path, webhook: WebhookReceiver) -> Iterator[AlertmanagerServer]:
    server = hooked_server(tmp_path / "am", webhook)
    yield server
    server.stop()


@pytest.fixture(params=SKEWS, ids=lambda s: f"ahead-{s:g}s")
def skewed(request: pytest.FixtureRequest, wall: WallClock) -> WallClock:
    wall.offset = float(request.param)
    return wall


@pytest.fixture
async def sender(
    alertmanager: AlertmanagerServer, skewed: WallClock
) -> AsyncIterator[AlertmanagerSender]:
    """The sender on the skewed clock, from its first post."""
    instance = await started_sender(alertmanager.url, RESEND)
    yield instance
    await instance.stop()


def held(server: AlertmanagerServer) -> list[dict[str, Any]]:
    return [a for a in server.alerts() if a["labels"].get("node") == "n1"]


def node_dead() -> Alert:
    return Alert(
        "node_dead", "n1", Severity.CRITICAL, "n1 is dead", "look at it", since=time.time() - SINCE
    )


async def test_an_alert_is_held_active_on_alertmanagers_clock(
    sender: AlertmanagerSender, alertmanager: AlertmanagerServer, skewed: WallClock
) -> None:
    raised = skewed.real()
    sender.change(AlertChange(True, node_dead(), time.time()))
    await until(lambda: len(held(alertmanager)) == 1, 10.0, "Alertmanager to hold the alert")
    await asyncio.sleep(RESEND * 5)  # re-sent several times
    [alert] = held(alertmanager)
    assert alert["status"]["state"] == "active"
    starts = stamp(alert["startsAt"])
    # Never after Alertmanager's now; at most the skew's measure (whole seconds) early.
    assert raised - SINCE - 2.0 <= starts <= raised + 1.0, (starts - raised, skewed.offset)
    assert stamp(alert["endsAt"]) > skewed.real()
    [member] = sender.members  # the skew is measured (the answers' Date), not guessed
    assert member.dropped == 0
    assert member.skew(time.time()) == pytest.approx(skewed.offset, abs=1.5)


async def test_the_alert_that_clears_resolves_at_once(
    sender: AlertmanagerSender,
    alertmanager: AlertmanagerServer,
    webhook: WebhookReceiver,
    skewed: WallClock,
) -> None:
    alert = node_dead()
    sender.change(AlertChange(True, alert, time.time()))
    await until(lambda: len(held(alertmanager)) == 1, 10.0, "Alertmanager to hold the alert")
    starts = stamp(held(alertmanager)[0]["startsAt"])
    await asyncio.sleep(RESEND * 2)
    cleared = skewed.real()
    sender.change(AlertChange(False, alert, time.time()))
    await until(lambda: held(alertmanager) == [], 10.0, "Alertmanager to resolve the alert")
    await until(
        lambda: webhook.matching("resolved", node="n1") != [], 10.0, "the resolved notification"
    )
    alerts = [a for n in webhook.received() for a in n.alerts() if a["labels"]["node"] == "n1"]
    assert {round(stamp(a["startsAt"]) - starts, 2) for a in alerts} == {0.0}, alerts
    [resolved] = [a for a in alerts if a["status"] == "resolved"]
    ends = stamp(resolved["endsAt"])
    assert starts <= ends <= cleared + 1.0, (ends - cleared, skewed.offset)


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "yesterday",
        "Thu, 99 Dec 2026 08:00:00 GMT",
        "Thu, 03 Dec 2026 25:61:00 GMT",
        "\x00",
    ],
)
def test_an_unreadable_date_tells_nothing(header: str | None) -> None:
    """A proxy or a member that sends no Date, or garbage: no clock, the watcher's own times."""
    assert answered_at(header) is None


@pytest.mark.parametrize(
    "header",
    [
        "Thu, 03 Dec 2026 08:00:00 GMT",
        "Thu, 03 Dec 2026 09:00:00 +0100",
        "Thu, 03 Dec 2026 08:00:00 -0000",
    ],
)
def test_a_date_is_the_middle_of_its_second(header: str) -> None:
    told = answered_at(header)
    assert told is not None
    assert told + time.monotonic() == pytest.approx(
        datetime(2026, 12, 3, 8, 0, 0, tzinfo=UTC).timestamp() + 0.5, abs=0.05
    )
