"""SIGHUP for `gpuwarden run`, from the first line of the command to the exit.

SIGHUP's default action ends the process. The event loop that turns a SIGHUP into a reload
exists only once the daemon's modules are imported, its configuration read and its state store
opened (a second or more, longer on a busy host or a slow disk), and a handler the loop
installed is put back to the default when the loop closes. A SIGHUP in either gap (`kill -HUP`
from a script or a configuration tool right after a restart, or during a stop) ended the agent
without a word. So one handler is installed before anything else: before the loop it notes the
SIGHUP, which is then a reload as soon as the loop runs (the file may have changed after it was
read); while the loop runs it hands each SIGHUP to it; after, it is ignored (the process is on
its way out), and the interpreter's exit is never given the default back in between.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # every command imports this module (agent/program/cli.py): keep it light
    import asyncio


class Hangups:
    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._callback: Callable[[], None] | None = None
        self.missed = False
        """A SIGHUP came while no loop took them."""

    def install(self) -> None:
        """From now on a SIGHUP no longer ends the process (main thread only)."""
        signal.signal(signal.SIGHUP, self._received)

    def attach(self, loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
        """Hand every SIGHUP from now to `callback` on `loop`, and one noted before, if any."""
        self._loop, self._callback = loop, callback
        if self.missed:
            self.missed = False
            loop.call_soon(callback)

    def ignore(self) -> None:
        """From now to the exit a SIGHUP is ignored (SIG_IGN, which the interpreter's exit
        keeps, whereas it gives a Python handler's signal the default back)."""
        self._loop = self._callback = None
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    def _received(self, signum: int, frame: FrameType | None) -> None:
        loop, callback = self._loop, self._callback
        if loop is None or callback is None:
            self.missed = True
            return
        try:
            loop.call_soon_threadsafe(callback)
        except RuntimeError:  # the loop closed meanwhile: nothing is left to reload
            self.missed = True


HANGUPS = Hangups()
"""The process's one handler (`gpuwarden run` installs it first thing: agent/program/cli.py)."""
