"""The MQTT connection stack of the agent's sink and of the watcher: one way to log in, connect,
publish with PUBACK confirmation, notice a lost connection, name a failure and wait before the
next attempt.

Both speak MQTT v5. Under v5 a broker refuses a publish it may not accept (mosquitto 2: an ACL
denial) with a PUBACK whose reason code is 0x87 "Not authorized"; under 3.1.1 it acknowledges
the publish and drops it without a word.

Why `Publisher` is an adapter, and what it relies on. aiomqtt 2.5's `Client.publish(qos=1)`
does wait for the PUBACK (its paho `on_publish` handler sets an Event per message id), but it
drops the reason code and returns neither the code nor the message id; paho's `MQTTMessageInfo`
holds no reason code either. The code reaches only paho's `on_publish` callback. So Publisher
takes the paho client of an aiomqtt.Client through `Client._client` (the one private name used
here: aiomqtt has no public accessor), puts its own handler in front of aiomqtt's through
paho's public `on_publish` property (aiomqtt's handler still runs, so `Client.publish()` keeps
working), and publishes through paho's public `publish()`, which returns the message id.
tests/test_mqtt_connection.py (TestPubackAdapter) pins that behaviour of aiomqtt against a real
mosquitto: when aiomqtt starts reporting refusals itself, that test fails and this can go.

A lost connection is seen through aiomqtt's public API: its message iterator raises MqttError
when the connection ends (`connection()`).

The writer for the socket is registered by our handler of paho's public
`on_socket_register_write`, in place of aiomqtt's, which adds it a loop turn late, when the
socket may have closed (`_SocketHooks`). aiomqtt's reader, scheduled the same way from
paho's connect thread, needs no such handler: nothing can close the socket before it is added
(tests/test_mqtt_socket_reads.py says why and holds the loop in that window to show it). Our
handler of paho's public `on_socket_open` runs aiomqtt's, then ends the connection of a
connect given up before `async with client` returned (`_SocketHooks`, `connection`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NoReturn, cast

import aiomqtt
import paho.mqtt.client as paho
import tenacity
from aiomqtt.exceptions import MqttConnectError
from paho.mqtt.client import CallbackOnConnect_v2, CallbackOnPublish_v2
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from agent.contracts.config import read_secret
from agent.contracts.errors import ConfigError
from agent.contracts.settings import check_files
from exporters.mqtt_settings import BrokerSettings

# MQTT v5 reason codes (OASIS MQTT 5.0, section 2.4) and the v3.1.1 CONNACK return codes that
# paho maps onto them.
BAD_CREDENTIALS = {0x86, 0x8C}  # bad user name or password, bad authentication method
NOT_AUTHORIZED = {0x87}

FAILURE_TEXT = {
    "refused": "the broker refused the connection",
    "bad_credentials": "the broker rejected the user name or password",
    "not_authorized": "the broker did not authorise this client (mosquitto 2 says so for a "
    "wrong user name or password too)",
    "tls_failed": "the TLS handshake with the broker failed",
    "unreachable": "cannot reach the broker",
    "connection_lost": "the connection to the broker was lost",
    "publish_refused": "the broker refused a publish",
}


class PacketTooLarge(aiomqtt.MqttError):
    """A publish larger than the broker's Maximum Packet Size (its CONNACK says it), refused
    here before it is sent: a broker ends the connection of a client that sends one (mosquitto
    2: "disconnected due to oversize packet"), so sending it would cost the connection and,
    at the head of an outbox, every connection after it."""

    def __init__(self, topic: str, size: int, limit: int) -> None:
        self.topic = topic
        self.size = size
        self.limit = limit
        super().__init__(
            f"a publish to {topic} of {size} bytes exceeds the broker's maximum packet size "
            f"({limit} bytes)"
        )


def _varint_size(value: int) -> int:
    """Bytes of MQTT's variable byte integer (OASIS MQTT 5.0, 1.5.5) for `value`."""
    size = 1
    while value >= 128:
        value //= 128
        size += 1
    return size


def publish_size(topic: str, payload_size: int, qos: int) -> int:
    """Bytes of an MQTT v5 PUBLISH packet without properties (OASIS MQTT 5.0, 3.3), as a
    broker counts it against its Maximum Packet Size: the fixed header, the topic as a UTF-8
    string, the packet identifier (QoS 1 and 2), the properties' length (0: one byte) and the
    payload."""
    remaining = 2 + len(topic.encode()) + (2 if qos else 0) + 1 + payload_size
    return 1 + _varint_size(remaining) + remaining


