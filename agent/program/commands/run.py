"""Run the agent in the foreground until SIGTERM or SIGINT; SIGHUP reloads the configuration;
`gpuwarden pause` and `resume` reach it on its control socket (agent/program/control.py).

Exit code 0 after a clean stop, 1 if the agent could not start (a port taken, say), 2 for a
configuration error.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import functools
import os
import signal
import sys
import threading
import time
from pathlib import Path

import structlog

from agent.contracts.errors import ConfigError
from agent.program import config_file as config_module
from agent.program import config_loader, registry
from agent.program.control import ControlServer
from agent.program.control_client import socket_path
from agent.program.hangup import HANGUPS
from agent.runtime import logs, spill
from agent.runtime.core import Runtime, cancel_tasks
from agent.runtime.state import StateStore
from agent.runtime.systemd import Notifier, run_watchdog, watchdog_interval
from collectors._procfs import read_boot_id

log = structlog.get_logger(component="run")

FIRST_ROUND_WAIT = 30.0
"""READY=1 waits for the first round of every collector, but not forever."""
STOP_BUDGET = 4.0
"""SIGTERM to the runtime's end: then the spill, if any (SPILL_BUDGET), and the exit."""
SPILL_BUDGET = 3.0
"""Seconds a spill at the stop may take (a tmpfs takes 100k outbox entries in 0.16 s,
bench/state_spill.py): with STOP_BUDGET, inside the unit's TimeoutStopSec=10s."""
SETTLE = config_loader.SETTLE
SETTLE_BOUND = config_loader.SETTLE_BOUND
START_AGAIN = "start the agent again once it is written"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-format",
        choices=("auto", "json", "console"),
        default="auto",
        help="auto: JSON lines unless stdout is a terminal",
    )


def main(args: argparse.Namespace) -> int:
    try:
        # As a reload reads it: a file being written as the agent starts (Ansible, an editor)
        # is read once it is finished, not half.
        cfg = load_settled(args.config, again=START_AGAIN)
    except ConfigError as exc:
        print(f"gpuwarden: configuration error: {exc}", file=sys.stderr)
        return 2
    json_logs = {"auto": None, "json": True, "console": False}[args.log_format]
    logs.configure(cfg.core.log_level, json=json_logs)
    code, hung = asyncio.run(serve(cfg, args.config))
    if hung:
        exit_now(code)
    return code


