"""Basic auth under a guessing storm: the host, the scraper and the MQTT connect keep going.

The agent's runtime with the Prometheus sink runs in this process (so that the threads bcrypt
runs on can be seen), with a users file at cost 12 as the issue measured; 32 clients from 32
other loopback addresses guess passwords as fast as they are answered, from a child process
(tests/support/endpoint_attack.py). Meanwhile a scraper with the right password polls from its
own thread, and a real aiomqtt client connects to a real mosquitto from the agent's loop.
On main before this change: bcrypt ran in asyncio's default executor, which aiomqtt's connect
shares, and the guesses queued in front of the connect.
"""

from __future__ import annotations

import asyncio
import base64
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiomqtt
import bcrypt
import pytest

from agent.program import config_file as config_module
from agent.program import registry
from agent.runtime.core import Runtime
from agent.runtime.state import StateStore
from tests.support.endpoint_attack import Scrapes, finish_attack, scrape, start_attack
from tests.support.mosquitto import Broker
from tests.support.ports import free_port

STORM_SECONDS = 4.0
GUESSERS = 32


class RecordingExecutor(ThreadPoolExecutor):
    """The loop's default executor, remembering what was handed to it."""

    def __init__(self) -> None:
        super().__init__(max_workers=4, thread_name_prefix="default-executor")
        self.submitted: list[str] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        self.submitted.append(getattr(fn, "__qualname__", repr(fn)))
        return super().submit(fn, *args, **kwargs)


async def test_guessing_storm_costs_the_attacker(
    tmp_path: Path, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """32 guessing clients: the right scraper keeps >= 90% of its answers, every bcrypt call
    runs on the auth thread and none in the default executor, and an MQTT connect from the
    same loop takes well under a second."""
    users = tmp_path / "users"
    users.write_text(f"prometheus:{bcrypt.hashpw(b's3cret', bcrypt.gensalt(12)).decode()}\n")
    users.chmod(0o600)
    port = free_port()
    cfg = config_module.parse(
        {
            "node_id": "n",
            "state_dir": str(tmp_path / "state"),
            "prometheus": {"listen": f"127.0.0.1:{port}", "basic_auth_users_file": str(users)},
            "collectors": {"gpu": {"enabled": False}, "benchmark": {"enabled": False}},
        }
    )
    threads: set[str] = set()
    checkpw = bcrypt.checkpw

    def recording_checkpw(password: bytes, hashed: bytes) -> bool:
        threads.add(threading.current_thread().name)
        return checkpw(password, hashed)

    monkeypatch.setattr(bcrypt, "checkpw", recording_checkpw)
    loop = asyncio.get_running_loop()
    default = RecordingExecutor()
    loop.set_default_executor(default)
    runtime = Runtime(
        cfg, StateStore.open(cfg.state_dir), collectors=registry.COLLECTORS, sinks=registry.SINKS
    )
    await runtime.start()
    right = "Basic " + base64.b64encode(b"prometheus:s3cret").decode()
    result: list[Scrapes] = []
    try:
        attacker = start_attack("guess", port, STORM_SECONDS + 3.0, GUESSERS, GUESSERS)
        # The storm's first seconds, when no guesser has been refused yet, are not its state.
        await asyncio.sleep(2.0)
        scraper = threading.Thread(
            # A timeout of 5 s (Prometheus' default is 10 s): the first scrape waits for the
            # check in the auth thread, then its own, both of cost 12 on two busy cores.
            target=lambda: result.append(
                scrape(port, STORM_SECONDS, 0.25, timeout=5.0, authorization=right)
            )
        )
        scraper.start()
        await asyncio.sleep(1.0)
        started = time.monotonic()
        async with aiomqtt.Client("127.0.0.1", broker.port, identifier="storm-probe"):
            connect_seconds = time.monotonic() - started
        while scraper.is_alive():
            await asyncio.sleep(0.1)
        tally = await asyncio.get_running_loop().run_in_executor(None, finish_attack, attacker)
    finally:
        await runtime.stop()
        runtime.store.close()
        loop.set_default_executor(ThreadPoolExecutor())
        default.shutdown(wait=False)
    assert tally.answers >= GUESSERS  # the storm was answered (401, 429, 503), not stalled
    scrapes = result[0]
    assert scrapes.ratio >= 0.90, scrapes
    assert threads and all(name.startswith("gpuwarden-auth") for name in threads), threads
    assert not [name for name in default.submitted if "check" in name.lower()], default.submitted
    assert connect_seconds < 1.0