def payload_room(topic: str, qos: int, limit: int) -> int:
    """The largest payload a PUBLISH to `topic` may carry under a `limit` (negative: none)."""
    header = 2 + len(topic.encode()) + (2 if qos else 0) + 1
    best = -1
    for varint in range(1, 5):
        payload = limit - 1 - varint - header
        if payload >= 0 and _varint_size(header + payload) <= varint:
            best = max(best, payload)
    return best


class PublishRefused(aiomqtt.MqttError):
    """The broker answered a QoS 1 publish with a failure reason code (v5 PUBACK)."""

    def __init__(self, topic: str, reason: ReasonCode) -> None:
        self.topic = topic
        self.reason = reason
        super().__init__(f"broker refused publish to {topic}: {reason} (0x{reason.value:02x})")


# -- logging in and connecting -----------------------------------------------------------------


@dataclass(frozen=True)
class Credentials:
    """What the broker settings name, read from disk once at start."""

    password: str | None
    tls: ssl.SSLContext | None


def load_credentials(settings: BrokerSettings, section: str) -> Credentials:
    """Read the password and load the TLS files now: a mistake there stops the program with
    the key named, instead of a retry loop that can never succeed. Raises ConfigError."""
    # The loader's checks again, with its messages: the files may have changed since it ran,
    # and a sink or watcher can be built without it.
    check_files(settings, section)
    password = None
    if settings.password_file is not None:
        password = read_secret(settings.password_file, f"{section}.password_file")
    if settings.key_file is not None:
        read_secret(settings.key_file, f"{section}.key_file")  # refuses a key others can read
    if not settings.address.tls:
        return Credentials(password, None)
    try:
        context = tls_context(
            None if settings.ca_file is None else str(settings.ca_file),
            None if settings.cert_file is None else str(settings.cert_file),
            None if settings.key_file is None else str(settings.key_file),
        )
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"{section}.ca_file", f"cannot load the TLS files (ca_file, cert_file, key_file): {exc}"
        ) from None
    return Credentials(password, context)


def tls_context(ca_file: str | None, cert_file: str | None, key_file: str | None) -> ssl.SSLContext:
    """Verify the broker's certificate and host name, always; optionally present our own."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    context.check_hostname = True
    context.verify_mode = ssl.CERT_REQUIRED
    if cert_file is not None:
        context.load_cert_chain(cert_file, key_file)
    return context


def new_client(
    settings: BrokerSettings,
    credentials: Credentials,
    *,
    default_identifier: str,
    will: aiomqtt.Will | None,
    queue_type: type[asyncio.Queue[aiomqtt.Message]] | None = None,
    max_inflight: int | None = None,
) -> aiomqtt.Client:
    """An aiomqtt client for one connection: v5, the explicit keepalive, TLS that checks the
    host name, `client_id` or the caller's default."""
    address = settings.address
    client = aiomqtt.Client(
        address.host,
        address.port,
        username=settings.username or None,
        password=credentials.password,
        identifier=settings.client_id or default_identifier,
        protocol=aiomqtt.ProtocolVersion.V5,
        will=will,
        keepalive=settings.keepalive,
        timeout=settings.connect_timeout,
        tls_context=credentials.tls,
        queue_type=queue_type,
        max_inflight_messages=max_inflight,
    )
    hooks = _SocketHooks(client._client, asyncio.get_running_loop())
    _hooks[client] = hooks
    return client


_hooks: weakref.WeakKeyDictionary[aiomqtt.Client, _SocketHooks] = weakref.WeakKeyDictionary()
"""The hooks of each client `new_client` made, for `connection` to give up its connect."""