def exit_now(code: int) -> None:
    """Exit without joining worker threads. A thread stuck in a driver or on a dead mount
    cannot be stopped, and the interpreter would wait for it at exit (concurrent.futures joins
    its workers) until systemd's SIGKILL. Called after the state store is closed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


async def serve(cfg: config_module.Config, path: Path | None) -> tuple[int, int]:
    """Run until SIGTERM/SIGINT. Returns the exit code and the number of calls still hung."""
    loop = asyncio.get_running_loop()
    log.info("starting", config=cfg.source, node=cfg.node_id, state_dir=str(cfg.state_dir))
    store, adopted, boot_id = await asyncio.to_thread(_open_store, cfg)
    runtime = Runtime(
        cfg, store, collectors=registry.COLLECTORS, sinks=registry.SINKS, boot_id=boot_id
    )
    notifier = Notifier()
    stop = asyncio.Event()
    reloads: asyncio.Queue[None] = asyncio.Queue()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    # Not the loop's own signal handler: that one goes back to SIGHUP's default (the end of
    # the process) when the loop closes. One noted since the command began is a reload now.
    HANGUPS.install()
    HANGUPS.attach(loop, functools.partial(reloads.put_nowait, None))
    _take_over(runtime, store, adopted, cfg)
    try:
        await runtime.start()
    except OSError as exc:
        log.error("cannot start", error=str(exc))
        await runtime.stop()
        stuck = await _spill(runtime, store, cfg)
        store.close()
        HANGUPS.ignore()
        return 1, runtime.calls_outstanding() + stuck
    control = ControlServer(
        runtime, socket_path(cfg.state_dir), hangs=functools.partial(_state_dir_hangs, runtime)
    )
    if _state_dir_hangs(runtime):
        control.keep()  # said in health, bound once the store is on the disk again
    else:
        # The agent still watches without it; only pause and resume cannot reach it. Said
        # (logged, a health problem) and tried again until it binds (ControlServer.check).
        with contextlib.suppress(OSError):
            await control.start()
    helpers = [asyncio.create_task(_reload_loop(runtime, path, reloads))]
    if await _first_round_or_stop(runtime, stop):
        notifier.ready(runtime.health().summary())
        log.info("ready", collectors=sorted(runtime.collectors), sinks=sorted(runtime.sinks))
    interval = watchdog_interval()
    helpers.append(
        asyncio.create_task(
            run_watchdog(
                notifier, runtime.supervisor, interval or 10.0, lambda: runtime.health().summary()
            )
            if interval
            else _status_loop(notifier, runtime)
        )
    )
    await stop.wait()
    began = time.monotonic()
    log.info("stopping: signal received")
    notifier.stopping()
    # Before the runtime stops: a reload cut short closes what it built and never ran, and
    # starts nothing after the stop began.
    await cancel_tasks(helpers)
    await control.stop()
    try:
        await asyncio.wait_for(runtime.stop(), STOP_BUDGET)
    except TimeoutError:
        log.warning("some tasks did not stop in time; exiting anyway")
    stuck = await _spill(runtime, store, cfg)
    store.close()
    notifier.close()
    HANGUPS.ignore()  # from here to the exit: nothing is left to reload
    # Hung calls, and calls the stop cancelled while they ran: the interpreter would wait for
    # each of those threads at exit.
    hung = runtime.calls_outstanding() + stuck
    log.info("stopped", seconds=round(time.monotonic() - began, 3), hung_calls=hung)
    return 0, hung


def _open_store(cfg: config_module.Config) -> tuple[StateStore, list[spill.Adopted], str]:
    """The state store, bounded (a state dir on a mount that hangs must not keep the agent
    from starting), with what the last clean stop could not store adopted into it before
    anything reads it (the runtime's counts, the collectors' cursors): a disk too full for
    that puts the store in memory. And this boot's id, which the spills are judged by."""
    boot_id = _boot_id()
    store = StateStore.open_within(cfg.state_dir, cfg.core.state_open_timeout)
    store, adopted = spill.adopt_all(store, cfg.core.runtime_dir, boot_id=boot_id)
    return store, adopted, boot_id


def _take_over(
    runtime: Runtime, store: StateStore, adopted: list[spill.Adopted], cfg: config_module.Config
) -> None:
    """What the spills found at start gave, told (stored and sent once the runtime starts,
    as its start problems). While the store is not durable (in memory, or its disk refusing writes), a spill in
    the runtime dir kept up to date: a kill -9 then loses only what changed within its
    delay (agent/runtime/spill.py `LiveSpill`)."""
    for report in adopted:
        runtime.emit(report.event(str(cfg.state_dir)))
    runtime.live_spill = spill.LiveSpill(
        store,
        runtime.guard,
        cfg.core.runtime_dir,
        boot_id=runtime.boot_id,
        outbox=lambda: runtime.outbox_enabled,
    )
    runtime.live_spill.start()


async def _spill(runtime: Runtime, store: StateStore, cfg: config_module.Config) -> int:
    """What the store could not take (a full disk, a store in memory) into the runtime dir
    (agent/runtime/spill.py), in a thread of its own given SPILL_BUDGET seconds: a stop
    stays inside systemd's TimeoutStopSec. Returns 1 if the thread is still stuck. The
    spill kept while running stops first; the stop's spill replaces it (or, with nothing
    left unsaved, it goes)."""
    if runtime.live_spill is not None:
        await asyncio.to_thread(runtime.live_spill.stop)
    if not spill.needed(store, runtime.guard):
        store.drop_held_files()  # durable and holding all: a spill written meanwhile goes
        return 0
    done: concurrent.futures.Future[spill.Spilled] = concurrent.futures.Future()

    def write() -> None:
        try:
            done.set_result(
                spill.write(
                    store,
                    runtime.guard,
                    cfg.core.runtime_dir,
                    boot_id=runtime.boot_id,
                    outbox=runtime.outbox_enabled,
                )
            )
        except BaseException as exc:  # handed to the waiter, whatever it is
            done.set_exception(exc)

    threading.Thread(target=write, name="state-spill", daemon=True).start()
    try:
        await asyncio.wait_for(asyncio.wrap_future(done), SPILL_BUDGET)
    except TimeoutError:
        log.error(
            "unsaved state not spilled within the stop's time; it is lost with this stop",
            runtime_dir=str(cfg.core.runtime_dir),
            seconds=SPILL_BUDGET,
            events_lost=runtime.guard.queued_events,
            values_lost=runtime.guard.queued_values,
        )
        return 1
    except Exception:
        log.exception("unsaved state not spilled; it is lost with this stop")
    return 0


