"""The reader aiomqtt adds a loop turn late never lands on a closed or another file's descriptor.

aiomqtt 2.x answers paho's `on_socket_open` by scheduling `loop.add_reader(fd)` with
`call_soon_threadsafe`, from the executor thread that runs paho's connect, as it schedules the
writer (tests/test_mqtt_socket_writes.py: that one was a real race, fixed in
exporters/mqtt_client.py). For the reader the window cannot close the socket: paho closes it
only in `_sock_close`, which runs from its loop_read, loop_write and loop_misc (called by the
reader, the writer and the misc task, all scheduled after the reader from the same thread, so
run after it) or from reconnect and disconnect calls nobody makes in that window; with an
external loop (a register-write handler set) paho's connect sends nothing itself, so no failed
send closes it in the thread. A peer's FIN or RST does not close the descriptor either: the
socket stays open until paho reads the end.

These tests hold the loop between aiomqtt's scheduling of `add_reader` and its running (a
callback queued before it blocks the loop) while the peer ends the connection, the worst order
there is, and check what each `add_reader` found when it ran: paho's own socket, open; no
exception in the loop's handler; no reader left afterwards, and none on the number the socket
had once another file takes it.

A connect cancelled while paho's connect runs in its thread is another matter (the test at the
end): the thread carries on, the socket opens and gets its reader (on an open socket, so not
this race); exporters/mqtt_client.py (`_SocketHooks`) then ends it before the CONNECT goes
out. tests/test_mqtt_connect_abandoned.py gives connects up at every point, against a broker.
"""

from __future__ import annotations

import asyncio
import os
import select
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiomqtt
import pytest

from exporters.mqtt_client import Credentials, connection, new_client
from exporters.mqtt_settings import BrokerSettings
from tests.support.waiting import until


@dataclass
class Readers:
    """Each add_reader the loop ran: (fd, whether it was paho's socket, whether it was open)."""

    added: list[tuple[int, bool, bool]] = field(default_factory=list)


def _listener() -> socket.socket:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)
    return listener


def _record_readers(loop: asyncio.AbstractEventLoop, paho: Any, readers: Readers) -> None:
    add_reader = loop.add_reader

    def recording(fd: Any, callback: Callable[..., object], *args: Any) -> None:
        sock = paho.socket()
        ours = sock is not None and sock.fileno() == fd
        try:
            os.fstat(fd)
            is_open = True
        except OSError:
            is_open = False
        readers.added.append((fd, ours, is_open))
        add_reader(fd, callback, *args)

    loop.add_reader = recording  # type: ignore[method-assign,assignment]


def _end_in_the_window(
    loop: asyncio.AbstractEventLoop, paho: Any, listener: socket.socket, reset: bool
) -> None:
    """Wrap aiomqtt's on_socket_open: block the loop before aiomqtt schedules add_reader, then
    let the peer end the connection and wait until the end has reached paho's socket."""
    aiomqtt_open = paho.on_socket_open
    started, release = threading.Event(), threading.Event()

    def hold() -> None:  # on the loop: nothing else runs until released
        started.set()
        release.wait(10)

    def on_open(client: Any, userdata: Any, sock: Any) -> None:  # paho's connect thread
        loop.call_soon_threadsafe(hold)
        assert started.wait(10)
        try:
            aiomqtt_open(client, userdata, sock)  # add_reader is now queued behind hold()
            peer, _ = listener.accept()
            if reset:
                peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            peer.close()
            readable, _, _ = select.select([sock], [], [], 10)
            assert readable, "the peer's end never reached the socket"
        finally:
            release.set()

    paho.on_socket_open = on_open