class _SocketHooks:
    """What we add to paho's socket callbacks of one client: the writer registered at once
    (`register_write`), and a connect given up before `async with client` returned
    (`abandon`) ended however far it got.

    The writer. paho asks for one when it has bytes to send; aiomqtt 2.x schedules
    `add_writer(fd)` for the loop's next turn, and a connection lost in between (paho closes
    the socket on the broker's EOF, on the loop too) leaves it a closed descriptor (the loop
    logs EBADF with a traceback) or, its number taken again by the next file opened, a writer
    on that file that calls loop_write whenever it is writable, never removed
    (tests/test_mqtt_socket_writes.py). Here the writer is added at once on the loop's
    thread, and from paho's connect in an executor thread on the next turn only if the socket
    is still the connection's and open. paho handles a failed write itself (its loop_write
    closes the socket on an OSError and reports the disconnect, which aiomqtt hears).

    The abandoned connect. aiomqtt runs paho's connect in an executor thread that a cancel
    does not stop, and on a cancel or a timeout while it awaits the CONNACK it leaves the
    socket open with its reader and keepalive task: a connection nobody owns, logged in with
    our client id and our Will (tests/test_mqtt_connect_abandoned.py). So the socket is ended
    on the loop once it is open and the connect given up, whichever comes last; `opened` is
    queued from the connect thread behind aiomqtt's `add_reader`, so the end never comes
    before the reader. Nothing written yet (the CONNECT goes out only through the writer: with
    a register-write handler paho's connect sends nothing itself): the socket is shut down
    and nothing more is written, so the broker never sees the CONNECT (sent late, it would take
    over the session that replaced this one); paho reads the end and closes the socket, its
    reader, writer and keepalive task with it. Something written: a DISCONNECT follows it at
    once (a stop may end the process before the writer's next turn), so the broker ends the
    session without its Will (a bare close would publish it), and paho closes the socket once
    it is sent. Nothing is published, and nothing waits: a stop stays in its budget. aiomqtt
    hears nothing of that end (`_on_disconnect`).
    """

    def __init__(self, paho_client: paho.Client, loop: asyncio.AbstractEventLoop) -> None:
        self._paho = paho_client
        self._loop = loop
        self._abandoned = False
        self._wrote = False
        self._sock: Any = None
        """The connection's socket, once its reader is in place."""
        self._aiomqtt_open = paho_client.on_socket_open
        paho_client.on_socket_open = self._on_socket_open
        self._aiomqtt_disconnect = paho_client.on_disconnect
        paho_client.on_disconnect = self._on_disconnect
        paho_client.on_socket_register_write = self._register_write

    def abandon(self) -> None:
        """The connect was given up (on the loop): end its connection, now or once open."""
        self._abandoned = True
        if self._sock is not None:
            self._end()

    def _on_socket_open(self, client: paho.Client, userdata: Any, sock: Any) -> None:
        if self._aiomqtt_open is not None:
            self._aiomqtt_open(client, userdata, sock)  # queues add_reader
        self._loop.call_soon_threadsafe(self._opened, sock)  # behind it

    def _on_disconnect(self, *args: Any) -> None:
        # Nobody awaits aiomqtt's futures of a connect given up, and a cancel there has
        # cancelled its `_connected`, on which aiomqtt's handler raises CancelledError (out of
        # paho's loop_read or loop_write, before paho closes the socket).
        if not self._abandoned and self._aiomqtt_disconnect is not None:
            self._aiomqtt_disconnect(*args)

    def _opened(self, sock: Any) -> None:
        self._sock = sock
        if self._abandoned:
            self._end()

    def _end(self) -> None:
        sock: Any = self._sock
        if sock is None or sock.fileno() < 0 or self._paho.socket() is not sock:
            return  # paho has closed it already
        if not self._wrote:
            if isinstance(sock, socket.socket):  # an ssl.SSLSocket too; no websockets here
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            return
        if self._paho.disconnect() == paho.MQTT_ERR_SUCCESS:
            self._paho.loop_write()

    def _write(self) -> None:
        self._wrote = True
        self._paho.loop_write()

    def _register_write(self, client: paho.Client, _userdata: Any, sock: Any) -> None:
        fd = sock.fileno()

        def add() -> None:
            if self._abandoned and not self._wrote:
                return  # never start writing on a connection given up
            if fd >= 0 and sock.fileno() == fd and client.socket() is sock:
                self._loop.add_writer(fd, self._write)

        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            add()
        else:
            self._loop.call_soon_threadsafe(add)


@contextlib.asynccontextmanager
async def connection(client: aiomqtt.Client) -> AsyncIterator[asyncio.Task[None]]:
    """Connect; yield a task that ends, raising MqttError, when the connection is lost.

    The task reads `client.messages`, aiomqtt's public view of the connection: the caller
    handles messages through `queue_type` (the watcher) or subscribes to nothing (the sink).
    A connect that fails, times out or is cancelled leaves no connection behind
    (`_SocketHooks`, for a client from `new_client`).
    """
    lost: asyncio.Task[None] | None = None
    entered = False
    try:
        async with client:
            entered = True
            lost = asyncio.create_task(_until_lost(client), name="mqtt:until-lost")
            yield lost
    except BaseException:
        hooks = _hooks.get(client)
        if not entered and hooks is not None:
            hooks.abandon()
        raise
    finally:
        if lost is not None:
            await _settle(lost)


async def _until_lost(client: aiomqtt.Client) -> None:
    async for _ in client.messages:
        pass


