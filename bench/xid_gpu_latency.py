"""A real Xid on a GPU host: from the driver's record to the broker's PUBACK, through /dev/kmsg
and through the NVML event thread.

    python bench/xid_gpu_latency.py [--recipe bench/xid31.py]
        [--mosquitto PATH] [--mosquitto-lib DIR] [--runs 3]

(run as root, for /dev/kmsg. A GPU host often has no package registry: --mosquitto names a
broker binary brought along, and --mosquitto-lib the folder of its libraries, which is set for
the broker's process only.)

The agent's runtime runs here with the kernel_log collector on /dev/kmsg and the gpu collector
with its NVML event thread (their default settings), and the MQTT sink publishing to a
mosquitto this script starts on loopback. Each run starts the recipe (bench/xid31.py:
one Xid 31, an MMU fault of an illegal write, in a child process; the GPU needs no reset),
then waits for the Xid's event and the other source's confirmation to be PUBACKed. Per run:

- which source raised the alert first (kmsg or nvml);
- for each source: when it saw the Xid (kmsg: the record's own kernel stamp; nvml: when the
  event thread got it), then its event stored (the transaction's commit) and PUBACKed;
- the alert: from the earlier sighting to the PUBACK of the first event.

The correlator's repeat holdoff (300 s for one GPU and code) is set to 0 here so that each run
raises its own event; runs are spaced by more than the 5 s correlation window. Use a few runs
per session, not a loop: each is a real fault in the driver's log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

from bench.kernel_log_latency import Timings, hook_store  # noqa: E402

CODE = 31
WAIT_PER_RUN = 20.0


def _broker(binary: str, lib: Path, work: Path) -> tuple[subprocess.Popen[bytes], str]:
    from tests.support.ports import free_port, wait_for_port

    port = free_port()
    conf = work / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n")
    env = dict(os.environ)
    if lib.is_dir():
        env["LD_LIBRARY_PATH"] = str(lib)
    process = subprocess.Popen([binary, "-c", str(conf)], stderr=subprocess.DEVNULL, env=env)
    wait_for_port(port)
    return process, f"mqtt://127.0.0.1:{port}"


def _trigger(python: str, recipe: Path) -> float:
    """Run the recipe; the wall time it launched the faulting kernel."""
    out = subprocess.run(
        [python, str(recipe)], check=False, capture_output=True, text=True, timeout=120
    )
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            return float(json.loads(line)["launched_wall"])
    raise RuntimeError(f"the recipe printed no launch time: {out.stdout!r} {out.stderr[-500:]!r}")


def _run_events(timings: Timings, launched: float) -> tuple[Any | None, list[Any]]:
    """The Xid event of this run (stored after the launch) and its follow-ups."""
    with timings.lock:
        events = [e for e in timings.events.values() if timings.stored[e.id] >= launched]
    first = next((e for e in events if e.kind == "xid" and e.attributes.get("xid") == CODE), None)
    if first is None:
        return None, []
    follow = [e for e in events if e.attributes.get("confirms") == first.id]
    return first, follow


def _sightings(first: Any, follow: list[Any]) -> dict[str, Any]:
    """source -> the event that source's sighting made (its time is the sighting's)."""
    out = {str(first.attributes["sources"]): first}
    for event in follow:
        out.setdefault(str(event.attributes["source_now"]), event)
    return out


async def _measure(args: argparse.Namespace, url: str, work: Path) -> list[dict[str, Any]]:
    from agent.program import config_file, registry
    from agent.runtime import logs
    from agent.runtime.core import Runtime
    from agent.runtime.state import StateStore
    from collectors._xid import XidCorrelator

    logs.configure("warning", stream=open(os.devnull, "w"), json=True)  # noqa: SIM115
    keep = ("kernel_log", "gpu")
    others = {n: {"enabled": False} for n in registry.COLLECTORS if n not in keep}
    cfg = config_file.parse(
        {
            "node_id": "xid-bench",
            "state_dir": str(work / "state"),
            "prometheus": {"enabled": False},
            "collectors": others,
            "heartbeat": {"interval": 5.0},
            "mqtt": {"enabled": True, "url": url},
        }
    )
    store = StateStore.open(cfg.state_dir)
    timings = Timings()
    hook_store(store, timings)
    runtime = Runtime(cfg, store, collectors=registry.COLLECTORS, sinks=registry.SINKS)
    await runtime.start()
    rows: list[dict[str, Any]] = []
    try:
        await asyncio.sleep(5.0)  # the kmsg backlog read, NVML up, the event thread registered
        correlator = runtime.shared.get(XidCorrelator, XidCorrelator)
        correlator.holdoff = 0.0
        for run in range(args.runs):
            if run:
                await asyncio.sleep(correlator.window + 3.0)
            launched = await asyncio.to_thread(_trigger, args.python, args.recipe)
            started = time.monotonic()
            first: Any | None = None
            follow: list[Any] = []
            while time.monotonic() - started < WAIT_PER_RUN:
                await asyncio.sleep(0.1)
                first, follow = _run_events(timings, launched)
                delivered = first is not None and all(
                    e.id in timings.acked for e in [first, *follow]
                )
                # Done once the twin's confirmation is PUBACKed too, or when none came in a
                # window and a bit (the other source may not see this Xid).
                if delivered and (follow or time.monotonic() - started > correlator.window + 3):
                    break
            rows.append(_row(run, launched, first, follow, timings))
    finally:
        await runtime.stop()
        store.close()
    return rows


def _row(
    run: int, launched: float, first: Any | None, follow: list[Any], timings: Timings
) -> dict[str, Any]:
    row: dict[str, Any] = {"run": run + 1, "launched": launched}
    if first is None:
        row["error"] = f"no Xid {CODE} event within {WAIT_PER_RUN:.0f} s"
        return row
    row["first"] = first.attributes["sources"]
    for source, event in _sightings(first, follow).items():
        stored, acked = timings.stored.get(event.id), timings.acked.get(event.id)
        row[source] = {
            "seen": event.time - launched,
            "stored": None if stored is None else stored - event.time,
            "puback": None if acked is None else acked - event.time,
            "kind": event.kind,
        }
    earliest = min(row[s]["seen"] for s in ("kmsg", "nvml") if s in row) + launched
    acked = timings.acked.get(first.id)
    row["alert"] = None if acked is None else acked - earliest
    return row


def _fmt(value: float | None) -> str:
    return f"{value:8.3f}" if value is not None else f"{'-':>8}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", type=Path, default=HERE / "bench" / "xid31.py")
    parser.add_argument("--mosquitto", default="mosquitto", help="the broker binary")
    parser.add_argument(
        "--mosquitto-lib", type=Path, default=Path("/nonexistent"), help="its libraries' folder"
    )
    parser.add_argument("--python", default=sys.executable, help="the python that has CuPy")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        broker, url = _broker(args.mosquitto, args.mosquitto_lib, work)
        try:
            rows = asyncio.run(_measure(args, url, work))
        finally:
            broker.terminate()
            broker.wait(5)
    print(
        f"Xid {CODE} from {args.recipe.name}: seconds; 'seen' from the launch, the rest from "
        "that source's sighting"
    )
    print(
        f"{'run':>3} {'first':>5} | {'kmsg seen':>9} {'stored':>8} {'PUBACK':>8} | "
        f"{'nvml seen':>9} {'stored':>8} {'PUBACK':>8} | {'alert':>8}"
    )
    for row in rows:
        if "error" in row:
            print(f"{row['run']:>3} {row['error']}")
            continue
        cells = []
        for source in ("kmsg", "nvml"):
            got = row.get(source)
            cells.append(
                " ".join(_fmt(got and got[k]) for k in ("seen", "stored", "puback"))
                if got
                else f"{'not seen':>9} {'-':>8} {'-':>8}"
            )
        print(f"{row['run']:>3} {row['first']:>5} | {cells[0]} | {cells[1]} | {_fmt(row['alert'])}")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
