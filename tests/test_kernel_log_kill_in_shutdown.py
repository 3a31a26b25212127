"""Nothing lost to a SIGKILL that lands while the agent stops.

The same harness as test_kernel_log_sigkill.py (a real agent following a file that a writer
appends an Xid and an I/O error line to, twenty times a second; a real mosquitto), with another
way to die: SIGTERM and then SIGKILL a moment later, at moments spread over the shutdown
(collectors cancelled mid-round, the store flushed and closed, the WAL checkpointed). Every line
must arrive, and an event that arrives twice must carry the same id.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.agent_proc import AgentProcess
from tests.support.mosquitto import Broker
from tests.support.mqtt import Subscriber
from tests.test_kernel_log_sigkill import XidWriter, agent_config, arrived

LIVES = 12


@pytest.fixture
def roomy_broker(tmp_path: Path) -> Iterator[Broker]:
    """A broker that queues without bound for a slow subscriber (a message lost there is not
    the agent's)."""
    instance = Broker(tmp_path / "broker", extra_config=["max_queued_messages 0"]).start()
    yield instance
    instance.stop()


def assert_all_arrived(sub: Subscriber, writer: XidWriter, agent: AgentProcess) -> None:
    expected: set[object] = {*writer.written, *writer.disks}
    deadline = time.monotonic() + 60.0  # a bound for a loaded machine, not a timing
    while time.monotonic() < deadline and not expected <= arrived(sub).keys():
        time.sleep(0.5)
    seen = arrived(sub)
    lost = expected - seen.keys()
    assert not lost, (
        f"{len(lost)} of {len(expected)} lines never arrived, e.g. {sorted(map(str, lost))[:5]}"
        + agent.log()[-2000:]
    )
    twice = {key: ids for key, ids in seen.items() if len(ids) > 1}
    assert not twice, f"the same line arrived under different ids: {twice}"


@pytest.mark.slow
def test_sigkill_during_shutdown(
    tmp_path: Path, agent_process: AgentProcess, roomy_broker: Broker
) -> None:
    log = tmp_path / "kern.log"
    log.write_text("[    0.0000] Linux version 6.8.0 (test)\n")
    agent_process.config_text = agent_config(roomy_broker, log)
    sub = Subscriber(roomy_broker.port, topic_filter="gpuwarden/v1/test-node/events").start()
    writer = XidWriter(log)
    chance = random.Random(21)  # fixed: a failure reruns with the same moments
    try:
        writer.start()
        ends: list[int] = []
        for _ in range(LIVES):
            agent_process.start()  # serving: it has read and is publishing
            time.sleep(chance.uniform(0.2, 1.0))
            agent_process.signal(signal.SIGTERM)
            time.sleep(chance.uniform(0.0, 0.03))  # somewhere in the stop
            assert agent_process.process is not None
            if agent_process.process.poll() is None:
                agent_process.signal(signal.SIGKILL)
            ends.append(agent_process.process.wait(10))
            agent_process.process = None
        assert -signal.SIGKILL in ends, f"no life was killed in its stop: {ends}"
        writer.halt.set()
        writer.join(5)
        agent_process.start()
        assert_all_arrived(sub, writer, agent_process)
    finally:
        writer.halt.set()
        sub.stop()
