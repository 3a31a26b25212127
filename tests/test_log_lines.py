"""Log lines a person reads: no field that says `None`, and no traceback for a failure the agent
expects (a collector refused access to what it reads) - one line with what to do instead."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from agent.runtime import logs
from agent.runtime.core import _log_failure
from agent.runtime.rounds import Failure, RoundOutcome
from collectors.kernel_log.kmsg import KernelLogError
from tests.support.agent_proc import REPO, AgentProcess
from tests.support.waiting import wait_until


@pytest.fixture
def restore_logging() -> Iterator[None]:
    yield
    structlog.reset_defaults()


@pytest.mark.parametrize("as_json", [True, False])
def test_none_fields_are_left_out(as_json: bool, restore_logging: None) -> None:
    """The watcher logged `node=None` for a broker-wide alert; no field of any log line may
    read None (or null): an absent value is left out."""
    stream = io.StringIO()
    logs.configure("debug", stream=stream, json=as_json)
    log = structlog.get_logger(component="test")
    log.warning("alert raised", kind="all_quiet", node=None, severity="critical", count=0)
    log.info("nested", detail={"gpu": None, "ok": 1})
    text = stream.getvalue()
    assert "None" not in text and "null" not in text, text
    assert "all_quiet" in text and "critical" in text
    if as_json:
        first, second = (json.loads(line) for line in text.splitlines())
        assert "node" not in first and first["count"] == 0
        assert second["detail"] == {"ok": 1}


def _unprivileged() -> list[str]:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root to become an unprivileged user (setpriv)")
    prefix = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
    # The user must be able to run this interpreter and read the checkout (a venv under
    # root's 0700 home is not): otherwise there is nothing to test here.
    probe = subprocess.run(
        [*prefix, sys.executable, "-c", "import agent.program.cli"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        check=False,
    )
    if probe.returncode != 0:
        pytest.skip(f"nobody cannot run {sys.executable} on {REPO}: {probe.stderr[-200:]!r}")
    return prefix


def test_unprivileged_agent_logs_one_line_with_the_action() -> None:
    """`make run` as a normal user: /dev/kmsg is refused. The embedded defaults with a state
    dir of the user's own: the agent starts, says in one line what cannot be read and what to
    do, and prints no Python traceback, for any collector."""
    prefix = _unprivileged()
    # Under /tmp, not pytest's tmp_path: that sits in root's 0700 directory.
    workdir = Path(tempfile.mkdtemp(prefix="gpuwarden-unprivileged-"))
    workdir.chmod(0o777)
    agent = AgentProcess(workdir, prefix=prefix)
    try:
        agent.start(timeout=30.0)
        wait_until(lambda: "kernel_log" in agent.log(), 20.0, "the kernel_log collector's line")
        agent.signal(signal.SIGINT)
        assert agent.process is not None
        assert agent.process.wait(15) == 0
        text = agent.log()
    finally:
        agent.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    assert "Traceback" not in text, text
    lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    kmsg = [line for line in lines if line.get("collector") == "kernel_log"]
    assert len(kmsg) == 1, kmsg
    assert "/dev/kmsg" in kmsg[0]["error"]
    assert "CAP_SYSLOG" in kmsg[0]["action"]
    for line in lines:
        assert "None" not in json.dumps(line) and None not in line.values(), line


@pytest.mark.parametrize(
    ("raised", "traceback"),
    [
        (PermissionError(13, "Permission denied", "/sys/class/x"), False),
        (KernelLogError("cannot open /dev/kmsg", "run it as root"), False),
        (RuntimeError("a bug"), True),
    ],
)
def test_a_round_failure_is_one_line_unless_a_bug(
    raised: Exception, traceback: bool, restore_logging: None
) -> None:
    """Refused access and gpuwarden's own errors: one line with the action; anything else
    keeps its traceback, to be reported."""
    stream = io.StringIO()
    logs.configure("info", stream=stream, json=True)
    try:
        raise raised
    except Exception as exc:
        outcome = RoundOutcome(
            error=f"{type(exc).__name__}: {exc}", failure=Failure.RAISED, exception=exc
        )
    _log_failure(structlog.get_logger(collector="c"), outcome)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert ("Traceback" in stream.getvalue()) is traceback
    if not traceback:
        (line,) = lines
        assert line["action"]
        if isinstance(raised, PermissionError):
            assert "/sys/class/x" in line["action"]
