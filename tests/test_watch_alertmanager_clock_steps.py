"""The watcher's times on a real Alertmanager across a step of the watcher's wall clock.

Alertmanager judges an alert by its own clock: an `endsAt` it reads as in the future keeps
the alert active until then, one in the past resolves it, a `startsAt` that moves is another
interval of the same alert. The watcher's host clock steps (NTP, `date -s`, a resumed VM):
the fleet moves every time it holds by the step (Fleet.shift, so an alert's `since` reads on
the new clock), which the watcher must not hand on as news. Here the alert is raised on the
clock Alertmanager agrees with, then the watcher's clock (`wall`, tests/support/clock.py) is
stepped forward and back by minutes and hours, while it is active and before it clears; the
alert that clears is the fleet's, shifted by the step, at the stepped clock's now, as
Watcher.evaluate_once hands it to the sender. On the real Alertmanager (and its webhook):
one alert with one startsAt, active while active, resolved at once when it clears, its
endsAt never before its startsAt nor ahead of Alertmanager's clock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.contracts.model import Severity
from agent.program.watch.alertmanager import AlertmanagerSender
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

STEPS = [120.0, -120.0, 3600.0, -3600.0, 86400.0]
RESEND = 0.3


@pytest.fixture
def alertmanager(tmp_path: Path, webhook: WebhookReceiver) -> Iterator[AlertmanagerServer]:
    server = hooked_server(tmp_path / "am", webhook)
    yield server
    server.stop()


@pytest.fixture
async def sender(
    alertmanager: AlertmanagerServer, wall: WallClock
) -> AsyncIterator[AlertmanagerSender]:
    """The sender on the stepped clock."""
    instance = await started_sender(alertmanager.url, RESEND)
    yield instance
    await instance.stop()


def held(server: AlertmanagerServer) -> list[dict[str, Any]]:
    return [a for a in server.alerts() if a["labels"].get("node") == "n1"]


def alert_on(since: float) -> Alert:
    return Alert("node_dead", "n1", Severity.CRITICAL, "n1 is dead", "look at it", since=since)


async def raise_then_step(
    sender: AlertmanagerSender, server: AlertmanagerServer, wall: WallClock, step: float
) -> tuple[Alert, float]:
    """The alert raised on the agreed clock, held by Alertmanager; then the step, and the
    fleet's copy of the alert shifted by it. Returns that copy and the startsAt posted."""
    alert = alert_on(time.time() - 30.0)
    sender.change(AlertChange(True, alert, time.time()))
    await until(lambda: len(held(server)) == 1, 10.0, "Alertmanager to hold the alert")
    starts = stamp(held(server)[0]["startsAt"])
    assert abs(starts - alert.since) < 0.01
    wall.offset += step
    return dataclasses.replace(alert, since=alert.since + step), starts


@pytest.mark.parametrize("step", STEPS)
async def test_an_active_alert_stays_one_and_active(
    sender: AlertmanagerSender, alertmanager: AlertmanagerServer, wall: WallClock, step: float
) -> None:
    _, starts = await raise_then_step(sender, alertmanager, wall, step)
    await asyncio.sleep(RESEND * 5)  # re-sent several times on the stepped clock
    [alert] = held(alertmanager)
    assert alert["status"]["state"] == "active"
    assert stamp(alert["startsAt"]) == pytest.approx(starts, abs=0.01)
    assert stamp(alert["endsAt"]) > wall.real()


@pytest.mark.parametrize("step", STEPS)
async def test_the_alert_that_clears_resolves_at_once(
    sender: AlertmanagerSender,
    alertmanager: AlertmanagerServer,
    webhook: WebhookReceiver,
    wall: WallClock,
    step: float,
) -> None:
    shifted, starts = await raise_then_step(sender, alertmanager, wall, step)
    await asyncio.sleep(RESEND * 2)
    cleared_at = wall.real()
    sender.change(AlertChange(False, shifted, time.time()))
    await until(lambda: held(alertmanager) == [], 10.0, "Alertmanager to resolve the alert")
    await until(
        lambda: webhook.matching("resolved", node="n1") != [], 10.0, "the resolved notification"
    )
    alerts = [a for n in webhook.received() for a in n.alerts() if a["labels"]["node"] == "n1"]
    assert [round(stamp(a["startsAt"]) - starts, 2) for a in alerts] == [0.0] * len(alerts), alerts
    [resolved] = [a for a in alerts if a["status"] == "resolved"]
    ends = stamp(resolved["endsAt"])
    assert starts <= ends <= wall.real()
    # When it cleared on Alertmanager's clock: the re-sends after the step told the watcher
    # that clock (the answers' Date), so neither the step forward nor the step back moves it.
    assert ends == pytest.approx(cleared_at, abs=1.5)
