"""A tiny stand-in for an agent's MQTT side, run as a real subprocess so it can be SIGKILLed.

It sets the contract's Will (offline, same bdseq), publishes a retained online status, then a
retained heartbeat every `--interval` seconds. SIGTERM publishes a clean offline
(`"reason": "shutdown"`) like the agent does on a clean stop.

    python -m tests.support.fake_node --port 1883 --node n1 --bdseq 3 --interval 0.5
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from types import FrameType

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--bdseq", type=int, default=1)
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--keepalive", type=int, default=5)
    parser.add_argument("--prefix", default="gpuwarden/v1")
    args = parser.parse_args()
    base = f"{args.prefix}/{args.node}"

    def status(state: str, **extra: object) -> str:
        return json.dumps(
            {"state": state, "bdseq": args.bdseq, "ts": time.time(), "version": "fake", **extra}
        )

    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"fake-{args.node}")
    client.will_set(f"{base}/status", status("offline"), qos=1, retain=True)
    client.connect("127.0.0.1", args.port, keepalive=args.keepalive)
    client.loop_start()
    client.publish(f"{base}/status", status("online"), qos=1, retain=True).wait_for_publish(5)
    running = True

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal running
        running = False

    signal.signal(signal.SIGTERM, stop)
    print("ready", flush=True)
    seq = 0
    while running:
        seq += 1
        beat = {"seq": seq, "ts": time.time(), "interval_s": args.interval, "health": "ok"}
        client.publish(f"{base}/heartbeat", json.dumps(beat), qos=1, retain=True)
        time.sleep(args.interval)
    client.publish(
        f"{base}/status", status("offline", reason="shutdown"), qos=1, retain=True
    ).wait_for_publish(5)
    client.disconnect()
    client.loop_stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
