"""The aiomqtt client the sink uses, plus what aiomqtt leaves out: PUBACK reason codes.

aiomqtt 2.x's `publish()` returns after the PUBACK but drops its reason code. Under MQTT v5 a
broker refuses a publish it may not accept (mosquitto 2: an ACL denial) with a PUBACK whose
reason code is 0x87 "Not authorized"; under MQTT 3.1.1 it acknowledges and silently drops it.
So the sink speaks v5 and reads the code: `publish_acked()` raises `PublishRefused` for a
reason code >= 0x80. It reuses aiomqtt's own pending-call plumbing (private in aiomqtt 2.x,
which pyproject pins below 3).

`classify()` names the ways a connection fails, for one log line and one event per transition.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from typing import Any

import aiomqtt
import paho.mqtt.client as paho
from aiomqtt.exceptions import MqttConnectError
from paho.mqtt.reasoncodes import ReasonCode

# MQTT v5 reason codes (OASIS MQTT 5.0, section 2.4) and the v3.1.1 CONNACK return codes that
# paho maps onto them.
BAD_CREDENTIALS = {0x86, 0x8C}  # bad user name or password, bad authentication method
NOT_AUTHORIZED = {0x87}


class PublishRefused(aiomqtt.MqttError):
    """The broker answered a QoS 1 publish with a failure reason code (v5 PUBACK)."""

    def __init__(self, topic: str, reason: ReasonCode) -> None:
        self.topic = topic
        self.reason = reason
        super().__init__(f"broker refused publish to {topic}: {reason} (0x{reason.value:02x})")


class CheckedClient(aiomqtt.Client):
    """An aiomqtt.Client whose publishes report the PUBACK reason code.

    Two ways to publish: `publish_acked()` awaits one message (status), and
    `publish_tracked()` sends without waiting and reports `(token, error or None)` in
    `completed` when the broker answers, calling `on_progress`: the outbox drain keeps a
    window of these in flight without a task or a timer per message.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._puback_reasons: dict[int, ReasonCode] = {}
        self._tracked: dict[int, tuple[int, str]] = {}
        self.completed: list[tuple[int, PublishRefused | None]] = []
        self.lost = False
        self.on_progress: Callable[[], None] = lambda: None

    def _on_publish(
        self, client: paho.Client, userdata: Any, mid: int, reason_code: ReasonCode, properties: Any
    ) -> None:
        tracked = self._tracked.pop(mid, None)
        if tracked is not None:
            self._complete(tracked[0], tracked[1], reason_code)
            return
        self._puback_reasons[mid] = reason_code
        super()._on_publish(client, userdata, mid, reason_code, properties)

    def _on_disconnect(self, *args: Any, **kwargs: Any) -> None:
        super()._on_disconnect(*args, **kwargs)
        self.lost = True
        self.on_progress()

    def _complete(self, token: int, topic: str, reason: ReasonCode | None) -> None:
        error = PublishRefused(topic, reason) if reason is not None and reason.is_failure else None
        self.completed.append((token, error))
        self.on_progress()

    def publish_tracked(
        self, token: int, topic: str, payload: bytes, qos: int, retain: bool
    ) -> None:
        info = self._client.publish(topic, payload, qos, retain)
        if info.rc != paho.MQTT_ERR_SUCCESS:
            raise aiomqtt.MqttCodeError(info.rc, f"could not publish to {topic}")
        if info.is_published():  # QoS 0 written at once: on_publish has already run
            self._complete(token, topic, self._puback_reasons.pop(info.mid, None))
        else:
            self._tracked[info.mid] = (token, topic)

    async def publish_acked(
        self, topic: str, payload: bytes, qos: int, retain: bool, timeout: float | None = None
    ) -> None:
        """Publish; return once the broker accepted it (QoS 1: a successful PUBACK)."""
        info = self._client.publish(topic, payload, qos, retain)
        if info.rc != paho.MQTT_ERR_SUCCESS:
            raise aiomqtt.MqttCodeError(info.rc, f"could not publish to {topic}")
        if not info.is_published():
            confirmation = asyncio.Event()
            with self._pending_call(info.mid, confirmation, self._pending_publishes):
                await self._wait_for(confirmation.wait(), timeout=timeout)
        reason = self._puback_reasons.pop(info.mid, None)
        if reason is not None and reason.is_failure:
            raise PublishRefused(topic, reason)


def tls_context(ca_file: str | None, cert_file: str | None, key_file: str | None) -> ssl.SSLContext:
    """Verify the broker's certificate and host name, always; optionally present our own."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
    context.check_hostname = True
    context.verify_mode = ssl.CERT_REQUIRED
    if cert_file is not None:
        context.load_cert_chain(cert_file, key_file)
    return context


def classify(exc: BaseException) -> tuple[str, str]:
    """(kind, what to do) for a connection or delivery failure.

    Kinds: refused, bad_credentials, not_authorized, tls_failed, unreachable, connection_lost,
    publish_refused.
    """
    if isinstance(exc, PublishRefused):
        return "publish_refused", (
            "the broker's ACL does not let this node publish there; allow "
            "'pattern write <prefix>/%u/#' for the node's user"
        )
    if isinstance(exc, MqttConnectError):
        code = getattr(exc.rc, "value", exc.rc)
        if code in BAD_CREDENTIALS:
            return "bad_credentials", "check [mqtt] username and the password in password_file"
        if code in NOT_AUTHORIZED:
            return "not_authorized", (
                "check [mqtt] username and the password in password_file, and that the broker "
                "lets this user connect"
            )
        return "refused", "the broker refused the connection; read the broker's log"
    text = str(exc).lower()
    if any(mark in text for mark in ("certificate", "ssl", "tls", "hostname mismatch")):
        return "tls_failed", (
            "check ca_file, that the broker's certificate names the host in [mqtt] url, "
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
        return "unreachable", "is the broker running and reachable at [mqtt] url?"
    return "connection_lost", "the broker went away or stopped answering; it is retried"
