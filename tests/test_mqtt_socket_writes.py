"""A write paho asks for on a socket that closes before the loop's next turn registers nothing.

paho asks for a writer (`on_socket_register_write`) when it has bytes to send; aiomqtt 2.x
answers by scheduling `loop.add_writer(fd)` for the loop's next turn. When the connection is
lost in between (the broker stopped: paho closes the socket on the EOF it reads), the scheduled
call finds the descriptor closed, and the loop logs "Exception in callback ... add_writer ...
OSError: [Errno 9] Bad file descriptor" with its traceback; had the number been taken again by
another file meanwhile (the next connection's socket), the writer would sit on that file,
calling paho's loop_write whenever it is writable (always), never removed. The fault harness
found the traceback in the agent's log (tests/test_chaos.py, seed 60 of 40 steps: the broker
stopped while events were being published). paho's own sequence is driven here: its socket
set as on connect, a write asked for, the socket closed as a lost connection closes it.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from exporters.mqtt_client import Credentials, new_client
from exporters.mqtt_settings import BrokerSettings


def _paho(writes: list[int]) -> Any:
    """The paho client of the agent's aiomqtt client; its loop_write calls counted."""
    settings = BrokerSettings(url="mqtt://127.0.0.1:1")
    paho = new_client(settings, Credentials(None, None), default_identifier="t", will=None)._client
    write = paho.loop_write

    def counted() -> Any:
        writes.append(1)
        return write()

    paho.loop_write = counted  # type: ignore[method-assign]
    return paho


@pytest.mark.parametrize("reused", [False, True], ids=["closed", "number taken again"])
async def test_a_write_for_a_socket_closed_before_the_loop_turn_is_dropped(reused: bool) -> None:
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    writes: list[int] = []
    paho = _paho(writes)
    ours, theirs = socket.socketpair()
    fd = ours.fileno()
    paho._sock = ours  # as paho's connect leaves it
    paho._call_socket_register_write()  # bytes to send
    paho._sock_close()  # the connection lost before the loop's next turn
    others: list[socket.socket] = []
    if reused:  # the next file opened takes the lowest free number: this one
        others = list(socket.socketpair())
        assert fd in (s.fileno() for s in others)
    try:
        for _ in range(5):
            await asyncio.sleep(0)
        assert errors == []
        assert writes == [], "a writer on a closed (or another) file"
        assert not loop.remove_writer(fd)
    finally:
        for s in (theirs, *others):
            s.close()


async def test_a_write_for_the_open_socket_is_registered() -> None:
    writes: list[int] = []
    paho = _paho(writes)
    ours, theirs = socket.socketpair()
    try:
        paho._sock = ours
        paho._call_socket_register_write()
        for _ in range(5):
            await asyncio.sleep(0)
        assert writes, "the writer never ran"
    finally:
        paho._sock = None
        ours.close()
        theirs.close()
