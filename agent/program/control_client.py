"""The client side of the agent's control socket (agent/program/control.py): what `gpuwarden
pause` and `resume` use. Loads nothing of the agent: a command that only talks to it must not
pay for the runtime's imports."""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

SOCKET_NAME: Final = "control.sock"
_SUN_PATH_MAX: Final = 107
"""sun_path holds 108 bytes with its NUL; a longer path is reached through its directory's fd."""


class ControlError(Exception):
    """The agent could not be reached, or did not answer."""


def socket_path(state_dir: Path) -> Path:
    return state_dir / SOCKET_NAME


@contextlib.contextmanager
def reachable(path: Path) -> Iterator[str]:
    """A name for `path` that fits in sun_path: itself, or /proc/self/fd/<dir>/<name>."""
    text = str(path)
    if len(text.encode()) <= _SUN_PATH_MAX:
        yield text
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def _not_there(state_dir: Path, what: str) -> str | None:
    """The error for an agent that runs while its socket is not there, or None when no
    agent of this state dir can be seen running."""
    pid = running_agent(state_dir)
    if pid is None:
        return None
    return (
        f"the agent runs (pid {pid}) but its control socket is not there ({what}): its health "
        "says why (/healthz, the heartbeat, systemctl status gpuwarden); it binds the socket "
        "again by itself once it can"
    )


def running_agent(state_dir: Path, proc: Path = Path("/proc")) -> int | None:
    """The pid of a `run` process holding a file of `state_dir` open (the agent holds the
    directory itself open while its control socket runs: ControlServer), or None: none,
    or none this user may look at (another user's /proc/<pid>/fd is not readable)."""
    where = os.path.realpath(state_dir)
    try:
        pids = [int(name) for name in os.listdir(proc) if name.isdigit()]
    except OSError:
        return None
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            argv = (proc / str(pid) / "cmdline").read_bytes().split(b"\0")
            if b"run" not in argv:
                continue
            fds = proc / str(pid) / "fd"
            for fd in os.listdir(fds):
                with contextlib.suppress(OSError):
                    target = os.readlink(fds / fd)
                    if target == where or target.startswith(where + "/"):
                        return pid
        except OSError:  # gone meanwhile, or not ours to look at
            continue
    return None


def request(state_dir: Path, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Send one request to the agent whose state directory this is; its reply."""
    path = socket_path(state_dir)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            with reachable(path) as name:
                sock.connect(name)
        except FileNotFoundError:
            raise ControlError(
                _not_there(state_dir, f"no {path}")
                or f"no agent is running with state directory {state_dir} (no {path}): start it "
                "(systemctl start gpuwarden), or name its configuration with --config"
            ) from None
        except ConnectionRefusedError:
            raise ControlError(
                _not_there(state_dir, f"{path} refuses connections")
                or f"{path} refuses connections: the agent is not running"
            ) from None
        except BlockingIOError:  # EAGAIN: a listener whose queue is full
            raise ControlError(
                f"{path} takes no more connections (its queue is full): the agent is busy or "
                "out of files, or another process listens there; try again shortly"
            ) from None
        except PermissionError:
            raise ControlError(
                f"permission denied on {path}: run this as root or as the agent's user"
            ) from None
        sock.sendall(json.dumps(payload).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except TimeoutError:
        raise ControlError(f"the agent did not answer within {timeout:g} s") from None
    finally:
        sock.close()
    try:
        reply = json.loads(data)
    except ValueError:
        raise ControlError(f"the agent's answer is not JSON: {data[:200]!r}") from None
    if not isinstance(reply, dict):
        raise ControlError(f"the agent's answer is not an object: {data[:200]!r}")
    return reply
