"""A pause asked again while in force (`gpuwarden pause` twice): every part is asked again, and
the answer is the truth now, not what the first pause said.

The class under test: a part of the agent that did not let go of the GPUs the first time (an
NVML call that hangs in the driver, an NVML event thread stuck in the driver) is asked again
by the next `pause`; while it still holds on, the answer says so (not released), and once it
has let go the answer says released and the GPUs are released for real (NVML shut down, no
device file open). Before, a pause asked again only moved the deadline: it asked nobody and
answered what the first pause had said, so NVML stayed initialised for the whole pause after
the stuck call returned, and an operator who asked again was never told it could go ahead.

And what the deadline becomes (docs/pause.md, "The deadline, restarts, reboots"): from now,
longer or shorter, `--for` or the default, as the reply, the gauges, the heartbeat, the store
and the deadline that ends it all say; a resume after extensions lifts every hold.

The real agent process is paused twice by the real command in tests/test_pause_process.py
(an NVML call hung) and tests/test_reload_bench_child.py (a benchmark child stuck in the
driver).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from agent.contracts.pause import PauseSettings
from agent.runtime import pause as pause_module
from agent.runtime.core import Runtime
from collectors.gpu.collector import GpuSettings
from exporters.heartbeat import heartbeat_payload
from tests.support.nvml import fake_gpus
from tests.support.nvml_fake import FakeGpu, FakeNvml
from tests.support.waiting import announced, until
from tests.test_pause_runtime import GPU, gauge, make_runtime, names, stop

T = TypeVar("T")


class GatedNvml(FakeNvml):
    """The fake NVML, whose event registration on one GPU can be made to hang (a GPU that
    hangs in the driver while the event thread registers it): `gate` unset blocks it."""

    def __init__(self, gpus: list[FakeGpu]) -> None:
        super().__init__(gpus)
        self.gate: threading.Event | None = None
        self.registering = 0

    def nvmlDeviceRegisterEvents(self, gpu: FakeGpu, mask: int, event_set: object) -> None:
        gate = self.gate
        if gate is not None and gpu is self.gpus[0]:
            self.registering += 1
            try:
                gate.wait()
            finally:
                self.registering -= 1
        super().nvmlDeviceRegisterEvents(gpu, mask, event_set)


@dataclass
class Holder:
    """One way for the gpu collector not to let go, and how it is made to hold on."""

    name: str
    settings: GpuSettings
    hold: Callable[[GatedNvml], threading.Event]
    """Make it hold on until the Event returned is set (before the agent starts)."""
    holding: Callable[[GatedNvml], bool]
    """It holds on now."""
    detail: str
    """What the pause says about it while it holds."""


def hung_call(fake: GatedNvml) -> threading.Event:
    """Every call on GPU 1 blocks: the first round's times out and stays in the driver."""
    gate = threading.Event()
    fake.gpus[1].hang = gate
    return gate


def stuck_thread(fake: GatedNvml) -> threading.Event:
    """The event thread's registration of GPU 0 blocks: it stays in the driver."""
    gate = threading.Event()
    fake.gate = gate
    return gate


HOLDERS = [
    Holder(
        "an NVML call hung in the driver",
        GPU.replace(timeout=0.3),
        hung_call,
        lambda fake: fake.gpus[1].calls.total() > 0,
        "has not returned",
    ),
    Holder(
        "an event thread stuck in the driver",
        GPU,
        stuck_thread,
        lambda fake: fake.registering == 1,
        "event thread did not stop",
    ),
]


@pytest.fixture(params=HOLDERS, ids=lambda h: h.name)
def holder(request: pytest.FixtureRequest) -> Holder:
    param: Holder = request.param
    return param


@pytest.fixture
async def agent(
    tmp_path: Path, holder: Holder
) -> AsyncIterator[tuple[Runtime, GatedNvml, threading.Event]]:
    fake = GatedNvml(fake_gpus(2))
    runtime = make_runtime(fake, tmp_path / "state", gpu=holder.settings)
    gate = holder.hold(fake)
    await runtime.start()
    try:
        await until(lambda: holder.holding(fake), what=f"{holder.name}")
        yield runtime, fake, gate
    finally:
        gate.set()
        await stop(runtime)


def gpu_answer(reply: Any) -> Any:
    (answer,) = [r for r in reply.released if r.component == "gpu"]
    return answer


