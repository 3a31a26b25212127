"""systemd integration: sd_notify (READY, WATCHDOG, STATUS, STOPPING) and the task supervisor.

`WATCHDOG=1` goes out only while the event loop runs (the pinger is a task on it) and every
supervised task has made progress within its allowance. A hung driver call does not stop the
pings: the collector's loop keeps turning and reports the hang as an event. A loop that is
blocked, or a task that stopped turning, does.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable

import structlog

log = structlog.get_logger(component="systemd")


class Notifier:
    """Sends sd_notify datagrams to $NOTIFY_SOCKET; does nothing when it is not set."""

    def __init__(self, address: str | None = None) -> None:
        address = os.environ.get("NOTIFY_SOCKET") if address is None else address
        self._address: str | bytes | None = None
        self._sock: socket.socket | None = None
        self._failing = False
        if address:
            # A leading '@' names a socket in the abstract namespace.
            self._address = b"\0" + address[1:].encode() if address.startswith("@") else address
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            # Never block the event loop on a full receive queue (a busy or stuck systemd):
            # a dropped WATCHDOG=1 costs less than a frozen agent.
            self._sock.setblocking(False)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, *fields: str) -> bool:
        if self._sock is None or self._address is None:
            return False
        message = "\n".join(fields).encode()
        try:
            self._sock.sendto(message, self._address)
        except OSError as exc:
            if not self._failing:  # once per failure spell, not once per ping
                log.warning("sd_notify failed", error=str(exc))
            self._failing = True
            return False
        self._failing = False
        return True

    def ready(self, status: str) -> bool:
        return self.send("READY=1", f"STATUS={status}")

    def status(self, status: str) -> bool:
        return self.send(f"STATUS={status}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def stopping(self) -> bool:
        return self.send("STOPPING=1", "STATUS=stopping")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def watchdog_interval(environ: dict[str, str] | None = None) -> float | None:
    """Half of $WATCHDOG_USEC in seconds, if the watchdog is on for this process."""
    env = os.environ if environ is None else environ
    usec = env.get("WATCHDOG_USEC", "")
    pid = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and pid.isdigit() and int(pid) != os.getpid():
        return None
    return int(usec) / 2 / 1_000_000


class Supervisor:
    """Tracks the progress of supervised tasks. `None` allowance: tracked, never stalls."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._allowance: dict[str, float | None] = {}
        self._last_beat: dict[str, float] = {}

    def register(self, name: str, allowance: float | None) -> None:
        self._allowance[name] = allowance
        self._last_beat[name] = self._clock()

    def unregister(self, name: str) -> None:
        self._allowance.pop(name, None)
        self._last_beat.pop(name, None)

    def beat(self, name: str) -> None:
        if name in self._allowance:
            self._last_beat[name] = self._clock()

    def stalled(self) -> list[str]:
        now = self._clock()
        return sorted(
            name
            for name, allowance in self._allowance.items()
            if allowance is not None and now - self._last_beat[name] > allowance
        )


async def run_watchdog(
    notifier: Notifier,
    supervisor: Supervisor,
    interval: float,
    status: Callable[[], str],
) -> None:
    """Ping the systemd watchdog while all is well; keep STATUS= current either way."""
    reported: list[str] = []
    while True:
        stalled = supervisor.stalled()
        if not stalled:
            notifier.watchdog()
        elif stalled != reported:
            log.error("supervised tasks stalled; withholding the watchdog ping", tasks=stalled)
        reported = stalled
        notifier.status(status() if not stalled else "stalled: " + ", ".join(stalled))
        await asyncio.sleep(interval)