async def _settle(lost: asyncio.Task[None]) -> None:
    """Once `async with client` has left, aiomqtt has marked the connection over and `lost`
    ends within a few loop turns. Reading its outcome also reads aiomqtt's disconnection
    reason, which asyncio would otherwise log as 'Future exception was never retrieved'."""
    try:
        if not lost.done():
            await asyncio.wait({lost}, timeout=1.0)
    finally:
        if not lost.done():
            lost.cancel()
        elif not lost.cancelled():
            lost.exception()


# -- publishing with PUBACK reason codes (see the module's docstring) --------------------------


class Publisher:
    """Publishes through one aiomqtt.Client and reads each PUBACK's reason code.

    `publish_acked()` awaits one message (a status); `publish_tracked()` sends without waiting
    and reports `(token, error or None)` in `completed` when the broker answers, calling
    `on_progress`: the outbox drain keeps a window of these in flight without a task or a
    timer per message.
    """

    def __init__(self, client: aiomqtt.Client) -> None:
        self._paho: paho.Client = client._client  # the one private name: module docstring
        self._answers: dict[int, Callable[[ReasonCode], None]] = {}
        self.completed: list[tuple[int, PublishRefused | None]] = []
        self.on_progress: Callable[[], None] = lambda: None
        # aiomqtt creates its paho client with callback API version 2, whose on_publish takes
        # the reason code and the properties too.
        aiomqtt_handler = cast("CallbackOnPublish_v2 | None", self._paho.on_publish)

        def on_publish(
            client: paho.Client,
            userdata: Any,
            mid: int,
            reason_code: ReasonCode,
            properties: Properties,
        ) -> None:
            answer = self._answers.pop(mid, None)
            if answer is not None:
                answer(reason_code)
            if aiomqtt_handler is not None:
                aiomqtt_handler(client, userdata, mid, reason_code, properties)

        self._paho.on_publish = on_publish
        self.max_packet_size: int | None = None
        """The broker's Maximum Packet Size from the last CONNACK; None: it set none."""
        self.receive_maximum: int | None = None
        """The broker's Receive Maximum from the last CONNACK: QoS 1 publishes it takes
        unacknowledged at once (OASIS MQTT 5.0, 3.3.4); None: it set none (65,535)."""
        self.most_in_flight = 0
        """The most QoS 1 publishes awaiting their PUBACK at once on this connection."""
        aiomqtt_on_connect = cast("CallbackOnConnect_v2 | None", self._paho.on_connect)

        def on_connect(
            client: paho.Client,
            userdata: Any,
            flags: paho.ConnectFlags,
            reason_code: ReasonCode,
            properties: Properties | None,
        ) -> None:
            limit = getattr(properties, "MaximumPacketSize", None)
            self.max_packet_size = limit if isinstance(limit, int) and limit > 0 else None
            most = getattr(properties, "ReceiveMaximum", None)
            self.receive_maximum = most if isinstance(most, int) and most > 0 else None
            if aiomqtt_on_connect is not None:
                aiomqtt_on_connect(client, userdata, flags, reason_code, properties)

        self._paho.on_connect = on_connect

    def room(self, topic: str, qos: int) -> int | None:
        """The largest payload the broker takes on `topic`; None: no limit was given."""
        if self.max_packet_size is None:
            return None
        return payload_room(topic, qos, self.max_packet_size)

    def _send(self, topic: str, payload: bytes, qos: int, retain: bool) -> paho.MQTTMessageInfo:
        limit = self.max_packet_size
        if limit is not None and (size := publish_size(topic, len(payload), qos)) > limit:
            raise PacketTooLarge(topic, size, limit)
        info = self._paho.publish(topic, payload, qos, retain)
        if info.rc != paho.MQTT_ERR_SUCCESS:
            raise aiomqtt.MqttCodeError(info.rc, f"could not publish to {topic}")
        return info

    def publish_tracked(
        self, token: int, topic: str, payload: bytes, qos: int, retain: bool
    ) -> None:
        info = self._send(topic, payload, qos, retain)
        if info.is_published():  # QoS 0, written at once: there is no PUBACK to read
            self._complete(token, topic, None)
        else:
            self._answers[info.mid] = lambda reason: self._complete(token, topic, reason)
            self.most_in_flight = max(self.most_in_flight, len(self._answers))

    def _complete(self, token: int, topic: str, reason: ReasonCode | None) -> None:
        error = PublishRefused(topic, reason) if reason is not None and reason.is_failure else None
        self.completed.append((token, error))
        self.on_progress()

    async def publish_acked(
        self, topic: str, payload: bytes, qos: int, retain: bool, timeout: float
    ) -> None:
        """Publish; return once the broker accepted it (QoS 1: a successful PUBACK)."""
        info = self._send(topic, payload, qos, retain)
        if info.is_published():
            return
        answered: asyncio.Future[ReasonCode] = asyncio.get_running_loop().create_future()

        def answer(reason: ReasonCode) -> None:
            if not answered.done():  # a wait that timed out has cancelled it
                answered.set_result(reason)

        self._answers[info.mid] = answer
        self.most_in_flight = max(self.most_in_flight, len(self._answers))
        try:
            reason = await asyncio.wait_for(answered, timeout)
        except TimeoutError:
            raise aiomqtt.MqttError(f"no PUBACK for {topic} within {timeout:g} s") from None
        finally:
            self._answers.pop(info.mid, None)
        if reason.is_failure:
            raise PublishRefused(topic, reason)