@pytest.mark.parametrize("reset", [False, True], ids=["peer closes", "peer resets"])
async def test_a_connection_ended_before_the_reader_is_added_leaves_no_stray_reader(
    reset: bool,
) -> None:
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    listener = _listener()
    port = listener.getsockname()[1]
    # aiomqtt reports a connection lost before CONNACK only at its connect timeout.
    settings = BrokerSettings(url=f"mqtt://127.0.0.1:{port}", connect_timeout=0.5)
    client = new_client(settings, Credentials(None, None), default_identifier="t", will=None)
    paho = client._client
    readers = Readers()
    _record_readers(loop, paho, readers)
    _end_in_the_window(loop, paho, listener, reset)
    others: list[socket.socket] = []
    try:
        with pytest.raises(aiomqtt.MqttError):
            async with connection(client):
                pass
        assert readers.added, "aiomqtt added no reader"
        assert all(ours and is_open for _, ours, is_open in readers.added), readers.added
        await until(lambda: paho.socket() is None, what="paho reads the end, closes its socket")
        (fd, _, _) = readers.added[0]
        # Another file on the socket's old number (as the next one opened takes it, where it is
        # the lowest free): no reader on it, and what arrives there stays for its owner.
        with pytest.raises(OSError, match="Bad file descriptor"):
            os.fstat(fd)  # closed, and not yet taken
        pair = socket.socketpair()
        others = list(pair)
        if fd not in (s.fileno() for s in pair):
            os.dup2(pair[0].fileno(), fd)
            others.append(socket.socket(fileno=fd))
        theirs = next(s for s in others if s.fileno() == fd)
        sender = pair[0] if theirs is pair[1] else pair[1]
        sender.send(b"theirs")
        for _ in range(5):
            await asyncio.sleep(0)
        assert theirs.recv(16) == b"theirs"
        assert not loop.remove_reader(fd)
        assert errors == []
    finally:
        for s in (listener, *others):
            s.close()


async def test_paho_sends_nothing_in_the_connect_thread_with_an_external_loop() -> None:
    """The premise above: a socket paho's connect could close itself (a send that fails on a
    reset connection) would be closed in the window. With the register-write handler set,
    paho queues the CONNECT and asks for a writer instead of writing."""
    listener = _listener()
    settings = BrokerSettings(url=f"mqtt://127.0.0.1:{listener.getsockname()[1]}")
    client = new_client(settings, Credentials(None, None), default_identifier="t", will=None)
    paho = client._client
    asked: list[int] = []
    # No reader and no writer: nothing but paho's connect itself could send.
    paho.on_socket_open = lambda _c, _u, _s: None
    paho.on_socket_register_write = lambda _c, _u, _s: asked.append(1)
    try:
        await asyncio.get_running_loop().run_in_executor(
            None, paho.connect, "127.0.0.1", listener.getsockname()[1]
        )
        peer, _ = listener.accept()
        peer.settimeout(0)
        with pytest.raises(BlockingIOError):
            peer.recv(64)  # nothing was sent from the connect thread
        assert asked == [1]
        peer.close()
    finally:
        sock = paho.socket()
        if sock is not None:
            sock.close()
        listener.close()


async def test_a_connect_cancelled_before_the_socket_opens_leaves_no_connection() -> None:
    """The cancelled connect of a stop or a reload: paho's connect is held in its thread (at
    on_pre_connect, before the socket exists) until the awaiting task has been cancelled."""
    listener = _listener()
    port = listener.getsockname()[1]
    settings = BrokerSettings(url=f"mqtt://127.0.0.1:{port}", connect_timeout=0.5)
    client = new_client(settings, Credentials(None, None), default_identifier="t", will=None)
    paho = client._client
    entered, go = threading.Event(), threading.Event()

    def pre_connect(_client: Any, _userdata: Any) -> None:
        entered.set()
        go.wait(10)

    paho.on_pre_connect = pre_connect

    async def attempt() -> None:
        async with connection(client):
            pass

    task = asyncio.create_task(attempt())
    peer: socket.socket | None = None
    try:
        await until(entered.is_set, what="paho's connect reaches its thread")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        go.set()
        peer, _ = listener.accept()
        connected = peer

        # Readable: the CONNECT came, or the end of an abandoned connection.
        await until(lambda: bool(select.select([connected], [], [], 0)[0]), what="the peer hears")
        assert peer.recv(64) == b"", "the CONNECT went out on a connection nobody owns"
        await until(lambda: paho.socket() is None, timeout=5, what="paho closes the socket")
    finally:
        go.set()
        sock = paho.socket()
        if sock is not None:
            asyncio.get_running_loop().remove_reader(sock.fileno())
            asyncio.get_running_loop().remove_writer(sock.fileno())
            sock.close()
        for s in (listener, *([peer] if peer else [])):
            s.close()