class TestAPauseAskedAgain:
    async def test_a_part_that_did_not_let_go_is_asked_again(
        self, agent: tuple[Runtime, GatedNvml, threading.Event], holder: Holder
    ) -> None:
        runtime, fake, gate = agent
        first = await runtime.pause.pause(600.0, "reset GPU 1")
        assert not first.ok and not gpu_answer(first).released
        assert holder.detail in gpu_answer(first).detail
        assert fake.initialised == 1  # not shut down under what holds on

        # Asked again while it still holds on: not released, said now.
        again = await runtime.pause.pause(600.0)
        assert again.extended and not again.ok
        assert holder.detail in gpu_answer(again).detail
        assert fake.initialised == 1

        gate.set()  # the driver lets go
        for gpu in fake.gpus:
            gpu.hang = None
        fake.gate = None
        # Asked again once it has let go: released, for real.
        done = await runtime.pause.pause(600.0)
        assert done.extended and done.ok, [r.detail for r in done.released]
        assert "no NVIDIA device file open" in gpu_answer(done).detail
        assert fake.initialised == 0
        assert done.state.since == first.state.since
        status = runtime.collectors["gpu"]
        calls = sum(fake.lib_calls.values())
        rounds = status.rounds_done
        await until(lambda: status.rounds_done >= rounds + 3, what="paused rounds")
        assert sum(fake.lib_calls.values()) == calls  # nothing opens NVML again while paused
        said = [e.attributes["not_released"] for e in await announced(runtime, "gpu_paused", 3)]
        assert said == ["gpu", "gpu", ""]

        resumed = await runtime.pause.resume()
        assert resumed.resumed and resumed.waited_out == ()
        assert fake.initialised == 1 and not status.paused
        assert "gpuwarden_gpu_up" in names(runtime)


DEFAULT = 45.0


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (600.0, 60.0),  # shortened
        (60.0, 600.0),  # lengthened
        (600.0, None),  # the default after a --for
        (None, 600.0),  # a --for after the default
        (600.0, 1.0),  # shortened to less than a round of the deadline timer: it ends then
    ],
    ids=["shorter", "longer", "default-after-for", "for-after-default", "ends-soon"],
)
async def test_the_deadline_is_moved_from_now_and_said_everywhere(
    tmp_path: Path, first: float | None, second: float | None
) -> None:
    fake = FakeNvml(fake_gpus(2))
    settings = PauseSettings(default_duration=DEFAULT)
    runtime = make_runtime(fake, tmp_path / "state", pause=settings)
    await runtime.start()
    try:
        await until(lambda: "gpuwarden_gpu_up" in names(runtime), what="GPU series")
        one = await runtime.pause.pause(first, "reset")
        asked = time.time()
        two = await runtime.pause.pause(second)
        length = DEFAULT if second is None else second
        assert two.extended and two.ok
        assert two.state.since == one.state.since
        assert asked + length <= two.state.until <= time.time() + length
        assert two.state.reason == "reset"  # kept: the extension named no other
        assert gauge(runtime, "gpuwarden_gpu_paused") == 1
        assert gauge(runtime, "gpuwarden_gpu_pause_end_timestamp_seconds") == two.state.until
        payload = heartbeat_payload(
            runtime, seq=1, bdseq=1, now=time.time(), outbox_depth={}, outbox_dropped={}
        )
        beat = json.loads(payload)
        assert beat["paused"]["until_ts"] == round(two.state.until, 3)
        assert beat["paused"]["since_ts"] == round(one.state.since, 3)
        assert beat["paused"]["reason"] == "reset"
        stored = runtime.store.get("runtime", "gpu_pause")
        assert isinstance(stored, dict) and stored["until"] == two.state.until
        if length < 5:
            await until(lambda: runtime.pause_state() is None, timeout=10, what="the deadline")
            (ended,) = await announced(runtime, "gpu_resumed")
            assert ended.attributes["why"] == "deadline"
            assert ended.attributes["until_ts"] == round(two.state.until, 3)
            await until(lambda: "gpuwarden_gpu_up" in names(runtime), what="GPU series back")
        else:
            resumed = await runtime.pause.resume()
            assert resumed.resumed and resumed.waited_out == ()
            assert "gpuwarden_gpu_up" in names(runtime)
        assert gauge(runtime, "gpuwarden_gpu_paused") == 0
        assert fake.initialised == 1 and not runtime.collectors["gpu"].paused
        assert runtime.pause.released == {}
    finally:
        await stop(runtime)


