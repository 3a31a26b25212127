"""A connect abandoned part-way (cancelled by a stop, or past its connect timeout) leaves no
connection behind, at whatever point it was given up, against a real mosquitto.

aiomqtt 2.5 runs paho's connect in an executor thread that a cancel does not stop, and on a
cancel or a timeout while it waits for the CONNACK it leaves the socket open with its reader and
its keepalive task: a connection nobody owns, logged in with our client id and our Will. Given
up before the CONNECT went out, it must never send it (sent late it would take over the session
that replaced it: the broker ends that one and may publish its Will, with the current birth
number); given up after, it must end with a DISCONNECT (a bare close would make the broker
publish the abandoned connection's Will).

Each case gives up one attempt, then checks with the broker what is left: the attempt's socket
closed here and its end closed at the broker (/proc/net/tcp), the session with the same client
id that comes next still connected, and no Will of either published before a marker that the
next session publishes last on the same topic.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiomqtt
import pytest

from exporters.mqtt_client import Credentials, connection, new_client
from exporters.mqtt_settings import BrokerSettings
from tests.support.mosquitto import Broker
from tests.support.mqtt import Subscriber
from tests.support.waiting import until

CLIENT_ID = "gpuwarden-abandoned"
TOPIC = "t/status"
OPEN_STATES = {"01", "08"}  # ESTABLISHED, CLOSE_WAIT (/proc/net/tcp, include/net/tcp_states.h)


@dataclass(frozen=True)
class TcpEnd:
    local_port: int
    remote_port: int
    state: str
    received_bytes: int
    inode: int


def tcp_ends() -> list[TcpEnd]:
    """IPv4 TCP sockets of this host (every test here is on 127.0.0.1)."""
    ends = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        queues = fields[4].split(":")
        ends.append(
            TcpEnd(
                int(fields[1].split(":")[1], 16),
                int(fields[2].split(":")[1], 16),
                fields[3],
                int(queues[1], 16),
                int(fields[9]),
            )
        )
    return ends


def broker_holds(broker_port: int, client_ports: list[int]) -> bool:
    """Whether the broker still has its end of a connection from one of `client_ports` open."""
    return any(
        end.local_port == broker_port
        and end.remote_port in client_ports
        and end.state in OPEN_STATES
        for end in tcp_ends()
    )


def queued_at_broker(broker_port: int, client_ports: list[int]) -> bool:
    """Bytes from one of `client_ports` wait unread in the broker's socket (it is stopped)."""
    return any(
        end.local_port == broker_port and end.remote_port in client_ports and end.received_bytes
        for end in tcp_ends()
    )


@dataclass
class Attempt:
    """One connect to be given up: its client, the local ports of the sockets it opened and,
    where the case holds it, the gate its connect thread waits at."""

    client: aiomqtt.Client
    ports: list[int] = field(default_factory=list)
    entered: threading.Event = field(default_factory=threading.Event)
    go: threading.Event = field(default_factory=threading.Event)
    task: asyncio.Task[None] | None = None


def new_attempt(broker: Broker, will: bytes, connect_timeout: float = 10.0) -> Attempt:
    settings = BrokerSettings(url=broker.url, connect_timeout=connect_timeout, keepalive=5)
    client = new_client(
        settings,
        Credentials(None, None),
        default_identifier=CLIENT_ID,
        will=aiomqtt.Will(TOPIC, will, qos=1),
    )
    attempt = Attempt(client)
    paho = client._client
    opened = paho.on_socket_open

    def on_open(c: Any, userdata: Any, sock: Any) -> None:  # paho's connect thread
        attempt.ports.append(sock.getsockname()[1])
        if opened is not None:
            opened(c, userdata, sock)

    paho.on_socket_open = on_open
    return attempt


def hold_before_socket(attempt: Attempt) -> None:
    def pre_connect(_client: Any, _userdata: Any) -> None:
        attempt.entered.set()
        attempt.go.wait(10)

    attempt.client._client.on_pre_connect = pre_connect


def hold_after_connect(attempt: Attempt) -> None:
    """After paho's connect has returned in its thread (the socket open, the CONNECT queued),
    before aiomqtt hears of it. (Not inside a paho callback: paho holds its callback lock
    there, which the loop's reader needs too.)"""
    client = attempt.client
    connect = client._client_connect

    def connect_then_hold() -> None:
        connect()
        attempt.entered.set()
        attempt.go.wait(10)

    client._client_connect = connect_then_hold  # type: ignore[method-assign]


async def connect_only(client: aiomqtt.Client) -> None:
    async with connection(client):
        pass


