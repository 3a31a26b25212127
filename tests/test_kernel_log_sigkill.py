"""Nothing lost under SIGKILL: Xid lines appended to a followed log while the real agent is
killed again and again all reach a real mosquitto subscriber as events.

The agent runs as a child process (tests/support/agent_proc.py) following a file; a writer
thread appends Xid lines at a steady rate, each for its own GPU address and code (so that no
holdoff or backlog merge may fold two lines into one event and every line must be its own
event), each followed by an I/O error line of its own disk (a busy log: findings that are
events at once, so rounds store their cursor while an Xid may still be held); the agent is
SIGKILLed at moments spread over its life (while starting, while
reading, while publishing) 20 times, then runs to the end. Every line must arrive; an event
that arrives twice (published, killed before the PUBACK was recorded) must carry the same id.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.program import registry
from tests.support.agent_proc import AgentProcess
from tests.support.mosquitto import Broker
from tests.support.mqtt import Subscriber

KILLS = 20
LINES_PER_SECOND = 20
READ_INTERVAL = 0.5
"""Short, so that each life of the agent (under 1.5 s) has rounds after its first: the first
round of a life reads what came meanwhile as backlog, which was never held back; the Xids of
the later rounds are what a reader that holds them past its cursor loses."""
CODES = (13, 31, 43, 45, 48, 63, 64, 68, 74, 79, 92, 94, 95, 109, 119, 120)


def agent_config(
    broker: Broker, log: Path, *, heartbeat: float = 5.0, read_interval: float = READ_INTERVAL
) -> str:
    """The agent's file: MQTT to `broker`, the kernel log read from `log`, nothing else on."""
    others = "".join(
        f"[collectors.{name}]\nenabled = false\n"
        for name in registry.COLLECTORS
        if name != "kernel_log"
    )
    return (
        f'[mqtt]\nenabled = true\nurl = "{broker.url}"\nkeepalive = 5\n'
        "reconnect_min = 0.1\nreconnect_max = 0.5\n"
        f"[heartbeat]\ninterval = {heartbeat}\n"
        f'[collectors.kernel_log]\npath = "{log}"\ninterval = {read_interval}\n{others}'
    )


class XidWriter(threading.Thread):
    """Appends one Xid line per tick, each with a (bus, code) of its own, as a driver would
    write them to a log that a syslog daemon saves."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path = path
        self.written: list[tuple[str, int]] = []
        self.disks: list[str] = []
        self.halt = threading.Event()

    def run(self) -> None:
        with self.path.open("a", buffering=1) as handle:
            while not self.halt.wait(1 / LINES_PER_SECOND):
                n = len(self.written)
                bus, code = n % 256, CODES[n // 256]
                stamp = f"[{1000 + n * 0.05:10.4f}]"
                handle.write(
                    f"{stamp} NVRM: Xid (PCI:0000:{bus:02x}:00): {code}, pid={4000 + n}, "
                    f"name=python3, sigkill test line {n}\n"
                    f"{stamp} I/O error, dev loop{n}, sector 2048 op 0x1:(WRITE) flags 0x800 "
                    "phys_seg 1 prio class 2\n"
                )
                self.written.append((f"0000:{bus:02x}:00.0", code))
                self.disks.append(f"loop{n}")


def arrived(sub: Subscriber) -> dict[object, set[str]]:
    """What each arrived event was found for -> the ids it arrived with: an Xid's (GPU
    address, code), an I/O error's disk."""
    seen: dict[object, set[str]] = defaultdict(set)
    for message in sub.on("/events"):
        event = message.json()
        attrs = event["attributes"]
        if event["kind"] == "xid":
            seen[(attrs["pci_bus_id"], int(attrs["xid"]))].add(str(event["id"]))
        elif event["kind"] == "io_error":
            seen[attrs["device"]].add(str(event["id"]))
    return seen


@pytest.fixture
def roomy_broker(tmp_path: Path) -> Iterator[Broker]:
    """A broker that queues without bound for a slow subscriber (mosquitto drops QoS 1
    messages past 1000 queued by default): a message lost there is not the agent's."""
    instance = Broker(tmp_path / "broker", extra_config=["max_queued_messages 0"]).start()
    yield instance
    instance.stop()


@pytest.mark.slow
def test_no_xid_is_lost_to_sigkill(
    tmp_path: Path, roomy_broker: Broker, agent_process: AgentProcess
) -> None:
    broker = roomy_broker
    log = tmp_path / "kern.log"
    log.write_text("[    0.0000] Linux version 6.8.0 (test)\n")
    agent_process.config_text = agent_config(broker, log)
    sub = Subscriber(broker.port, topic_filter="gpuwarden/v1/test-node/events").start()
    writer = XidWriter(log)
    chance = random.Random(12)  # fixed: a failure reruns with the same kill moments
    try:
        writer.start()
        for _ in range(KILLS):
            agent_process.start(wait=False)
            # 0.3 s is mid-import; 1.5 s is reading and publishing.
            time.sleep(chance.uniform(0.3, 1.5))
            agent_process.signal(signal.SIGKILL)
            assert agent_process.process is not None
            agent_process.process.wait(5)
            agent_process.process = None
        writer.halt.set()
        writer.join(5)
        agent_process.start(wait=False)
        expected: set[object] = {*writer.written, *writer.disks}
        deadline = time.monotonic() + 60.0  # a bound for a loaded machine, not a timing
        while time.monotonic() < deadline and not expected <= arrived(sub).keys():
            time.sleep(0.5)
        seen = arrived(sub)
        lost = expected - seen.keys()
        lost_xids = sorted(key for key in lost if isinstance(key, tuple))
        assert not lost, (
            f"{len(lost_xids)} of {len(writer.written)} Xid lines and "
            f"{len(lost) - len(lost_xids)} of {len(writer.disks)} I/O error lines never "
            f"arrived, e.g. {lost_xids[:5]}; {len(sub.on('/events'))} event messages came\n"
            + agent_process.log()[-2000:]
        )
        assert len(writer.written) >= KILLS * LINES_PER_SECOND * 0.3 / 2  # it kept writing
        twice = {key: ids for key, ids in seen.items() if len(ids) > 1}
        assert not twice, f"the same Xid line arrived under different ids: {twice}"
    finally:
        writer.halt.set()
        sub.stop()
