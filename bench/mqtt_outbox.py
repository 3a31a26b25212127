"""Events per second through the durable outbox to mosquitto at QoS 1, against a bare
paho-mqtt QoS 1 publish loop to the same broker in the same run; and the state database's
disk bytes per queued event.

    .venv/bin/python bench/mqtt_outbox.py [--events 5000] [--rounds 3]

The broker is started here on a free loopback port. The outbox path is the agent's own:
`Runtime.emit` stores each event (history + outbox row, one transaction), the MQTT sink drains
the outbox with a window of QoS 1 publishes and deletes rows after their PUBACKs. The bare loop
publishes the same payloads with paho's own window (max_inflight set to the same size) and
stores nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from agent.program import registry

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from agent.contracts.model import Event, Severity
from agent.program import config_file as config_module
from agent.runtime import logs
from agent.runtime.core import Runtime
from agent.runtime.state import DB_NAME, StateStore
from tests.support.mosquitto import Broker

WINDOW = 100


def sample_event(i: int) -> Event:
    return Event(
        source="xid",
        kind="xid",
        severity=Severity.CRITICAL,
        subject="0000:1b:00.0",
        message=f"GPU 0000:1b:00.0 reported Xid 79 (fallen off the bus), round {i}",
        action="drain the node and reset the GPU; if it recurs, replace it",
        attributes={"xid": 79, "pid": 4242},
    )


def bare_paho(port: int, payloads: list[bytes]) -> float:
    """Seconds to publish every payload at QoS 1 and receive every PUBACK."""
    done = threading.Event()
    acked = 0

    def on_publish(*_args: object) -> None:
        nonlocal acked
        acked += 1
        if acked == len(payloads):
            done.set()

    client = paho.Client(CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
    client.max_inflight_messages_set(WINDOW)
    client.on_publish = on_publish
    client.connect("127.0.0.1", port, keepalive=30)
    client.loop_start()
    started = time.perf_counter()
    for payload in payloads:
        client.publish("bench/bare/events", payload, qos=1)
    if not done.wait(120):
        raise TimeoutError(f"bare loop: {acked} of {len(payloads)} acknowledged")
    took = time.perf_counter() - started
    client.disconnect()
    client.loop_stop()
    return took


async def through_outbox(port: int, count: int, state_dir: Path, *, backlog: bool) -> float:
    """Seconds from the first emit to the last outbox row deleted after its PUBACK; with
    `backlog`, the events are stored first (an outage's backlog) and only the drain is timed."""
    cfg = config_module.parse(
        {
            "node_id": "bench",
            "state_dir": str(state_dir),
            "prometheus": {"enabled": False},
            "collectors": {"system": {"enabled": False}},
            "heartbeat": {"interval": 3600.0},
            "mqtt": {
                "enabled": True,
                "url": f"mqtt://127.0.0.1:{port}",
                "publish_window": WINDOW,
                "metrics_interval": 86400.0,
            },
        }
    )
    events = [sample_event(i) for i in range(count)]
    store = StateStore.open(cfg.state_dir)
    if backlog:
        for event in events:
            store.record_event(event, outbox=True)
        started = time.perf_counter()
    runtime = Runtime(cfg, store, collectors=registry.COLLECTORS, sinks=registry.SINKS)
    await runtime.start()
    sink = runtime.sinks["mqtt"]
    while not getattr(sink, "connected", False):
        await asyncio.sleep(0.01)
    if not backlog:
        while runtime.store.outbox_depth():  # the first heartbeat
            await asyncio.sleep(0.01)
        started = time.perf_counter()
        for i, event in enumerate(events):
            runtime.emit(event)
            if i % 200 == 0:
                await asyncio.sleep(0)  # let the drain run, as a real loop would
    while runtime.store.outbox_depth().get("event", 0):
        await asyncio.sleep(0.002)
    took = time.perf_counter() - started
    await runtime.stop()
    runtime.store.close()
    return took


async def emit_only(count: int, state_dir: Path) -> float:
    """Seconds for Runtime.emit alone (store in history + outbox, one log line), no sink:
    the ceiling of the live path, which this bench does not own."""
    cfg = config_module.parse(
        {
            "node_id": "bench",
            "state_dir": str(state_dir),
            "prometheus": {"enabled": False},
            "collectors": {"system": {"enabled": False}},
        }
    )
    runtime = Runtime(
        cfg,
        StateStore.open(cfg.state_dir),
        collectors=registry.COLLECTORS,
        sinks=registry.SINKS,
    )
    runtime.outbox_enabled = True
    await runtime.start()
    events = [sample_event(i) for i in range(count)]
    started = time.perf_counter()
    for event in events:
        runtime.emit(event)
    await runtime.settle(60.0)  # stored (off the loop, by the store writer) and announced
    took = time.perf_counter() - started
    await runtime.stop()
    runtime.store.close()
    return took


def bytes_per_event(count: int, state_dir: Path) -> tuple[float, float]:
    """(database bytes per event held in history + outbox, per event in history only)."""
    store = StateStore.open(state_dir)
    for i in range(count):
        store.record_event(sample_event(i), outbox=True)
    store.close()  # checkpoints the WAL into the main file
    with_outbox = (state_dir / DB_NAME).stat().st_size / count
    store = StateStore.open(state_dir)
    store.outbox_ack([e.seq for e in store.outbox_peek(count + 10)])
    store._write("VACUUM")
    store.close()
    return with_outbox, (state_dir / DB_NAME).stat().st_size / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    # The agent logs every event; the lines go to /dev/null here, their cost stays measured.
    devnull = open(os.devnull, "w")  # noqa: SIM115
    logs.configure("info", stream=devnull, json=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        broker = Broker(work / "broker").start()
        try:
            payloads = [sample_event(i).to_json().encode() for i in range(args.events)]
            bare: list[float] = []
            live: list[float] = []
            backlog: list[float] = []
            ceiling: list[float] = []
            for n in range(args.rounds):
                bare.append(args.events / bare_paho(broker.port, payloads))
                live.append(
                    args.events
                    / asyncio.run(
                        through_outbox(broker.port, args.events, work / f"live-{n}", backlog=False)
                    )
                )
                backlog.append(
                    args.events
                    / asyncio.run(
                        through_outbox(
                            broker.port, args.events, work / f"backlog-{n}", backlog=True
                        )
                    )
                )
                ceiling.append(
                    args.events / asyncio.run(emit_only(args.events, work / f"emit-{n}"))
                )
            per_event, history_only = bytes_per_event(args.events, work / "size")
        finally:
            broker.stop()
    print(
        f"events: {args.events} x {args.rounds} rounds, QoS 1, window {WINDOW}, "
        f"payload {len(payloads[0])} bytes, mosquitto on loopback"
    )
    print(f"{'path':<44}{'events/s (median)':>18}{'vs bare':>9}   rounds")
    base = statistics.median(bare)
    for name, rates in (
        ("bare paho-mqtt publish loop (stores nothing)", bare),
        ("emit -> outbox -> PUBACK -> delete", live),
        ("outage backlog drained (outbox -> PUBACK)", backlog),
        ("Runtime.emit alone (store + log, no MQTT)", ceiling),
    ):
        median = statistics.median(rates)
        print(
            f"{name:<44}{median:>18,.0f}{median / base:>9.2f}   "
            + " ".join(f"{r:,.0f}" for r in rates)
        )
    print(
        f"state.db bytes per event: {per_event:,.0f} while queued (history + outbox row), "
        f"{history_only:,.0f} after delivery (history only)"
    )


if __name__ == "__main__":
    main()