@contextlib.contextmanager
def stopped(broker: Broker) -> Any:
    """The broker frozen (SIGSTOP): the kernel still accepts connections and queues their bytes."""
    assert broker.process is not None
    os.kill(broker.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(broker.process.pid, signal.SIGCONT)


@contextlib.asynccontextmanager
async def next_session(broker: Broker) -> AsyncIterator[tuple[aiomqtt.Client, asyncio.Task[None]]]:
    client = new_attempt(broker, b"next session's Will").client
    async with connection(client) as lost:
        yield client, lost


def close_leftover(attempt: Attempt) -> None:
    """The unfixed code's orphan, closed so that it does not outlive the test."""
    attempt.go.set()
    sock = attempt.client._client.socket()
    if sock is not None and sock.fileno() >= 0:
        loop = asyncio.get_running_loop()
        loop.remove_reader(sock.fileno())
        loop.remove_writer(sock.fileno())
        sock.close()


async def give_up_in_thread(attempt: Attempt) -> None:
    attempt.task = asyncio.create_task(connect_only(attempt.client))
    await until(attempt.entered.is_set, what="paho's connect reaches the held point")
    attempt.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await attempt.task


async def give_up_awaiting_connack(broker: Broker, attempt: Attempt, cancel: bool) -> None:
    attempt.task = asyncio.create_task(connect_only(attempt.client))
    await until(
        lambda: queued_at_broker(broker.port, attempt.ports), what="the CONNECT at the broker"
    )
    if cancel:
        attempt.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await attempt.task
    else:
        with pytest.raises(aiomqtt.MqttError, match="timed out"):
            await attempt.task


async def check_nothing_left(
    broker: Broker, sub: Subscriber, attempt: Attempt, next_client: aiomqtt.Client
) -> None:
    await until(
        lambda: attempt.client._client.socket() is None,
        timeout=10,
        what="the abandoned attempt's socket closed",
    )
    await until(
        lambda: not broker_holds(broker.port, attempt.ports),
        timeout=10,
        what="the broker's end of the abandoned connection closed",
    )
    await next_client.publish(TOPIC, b"marker", qos=1)
    await until(lambda: bool(sub.on(TOPIC) and sub.on(TOPIC)[-1].payload == b"marker"))
    assert [m.payload for m in sub.on(TOPIC)] == [b"marker"], "a Will was published"


@pytest.fixture
def subscriber(broker: Broker) -> Any:
    sub = Subscriber(broker.port, topic_filter="t/#").start()
    yield sub
    sub.stop()


@pytest.fixture
async def loop_errors() -> Any:
    errors: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    yield errors
    loop.set_exception_handler(None)


@pytest.mark.parametrize(
    "hold", [hold_before_socket, hold_after_connect], ids=["before the socket", "after connect"]
)
async def test_a_connect_cancelled_in_its_thread_never_logs_in(
    broker: Broker,
    subscriber: Subscriber,
    loop_errors: list[dict[str, Any]],
    hold: Callable[[Attempt], None],
) -> None:
    """Cancelled while paho's connect runs in its thread; the next session connects before
    the thread goes on (a stop's or a retry's next connection), then the thread is let go."""
    attempt = new_attempt(broker, b"abandoned attempt's Will")
    hold(attempt)
    try:
        await give_up_in_thread(attempt)
        async with next_session(broker) as (client, lost):
            attempt.go.set()
            await check_nothing_left(broker, subscriber, attempt, client)
            assert not lost.done(), "the next session was taken over"
    finally:
        close_leftover(attempt)
    assert loop_errors == []


@pytest.mark.parametrize("cancel", [True, False], ids=["cancelled", "connect timeout"])
async def test_a_connect_given_up_awaiting_its_connack_ends_without_a_will(
    broker: Broker, subscriber: Subscriber, loop_errors: list[dict[str, Any]], cancel: bool
) -> None:
    """The CONNECT is at a frozen broker when the attempt is given up; the broker then reads
    it, and whatever the attempt sent after it."""
    timeout = 10.0 if cancel else 0.5
    attempt = new_attempt(broker, b"abandoned attempt's Will", connect_timeout=timeout)
    try:
        with stopped(broker):
            await give_up_awaiting_connack(broker, attempt, cancel)
        await until(
            lambda: not broker_holds(broker.port, attempt.ports),
            timeout=10,
            what="the broker's end of the abandoned connection closed",
        )
        async with next_session(broker) as (client, lost):
            await check_nothing_left(broker, subscriber, attempt, client)
            assert not lost.done(), "the next session was taken over"
    finally:
        close_leftover(attempt)
    assert loop_errors == []