# -- naming failures and waiting between attempts ----------------------------------------------


def classify(exc: BaseException, section: str = "mqtt") -> tuple[str, str]:
    """(kind, what to do) for a connection or delivery failure; `section` is the table whose
    keys the advice names.

    Kinds: refused, bad_credentials, not_authorized, tls_failed, unreachable, connection_lost,
    publish_refused.
    """
    if isinstance(exc, PublishRefused):
        return "publish_refused", (
            f"the broker's ACL does not let [{section}] username publish to {exc.topic}; for "
            "nodes allow 'pattern write <prefix>/%u/#', for the watcher write on "
            "<prefix>/_watch/#"
        )
    if isinstance(exc, MqttConnectError):
        code = getattr(exc.rc, "value", exc.rc)
        if code in BAD_CREDENTIALS:
            return "bad_credentials", (
                f"check [{section}] username and the password in password_file"
            )
        if code in NOT_AUTHORIZED:
            return "not_authorized", (
                f"check [{section}] username and the password in password_file, and that the "
                "broker lets this user connect"
            )
        return "refused", "the broker refused the connection; read the broker's log"
    text = str(exc).lower()
    if any(mark in text for mark in ("certificate", "ssl", "tls", "hostname mismatch")):
        return "tls_failed", (
            f"check [{section}] ca_file, that the broker's certificate names the host in url, "
            "and cert_file/key_file"
        )
    if any(
        mark in text
        for mark in (
            "refused",
            "no route",
            "name or service",
            "unreachable",
            "temporary failure in name resolution",
        )
    ):
        return "unreachable", f"is the broker running and reachable at [{section}] url?"
    return "connection_lost", "the broker went away or stopped answering; it is retried"


class FailureTracker:
    """The way the connection last failed: a log line (and event) per change, not per retry,
    and a count per attempt."""

    def __init__(self) -> None:
        self.kind: str | None = None
        self.counts: Counter[str] = Counter()

    def failed(self, kind: str) -> bool:
        """Count one failure; True when it differs from the last one (report it)."""
        self.counts[kind] += 1
        changed = kind != self.kind
        self.kind = kind
        return changed

    def recovered(self) -> bool:
        """Connected again; True when it had been failing (report that it is over)."""
        was_failing = self.kind is not None
        self.kind = None
        return was_failing


class Backoff:
    """The one reconnect policy: tenacity's exponential backoff with jitter, outside a retry
    decorator. Delay n lies in [minimum * 2^(n-1), that + minimum], at most `maximum`."""

    def __init__(self, minimum: float, maximum: float) -> None:
        self.minimum = minimum
        self.maximum = maximum
        self._wait = tenacity.wait_exponential_jitter(
            multiplier=minimum, max=maximum, jitter=minimum, min=minimum
        )
        self._retrying = tenacity.AsyncRetrying(wait=self._wait)
        self.attempt = 0

    @classmethod
    def of(cls, settings: BrokerSettings) -> Backoff:
        return cls(settings.reconnect_min, settings.reconnect_max)

    def next_delay(self) -> float:
        self.attempt += 1
        state = tenacity.RetryCallState(self._retrying, None, (), {})
        state.attempt_number = self.attempt
        return float(self._wait(state))

    def reset(self) -> None:
        self.attempt = 0


async def reconnect_forever(
    session: Callable[[], Awaitable[None]],
    backoff: Backoff,
    on_failure: Callable[[Exception], None],
) -> NoReturn:
    """Run `session` (one connection) again and again, `backoff` apart; the session resets
    the backoff once it is connected, so a long outage waits longer between attempts while a
    connection that drops after working is retried soon.

    Any exception, not only MqttError, costs a reconnection: a bug in a session must not end
    the MQTT side for good (and the backoff keeps a lasting one from spinning).
    """
    while True:
        try:
            await session()
        except Exception as exc:  # see the docstring
            on_failure(exc)
        await asyncio.sleep(backoff.next_delay())
