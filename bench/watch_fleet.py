"""The watcher at fleet size: its memory and its /metrics, one checkout next to another.

One private mosquitto on a free loopback port holds a retained status (online) and a retained
heartbeat (interval 1 h: every node stays online for the run) for each of `--nodes` nodes.
For each checkout, `gpuwarden watch` from that tree (a real process, its own PYTHONPATH)
subscribes and takes them all in; then:

- RSS: the watcher's resident memory (VmRSS) once every node is in;
- /metrics: wall time and size of a scrape (best and worst of `--scrapes`);
- /healthz during /metrics: a GET of /healthz sent 50 ms after a /metrics request started.
  /healthz is answered by the event loop: its time is how long a scrape holds the loop.

    python bench/watch_fleet.py [--nodes 100000] [--checkout /work/main --checkout .]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.ports import free_port, wait_for_port

PREFIX = "gpuwarden/v1"
MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
HERE = Path(__file__).resolve().parents[1]


@dataclass
class Figures:
    label: str
    rss_mb: float
    ingest_s: float
    scrape_best_s: float
    scrape_worst_s: float
    body_mb: float
    healthz_s: float


def start_broker(workdir: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    conf = workdir / "mosquitto.conf"
    conf.write_text(
        f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
        "log_type error\nmax_queued_messages 0\nmax_queued_bytes 0\n"
    )
    process = subprocess.Popen(
        [MOSQUITTO, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    wait_for_port(port)
    return process, port


def fill(port: int, nodes: int) -> None:
    """Retained status and heartbeat for every node; a last QoS 1 publish marks the end (the
    broker handles one client's publishes in order)."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2)
    client.connect("127.0.0.1", port)
    client.loop_start()
    now = time.time()
    for i in range(nodes):
        base = f"{PREFIX}/node-{i:06d}"
        client.publish(
            f"{base}/status",
            json.dumps({"state": "online", "bdseq": 1, "ts": now, "version": "bench"}),
            retain=True,
        )
        client.publish(
            f"{base}/heartbeat",
            json.dumps({"seq": 1, "ts": now, "interval_s": 3600.0, "health": "ok"}),
            retain=True,
        )
        if i % 5000 == 0:
            time.sleep(0.01)  # let the network thread drain the socket buffer
    client.publish(f"{PREFIX}/_bench/end", b"1", qos=1).wait_for_publish(120)
    client.disconnect()
    client.loop_stop()


def get(url: str, timeout: float = 120.0) -> tuple[float, bytes]:
    start = time.perf_counter()
    with urllib.request.urlopen(url, timeout=timeout) as response:
        body = bytes(response.read())
    return time.perf_counter() - start, body


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def messages_in(body: bytes) -> float:
    total = 0.0
    for line in body.decode().splitlines():
        if line.startswith("gpuwarden_watch_messages_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def measure(checkout: Path, label: str, port: int, nodes: int, scrapes: int) -> Figures:
    listen = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "gpuwarden.toml"
        config.write_text(
            f'[watch]\nurl = "mqtt://127.0.0.1:{port}"\nlisten = "127.0.0.1:{listen}"\n'
            "default_interval = 3600.0\n"
        )
        env = {**os.environ, "PYTHONPATH": str(checkout)}
        started = time.perf_counter()
        watcher = subprocess.Popen(
            [sys.executable, "-m", "agent", "watch", "--config", str(config)],
            cwd=checkout,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_for_port(listen, timeout=30)
            url = f"http://127.0.0.1:{listen}"
            deadline = time.monotonic() + 300
            while messages_in(get(f"{url}/metrics")[1]) < 2 * nodes:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{label}: the watcher did not take in {nodes} nodes")
                time.sleep(1.0)
            ingest = time.perf_counter() - started
            memory = rss_mb(watcher.pid)
            times, size = [], 0
            for _ in range(scrapes):
                seconds, body = get(f"{url}/metrics")
                times.append(seconds)
                size = len(body)
            healthz: list[float] = []
            scrape = threading.Thread(target=get, args=(f"{url}/metrics",))
            scrape.start()
            time.sleep(0.05)
            healthz.append(get(f"{url}/healthz")[0])
            scrape.join()
            return Figures(label, memory, ingest, min(times), max(times), size / 1e6, healthz[0])
        finally:
            watcher.terminate()
            watcher.wait(15)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=100_000)
    parser.add_argument("--scrapes", type=int, default=3)
    parser.add_argument(
        "--checkout",
        action="append",
        type=Path,
        help="a source tree to run the watcher from (repeat); default: /work/main and this one",
    )
    args = parser.parse_args()
    checkouts = args.checkout or [Path("/work/main"), HERE]
    with tempfile.TemporaryDirectory() as tmp:
        broker, port = start_broker(Path(tmp))
        try:
            fill(port, args.nodes)
            rows = [measure(c.resolve(), str(c), port, args.nodes, args.scrapes) for c in checkouts]
        finally:
            broker.terminate()
            broker.wait(10)
    print(f"{args.nodes} nodes (retained status + heartbeat each), loopback mosquitto")
    header = (
        f"{'checkout':<28} {'RSS MB':>8} {'ingest s':>9} {'/metrics s':>14} "
        f"{'body MB':>8} {'/healthz during':>16}"
    )
    print(header)
    for row in rows:
        scrape = f"{row.scrape_best_s:.2f}-{row.scrape_worst_s:.2f}"
        print(
            f"{row.label[-28:]:<28} {row.rss_mb:>8.0f} {row.ingest_s:>9.1f} {scrape:>14} "
            f"{row.body_mb:>8.1f} {row.healthz_s:>15.3f}s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