def _state_dir_hangs(runtime: Runtime) -> bool:
    """The state store is in memory because its state dir hangs (not since gone back)."""
    store = runtime.store
    return not store.durable and any(p.kind == "state_store_hung" for p in store.problems)


def _boot_id() -> str:
    """This boot's id: the repair ledger drops what a reboot performed. Empty where /proc
    lacks it (then nothing is taken as done by a reboot)."""
    try:
        return read_boot_id(Path("/proc"))
    except OSError:
        return ""


async def _first_round_or_stop(runtime: Runtime, stop: asyncio.Event) -> bool:
    """Wait for every collector's first round (READY=1 follows it), a stop signal, or
    FIRST_ROUND_WAIT. False when asked to stop meanwhile."""
    waiters = [asyncio.create_task(runtime.first_round.wait()), asyncio.create_task(stop.wait())]
    await asyncio.wait(waiters, timeout=FIRST_ROUND_WAIT, return_when=asyncio.FIRST_COMPLETED)
    for task in waiters:
        task.cancel()
    if stop.is_set():
        return False
    if not runtime.first_round.is_set():
        log.warning("first collection round still running; reporting ready anyway")
    return True


async def _status_loop(notifier: Notifier, runtime: Runtime) -> None:
    while True:
        notifier.status(runtime.health().summary())
        await asyncio.sleep(10.0)


async def _reload_loop(runtime: Runtime, path: Path | None, reloads: asyncio.Queue[None]) -> None:
    """One reload per SIGHUP. Nothing a file can do ends this loop: every failure keeps the
    running configuration and is logged, and the next SIGHUP is honoured."""
    while True:
        await reloads.get()
        # The SIGHUPs that came before this read are answered by it (a burst is one reload;
        # each waits for the file to settle); one that comes during it is another.
        while not reloads.empty():
            reloads.get_nowait()
        await _reload_once(runtime, path)


def load_settled(
    path: Path | None,
    quiet: float = SETTLE,
    bound: float = SETTLE_BOUND,
    again: str = "send SIGHUP again once it is written",
) -> config_module.Config:
    """Load the file once it is written (config_loader.settled): the start reads this way,
    and so does every reload. A file still changing after `bound` seconds is refused
    (ConfigError): a reload keeps the running configuration, a start exits 2."""
    return config_loader.settled(
        path, lambda: config_module.load(path), quiet=quiet, bound=bound, again=again
    )


async def _reload_once(runtime: Runtime, path: Path | None) -> None:
    try:
        new = await asyncio.to_thread(load_settled, path)
    except ConfigError as exc:
        _refused(runtime, str(exc))
        return
    except Exception as exc:  # load() names what it knows; anything else is still a bad file
        log.exception("unexpected error while loading the configuration")
        _refused(runtime, f"{type(exc).__name__}: {exc} ({path or 'the default file'})")
        return
    try:
        report = await runtime.reload(new)
    except Exception as exc:
        log.exception("reload failed part way; later SIGHUPs are still honoured")
        _refused(runtime, f"{type(exc).__name__}: {exc}")
        return
    log.info("configuration reloaded", source=new.source, changes=list(report.applied) or ["none"])
    if report.pending_restart:
        log.warning(
            "configuration change pending restart: not applied until the agent restarts",
            keys=list(report.pending_restart),
        )
    if report.unused:
        log.info("changed keys the agent does not read", keys=list(report.unused))
    for failure in report.failed:
        log.error("collector not changed: its new settings could not be built", detail=failure)


def _refused(runtime: Runtime, reason: str) -> None:
    log.error("reload refused; keeping the old configuration", error=reason)
    runtime.reload_refused(reason)
