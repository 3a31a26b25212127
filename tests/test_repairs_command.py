"""`gpuwarden repairs`: the requirements the running agent holds, and their end by a person's
word (a GPU replaced, an inspection done: findings with no all-clear of their own).

On a real runtime and its control socket, on the real state store; the command line against
a missing agent; Slurm's resume of a node drained for a cleared requirement is in
tests/test_actions_slurm.py."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.contracts.model import Event, RepairAction, Severity
from agent.program.control_client import request
from agent.runtime.core import Runtime
from agent.runtime.repairs import RepairLedger
from agent.runtime.state import StateStore
from tests.support.agent_proc import run_gpuwarden
from tests.support.control import controlled_runtime
from tests.support.waiting import until

R = RepairAction


def finding(kind: str, action: RepairAction, subject: str, source: str = "kernel_log") -> Event:
    return Event(
        source,
        kind,
        Severity.CRITICAL,
        f"{kind} on {subject}",
        subject=subject,
        repair_action=action,
    )


@dataclasses.dataclass
class Agent:
    runtime: Runtime
    state_dir: Path
    events: list[Event]

    async def ask(self, payload: dict[str, Any]) -> dict[str, Any]:
        return await asyncio.to_thread(request, self.state_dir, payload, 30.0)

    def held(self) -> set[tuple[str, str, str]]:
        return {(r.action.value, r.kind, r.subject) for r in self.runtime.repairs()}


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[Agent]:
    state_dir = tmp_path / "state"
    async with controlled_runtime(state_dir) as runtime:
        events: list[Event] = []
        runtime.subscribe(events.append)
        for event in (
            finding("xid", R.REBOOT_NODE, "GPU-old"),
            finding("xid", R.HARDWARE_INSPECTION, "GPU-old"),
            finding("row_remap_failure", R.HARDWARE_INSPECTION, "GPU-old", source="gpu"),
            finding("xid", R.RESET_GPU, "GPU-2"),
            finding("filesystem_space_low", R.CHECK_STORAGE, "/data", source="disk"),
        ):
            runtime.emit(event)
        await runtime.settle()
        yield Agent(runtime, state_dir, events)


class TestList:
    async def test_what_is_held(self, agent: Agent) -> None:
        reply = await agent.ask({"op": "repairs"})
        assert reply["ok"]
        listed = {(r["action"], r["kind"], r["subject"]) for r in reply["repairs"]}
        assert listed == agent.held()
        assert len(listed) == 5


class TestClear:
    async def test_by_subject_and_kind_with_the_reason_kept(self, agent: Agent) -> None:
        reply = await agent.ask(
            {
                "op": "clear_repairs",
                "subject": "GPU-old",
                "kind": "xid",
                "reason": "GPU replaced, RMA 1234",
                "by": "alice",
            }
        )
        assert reply["ok"], reply
        # Both of the finding kind on that subject: what the all-clear event ends.
        assert {(r["action"], r["subject"]) for r in reply["cleared"]} == {
            ("reboot_node", "GPU-old"),
            ("hardware_inspection", "GPU-old"),
        }
        # Taken in before the answer: an action (Slurm) has seen it too.
        assert agent.held() == {
            ("hardware_inspection", "row_remap_failure", "GPU-old"),
            ("reset_gpu", "xid", "GPU-2"),
            ("check_storage", "filesystem_space_low", "/data"),
        }
        assert len(reply["held"]) == 3
        (event,) = [e for e in agent.events if e.kind == "repair_cleared"]
        assert (event.source, event.subject, event.clears) == ("kernel_log", "GPU-old", ("xid",))
        assert event.attributes["reason"] == "GPU replaced, RMA 1234"
        assert "alice" in str(event.attributes["by"])
        assert "GPU replaced" in event.message

    async def test_by_action_across_sources(self, agent: Agent) -> None:
        reply = await agent.ask(
            {"op": "clear_repairs", "action": "HARDWARE_INSPECTION", "reason": "reseated"}
        )
        assert {(r["kind"], r["subject"]) for r in reply["cleared"]} == {
            ("row_remap_failure", "GPU-old"),
            # the Xid's hardware_inspection goes with the Xid's other requirement: one kind
            ("xid", "GPU-old"),
        }
        assert agent.held() == {
            ("reset_gpu", "xid", "GPU-2"),
            ("check_storage", "filesystem_space_low", "/data"),
        }

    async def test_all(self, agent: Agent) -> None:
        reply = await agent.ask({"op": "clear_repairs", "all": True, "reason": "new node image"})
        assert len(reply["cleared"]) == 5
        assert agent.held() == set()
        assert reply["held"] == []

    async def test_a_gpu_by_its_pci_address(self, agent: Agent) -> None:
        """A GPU's finding named by UUID is found by the PCI address it also goes by."""
        named = finding("xid", R.RESET_GPU, "GPU-7", source="gpu")
        agent.runtime.emit(dataclasses.replace(named, aliases=("0000:3b:00.0",)))
        reply = await agent.ask(
            {"op": "clear_repairs", "subject": "0000:3b:00.0", "reason": "GPU replaced"}
        )
        assert [(r["subject"], r["aliases"]) for r in reply["cleared"]] == [
            ("GPU-7", ["0000:3b:00.0"])
        ]
        assert len(agent.held()) == 5

    async def test_a_raise_still_on_its_way_is_cleared_before_the_answer(
        self, agent: Agent
    ) -> None:
        """A slow disk holds the raise in the store writer when the clear is asked: the
        answer waits until both are taken in, so no reader of the ledger sees it after."""
        writing, release = threading.Event(), threading.Event()
        flush = agent.runtime.guard.flush

        def slow_flush(outbox: bool) -> bool:
            writing.set()
            release.wait(10)
            return flush(outbox)

        agent.runtime.guard.flush = slow_flush  # type: ignore[method-assign]
        agent.runtime.emit(finding("xid", R.RESET_GPU, "GPU-7", source="gpu"))
        assert await asyncio.to_thread(writing.wait, 10)
        threading.Timer(0.3, release.set).start()
        reply = await agent.ask({"op": "clear_repairs", "subject": "GPU-7", "reason": "x"})
        assert [r["subject"] for r in reply["cleared"]] == ["GPU-7"]
        announced = [(e.kind, e.subject) for e in agent.events if e.subject == "GPU-7"]
        assert announced == [("xid", "GPU-7"), ("repair_cleared", "GPU-7")]
        assert len(agent.held()) == 5

    async def test_nothing_matches(self, agent: Agent) -> None:
        reply = await agent.ask({"op": "clear_repairs", "subject": "GPU-9", "reason": "x"})
        assert reply == {"ok": True, "cleared": [], "held": reply["held"]}
        assert len(agent.held()) == 5

    async def test_kept_across_a_restart(self, agent: Agent) -> None:
        await agent.ask({"op": "clear_repairs", "subject": "/data", "reason": "freed space"})

        def on_disk() -> set[str]:  # what an agent restarted now would hold
            reopened = StateStore.open(agent.state_dir)
            try:
                return {r.subject for r in RepairLedger(reopened, "boot-a").active()}
            finally:
                reopened.close()

        await until(lambda: on_disk() == {"GPU-old", "GPU-2"}, what="the clear stored")

    @pytest.mark.parametrize(
        ("payload", "words"),
        [
            ({"reason": "x"}, "name what to clear"),
            ({"subject": "GPU-2"}, "reason: say why"),
            ({"subject": "GPU-2", "reason": "  "}, "reason: say why"),
            ({"subject": 7, "reason": "x"}, "subject: expected a non-empty string"),
            ({"action": "reboot", "reason": "x"}, "unknown repair action 'reboot'"),
            ({"all": "yes", "reason": "x"}, "all: expected true or false"),
        ],
    )
    async def test_refused_with_nothing_cleared(
        self, agent: Agent, payload: dict[str, Any], words: str
    ) -> None:
        reply = await agent.ask({"op": "clear_repairs", **payload})
        assert not reply["ok"]
        assert words in reply["error"]
        assert len(agent.held()) == 5
        assert not [e for e in agent.events if e.kind == "repair_cleared"]


class TestCommandLine:
    @pytest.mark.parametrize(
        ("args", "words"),
        [
            (["clear", "--reason", "x"], "name what to clear"),
            (["clear", "--subject", "GPU-2"], "--reason is required"),
            (["--subject", "GPU-2"], "go with 'clear'"),
        ],
    )
    def test_usage_errors(self, tmp_path: Path, args: list[str], words: str) -> None:
        done = run_gpuwarden("repairs", *args, "--state-dir", str(tmp_path))
        assert done.returncode == 2, done.stdout + done.stderr
        assert words in done.stderr

    def test_no_agent_running(self, tmp_path: Path) -> None:
        done = run_gpuwarden("repairs", "--state-dir", str(tmp_path))
        assert done.returncode == 1
        assert "gpuwarden repairs:" in done.stderr