class OpenCounting(FakeNvml):
    """The fake NVML, which notes every nvmlInit made while `forbidden` is set: between a
    pause that answered released and the next resume, nothing may open the GPUs."""

    def __init__(self, gpus: list[FakeGpu]) -> None:
        super().__init__(gpus)
        self.forbidden = False
        self.opened_while_paused = 0

    def nvmlInit(self) -> None:
        if self.forbidden:
            self.opened_while_paused += 1
        super().nvmlInit()


class Gate:
    """Holds one awaited step of the agent (an old instance's close, a new instance's first
    round) until `open`: the pause and resume requests land inside it."""

    def __init__(self) -> None:
        self.reached = asyncio.Event()
        self._open = asyncio.Event()

    def wrap(self, step: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
        async def held(*args: Any, **kwargs: Any) -> T:
            if not self._open.is_set():
                self.reached.set()
                await self._open.wait()
            return await step(*args, **kwargs)

        return held

    def open(self) -> None:
        self._open.set()


SEQUENCES = [("pause",), ("pause", "resume", "pause"), ("resume", "pause")]
"""What the operator asks while the reload is held; one starting with resume starts paused."""
WHERE = ["the old instance's close", "the new instance's first round"]


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("sequence", SEQUENCES, ids="-".join)
async def test_pause_and_resume_racing_a_reload_open_nothing_while_paused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str, sequence: tuple[str, ...]
) -> None:
    """A SIGHUP reload that restarts the gpu collector, held at one of its awaits while the
    operator pauses, resumes and pauses again: the last pause answers released, and from
    its answer until the resume nothing calls NVML, neither the old instance nor the new one
    (built before, started after, or in its first round then)."""
    # A resume while the new instance's first round is held here waits for that round, up
    # to the bound: shortened, this test is about what opens NVML, not about that wait.
    monkeypatch.setattr(pause_module, "FIRST_ROUND_BOUND", 1.0)
    fake = OpenCounting(fake_gpus(2))
    runtime = make_runtime(fake, tmp_path / "state")
    await runtime.start()
    gate = Gate()
    try:
        await until(lambda: "gpuwarden_gpu_up" in names(runtime), what="GPU series")
        if sequence[0] == "resume":
            assert (await runtime.pause.pause(600.0)).ok
        old = runtime.collectors["gpu"]
        if where == WHERE[0]:
            monkeypatch.setattr(old.collector, "close", gate.wrap(old.collector.close))
        else:
            build = runtime._build

            def gated(name: str, settings: Any) -> Any:
                collector = build(name, settings)
                if collector is not None:
                    monkeypatch.setattr(collector, "collect", gate.wrap(collector.collect))
                return collector

            monkeypatch.setattr(runtime, "_build", gated)
        changed = dataclasses.replace(
            runtime.config, collectors={"gpu": GPU.replace(interval=0.15)}
        )
        reload = asyncio.ensure_future(runtime.reload(changed))
        await asyncio.wait_for(gate.reached.wait(), 20)
        for step in sequence:
            if step == "pause":
                reply = await runtime.pause.pause(600.0, "reset")
                assert reply.ok, [r.detail for r in reply.released]
                fake.forbidden = True
            else:
                fake.forbidden = False
                assert (await runtime.pause.resume()).resumed
        gate.open()
        assert not (await reload).failed
        status = runtime.collectors["gpu"]
        assert status is not old
        calls = sum(fake.lib_calls.values())
        rounds = status.rounds_done
        await until(lambda: status.rounds_done >= rounds + 3, what="rounds of the new instance")
        assert status.paused
        assert sum(fake.lib_calls.values()) == calls
        assert fake.initialised == 0 and fake.opened_while_paused == 0
        assert "gpuwarden_gpu_up" not in names(runtime)

        fake.forbidden = False
        resumed = await runtime.pause.resume()
        assert resumed.resumed and resumed.waited_out == ()
        assert fake.initialised == 1 and "gpuwarden_gpu_up" in names(runtime)
    finally:
        gate.open()
        await stop(runtime)


@pytest.mark.parametrize(
    "change",
    ["restarted", "restarted, the new instance's first round held", "stopped"],
)
async def test_a_resume_during_a_reload_waits_for_the_instance_that_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    """`gpuwarden resume` while a reload replaces the gpu collector (or stops it) answers
    with the first round of the instance that runs after it. Before, it waited for a round
    of the instance being retired, which never came: FIRST_ROUND_BOUND (20 s) later it said
    the collector's first round was waited out, and reported nothing the round found."""
    fake = FakeNvml(fake_gpus(2))
    runtime = make_runtime(fake, tmp_path / "state")
    await runtime.start()
    gate = Gate()
    try:
        await until(lambda: "gpuwarden_gpu_up" in names(runtime), what="GPU series")
        assert (await runtime.pause.pause(600.0)).ok
        old = runtime.collectors["gpu"]
        if change == "restarted, the new instance's first round held":
            build = runtime._build

            def gated(name: str, settings: Any) -> Any:
                collector = build(name, settings)
                if collector is not None:
                    monkeypatch.setattr(collector, "collect", gate.wrap(collector.collect))
                return collector

            monkeypatch.setattr(runtime, "_build", gated)
        else:
            monkeypatch.setattr(old.collector, "close", gate.wrap(old.collector.close))
        gpu = GPU.replace(interval=0.15, enabled=change != "stopped")
        reload = asyncio.ensure_future(
            runtime.reload(dataclasses.replace(runtime.config, collectors={"gpu": gpu}))
        )
        await asyncio.wait_for(gate.reached.wait(), 20)
        gone = fake.gpus.pop()  # the reset left one GPU out: the first round says so
        resume = asyncio.ensure_future(runtime.pause.resume())
        await until(lambda: runtime.pause_state() is None, what="the hold lifted")
        gate.open()
        reply = await resume
        await reload
        assert reply.resumed and reply.waited_out == ()
        if change == "stopped":
            assert "gpu" not in runtime.collectors and reply.first_round == {}
        else:
            assert reply.first_round.keys() == {"gpu"}
            if change == "restarted":  # the new instance, never paused, counts the GPUs
                critical = {
                    (e.kind, e.subject)
                    for e in reply.first_round["gpu"]
                    if e.severity.label == "critical"
                }
                assert ("gpu_count_dropped", "host") in critical or (
                    "gpu_lost",
                    gone.uuid,
                ) in critical, [e.message for e in reply.first_round["gpu"]]
            assert runtime.collectors["gpu"] is not old
            assert fake.initialised == 1 and "gpuwarden_gpu_up" in names(runtime)
    finally:
        gate.open()
        await stop(runtime)


async def test_a_paused_round_that_ends_across_the_resume_is_not_its_first_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round that began paused (no NVML call, no event) and ended while `resume` lifted
    the hold was taken for the first round after it: the command reported nothing, and a
    GPU the reset left out went unsaid (exit 0). The first round is one that began after the
    collector was resumed.

    Made to happen: the paused round is held after it returned (not yet counted) until the
    collector is resumed; the round after it is held before it starts until the resume has
    looked at the rounds twice since (or answered, as it did before)."""
    fake = FakeNvml(fake_gpus(2))
    runtime = make_runtime(fake, tmp_path / "state")
    await runtime.start()
    paused_round, resumed = asyncio.Event(), asyncio.Event()
    next_round, go = asyncio.Event(), asyncio.Event()
    looks = [0]
    try:
        await until(lambda: "gpuwarden_gpu_up" in names(runtime), what="GPU series")
        assert (await runtime.pause.pause(600.0)).ok
        status = runtime.collectors["gpu"]
        collect = status.collector.collect
        rounds = [0]

        async def held(ctx: Any) -> Any:
            rounds[0] += 1
            if rounds[0] == 2:  # the round after the paused one: held before it begins
                next_round.set()
                await go.wait()
            result = await collect(ctx)
            if rounds[0] == 1:  # paused: returned at once, empty; held before it is counted
                paused_round.set()
                await resumed.wait()
            return result

        monkeypatch.setattr(status.collector, "collect", held)
        look = runtime.pause._collectors

        def counted() -> Any:
            looks[0] += 1
            return look()

        monkeypatch.setattr(runtime.pause, "_collectors", counted)
        await asyncio.wait_for(paused_round.wait(), 20)
        gone = fake.gpus.pop()
        resume = asyncio.ensure_future(runtime.pause.resume())
        await until(lambda: not status.paused, what="the collector resumed")
        looked = looks[0]
        resumed.set()  # the paused round is counted; the next one begins and is held
        await until(next_round.is_set, what="the next round")
        seen = status.rounds_done
        await until(lambda: resume.done() or looks[0] >= looked + 2, what="the resume's looks")
        assert status.rounds_done == seen
        go.set()
        reply = await resume
        lost = [e.subject for e in reply.first_round["gpu"] if e.kind == "gpu_lost"]
        assert lost == [gone.uuid], [e.message for e in reply.first_round["gpu"]]
    finally:
        resumed.set()
        go.set()
        await stop(runtime)
