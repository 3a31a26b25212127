"""The runtime's pause: every GPU collector let go of, series gone and marked, the deadline that
ends a forgotten pause, a pause kept across an agent restart (not a reboot), a collector built
while paused (a reload), and the heartbeat that says paused."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.contracts.pause import PauseSettings
from agent.program import config_file as config
from agent.program import registry
from agent.program.diagnose.state_reader import read_state
from agent.program.watch.fleet import SETTLE_SECONDS, Fleet
from agent.program.watch.payloads import Malformed, parse_heartbeat
from agent.runtime.core import Runtime
from agent.runtime.pause import PauseRefused
from agent.runtime.state import StateStore
from collectors._nvml import NvmlBackend
from collectors.gpu.collector import GpuSettings
from exporters.heartbeat import heartbeat_payload
from tests.support.nvml import fake_gpus
from tests.support.nvml_fake import FakeNvml
from tests.support.waiting import until

T0 = 1_700_000_000.0
GPU = GpuSettings(interval=0.1, event_thread=True, event_wait_ms=50, sysfs_root="/nonexistent")


def make_runtime(
    fake: FakeNvml,
    state_dir: Path,
    boot: str = "boot-1",
    pause: PauseSettings | None = None,
    gpu: GpuSettings = GPU,
) -> Runtime:
    cfg = config.parse({"prometheus": {"enabled": False}, "state_dir": str(state_dir)})
    sections = {**cfg.sections, "pause": pause or PauseSettings()}
    cfg = dataclasses.replace(cfg, collectors={"gpu": gpu}, sections=sections)
    runtime = Runtime(
        cfg,
        StateStore.open(state_dir),
        collectors=registry.COLLECTORS,
        sinks=registry.SINKS,
        boot_id=boot,
    )
    runtime.shared.put(NvmlBackend, NvmlBackend(fake))
    return runtime


def names(runtime: Runtime) -> set[str]:
    return {s.family.name for s in runtime.samples()}


def gauge(runtime: Runtime, name: str) -> float | None:
    found = [s.value for s in runtime.samples() if s.family.name == name]
    return found[0] if found else None


def events(runtime: Runtime, kind: str) -> list[Any]:
    return [e for e in runtime.recent_events if e.kind == kind]


async def stop(runtime: Runtime) -> None:
    await runtime.stop()
    runtime.store.close()


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[tuple[Runtime, FakeNvml]]:
    fake = FakeNvml(fake_gpus(2))
    runtime = make_runtime(fake, tmp_path / "state")
    await runtime.start()
    await until(lambda: "gpuwarden_gpu_up" in names(runtime), what="GPU series")
    yield runtime, fake
    await stop(runtime)


class TestPauseInTheRuntime:
    async def test_series_go_marked_and_come_back(self, running: tuple[Runtime, FakeNvml]) -> None:
        runtime, fake = running
        assert gauge(runtime, "gpuwarden_gpu_paused") == 0
        reply = await runtime.pause.pause(60.0, "reset GPU 1", "alice")
        assert reply.ok and not reply.extended
        assert fake.initialised == 0
        # At once, not a round later: a scrape right after the command sees no GPU series.
        gpu_series = {f.name for f in runtime.collectors["gpu"].collector.families()}
        assert not names(runtime) & gpu_series
        assert gauge(runtime, "gpuwarden_gpu_paused") == 1
        end = gauge(runtime, "gpuwarden_gpu_pause_end_timestamp_seconds")
        assert end is not None and abs(end - (time.time() + 60.0)) < 5
        calls = sum(fake.lib_calls.values())
        rounds = runtime.collectors["gpu"].rounds_done
        await until(lambda: runtime.collectors["gpu"].rounds_done >= rounds + 3)
        assert sum(fake.lib_calls.values()) == calls
        assert runtime.health().ok  # paused rounds succeed: nothing goes stale
        assert any("paused until" in n and "reset GPU 1" in n for n in runtime.health().notices)
        await until(lambda: bool(events(runtime, "gpu_paused")), what="the event")
        (paused,) = events(runtime, "gpu_paused")
        assert "reset GPU 1" in paused.message and paused.attributes["by"] == "alice"

        resumed = await runtime.pause.resume(by="alice")
        assert resumed.resumed and resumed.first_round.keys() == {"gpu"}
        assert "gpuwarden_gpu_up" in names(runtime)  # the first round after resume is done
        assert gauge(runtime, "gpuwarden_gpu_paused") == 0
        assert "gpuwarden_gpu_pause_end_timestamp_seconds" not in names(runtime)
        assert fake.initialised == 1
        await until(lambda: bool(events(runtime, "gpu_resumed")), what="the event")
        assert len(events(runtime, "gpu_resumed")) == 1

    async def test_resume_reports_a_gpu_that_did_not_come_back(
        self, running: tuple[Runtime, FakeNvml]
    ) -> None:
        runtime, fake = running
        await runtime.pause.pause(60.0)
        gone = fake.gpus.pop()
        reply = await runtime.pause.resume()
        lost = [e for e in reply.first_round["gpu"] if e.kind == "gpu_lost"]
        assert [e.subject for e in lost] == [gone.uuid]

    async def test_pausing_again_extends_and_releases_nothing_twice(
        self, running: tuple[Runtime, FakeNvml]
    ) -> None:
        runtime, fake = running
        first = await runtime.pause.pause(60.0)
        again = await runtime.pause.pause(600.0)
        assert again.extended and again.state.since == first.state.since
        assert again.state.until > first.state.until
        assert fake.lib_calls["nvmlShutdown"] == 1

    async def test_durations_out_of_range_are_refused(
        self, running: tuple[Runtime, FakeNvml]
    ) -> None:
        runtime, fake = running
        for seconds in (0.0, -5.0, PauseSettings().max_duration + 1):
            with pytest.raises(PauseRefused, match="max_duration"):
                await runtime.pause.pause(seconds)
        assert runtime.pause_state() is None and fake.initialised == 1

    async def test_nothing_to_resume(self, running: tuple[Runtime, FakeNvml]) -> None:
        runtime, _ = running
        assert not (await runtime.pause.resume()).resumed
        assert events(runtime, "gpu_resumed") == []

    async def test_a_collector_built_while_paused_is_paused_first(
        self, running: tuple[Runtime, FakeNvml]
    ) -> None:
        runtime, fake = running
        await runtime.pause.pause(60.0)
        inits = fake.init_calls
        changed = GPU.replace(interval=0.15)
        await runtime.reload(dataclasses.replace(runtime.config, collectors={"gpu": changed}))
        status = runtime.collectors["gpu"]
        await until(lambda: status.rounds_done >= 3, what="rounds of the new instance")
        assert status.paused
        assert fake.init_calls == inits and fake.initialised == 0

    async def test_disabled_and_enabled_again_while_paused(
        self, running: tuple[Runtime, FakeNvml]
    ) -> None:
        """A reload that disables the GPU collector while paused, then one that enables it:
        the new instance is paused before it touches NVML, the heartbeat says paused
        meanwhile, and the resume brings the GPUs back without an error."""
        runtime, fake = running
        await runtime.pause.pause(60.0)
        off = dataclasses.replace(runtime.config, collectors={"gpu": GPU.replace(enabled=False)})
        await runtime.reload(off)
        assert "gpu" not in runtime.collectors
        assert runtime.health().ok
        assert any("paused" in n for n in runtime.health().notices)
        await runtime.reload(dataclasses.replace(runtime.config, collectors={"gpu": GPU}))
        status = runtime.collectors["gpu"]
        await until(lambda: status.rounds_done >= 2, what="rounds of the new instance")
        assert status.paused and fake.initialised == 0
        assert "gpuwarden_gpu_up" not in names(runtime)
        reply = await runtime.pause.resume()
        assert reply.resumed and reply.waited_out == ()
        await until(lambda: "gpuwarden_gpu_up" in names(runtime), what="GPU series again")
        await runtime.settle()
        assert [e.kind for e in runtime.recent_events if e.kind.startswith("gpu_")] == [
            "gpu_paused",
            "gpu_resumed",
        ]


class TestTheDeadline:
    async def test_a_forgotten_pause_ends_by_itself_and_says_so(
        self, running: tuple[Runtime, FakeNvml]
    ) -> None:
        runtime, fake = running
        await runtime.pause.pause(0.5, "forgotten")
        await until(lambda: bool(events(runtime, "gpu_resumed")), timeout=10, what="the deadline")
        assert runtime.pause_state() is None
        (event,) = events(runtime, "gpu_resumed")
        assert event.attributes["why"] == "deadline"
        assert "by itself" in event.message and event.severity.label == "warning"
        await until(lambda: "gpuwarden_gpu_up" in names(runtime), what="GPU series back")
        assert fake.initialised == 1


class TestAcrossRestarts:
    async def test_a_restart_stays_paused_until_the_same_deadline(self, tmp_path: Path) -> None:
        fake = FakeNvml(fake_gpus(1))
        first = make_runtime(fake, tmp_path / "state")
        await first.start()
        await until(lambda: fake.initialised == 1, what="NVML up")
        reply = await first.pause.pause(60.0, "MIG change")
        # On disk when the command gets its answer: a SIGKILL now still comes back paused.
        stored = read_state(tmp_path / "state").kv["runtime"]["gpu_pause"]
        assert stored["until"] == pytest.approx(reply.state.until)
        await stop(first)

        second = make_runtime(fake, tmp_path / "state")
        inits = fake.init_calls
        await second.start()
        try:
            state = second.pause_state()
            assert state is not None and state.until == pytest.approx(reply.state.until)
            status = second.collectors["gpu"]
            await until(lambda: status.rounds_done >= 3, what="paused rounds")
            assert fake.init_calls == inits  # paused before its first round: no nvmlInit
            assert "gpuwarden_gpu_up" not in names(second)
            assert gauge(second, "gpuwarden_gpu_paused") == 1
        finally:
            await stop(second)

    async def test_a_reboot_ends_it(self, tmp_path: Path) -> None:
        fake = FakeNvml(fake_gpus(1))
        first = make_runtime(fake, tmp_path / "state")
        await first.start()
        await first.pause.pause(60.0)
        await stop(first)
        second = make_runtime(fake, tmp_path / "state", boot="boot-2")
        await second.start()
        try:
            assert second.pause_state() is None
            await until(lambda: "gpuwarden_gpu_up" in names(second), what="GPU series")
        finally:
            await stop(second)

    async def test_a_deadline_passed_while_stopped_resumes_and_says_so(
        self, tmp_path: Path
    ) -> None:
        fake = FakeNvml(fake_gpus(1))
        first = make_runtime(fake, tmp_path / "state")
        await first.start()
        await first.pause.pause(0.3)
        await first.pause.stop()  # the deadline timer goes with the process
        await stop(first)
        time.sleep(0.5)
        second = make_runtime(fake, tmp_path / "state")
        await second.start()
        try:
            assert second.pause_state() is None
            await until(lambda: bool(events(second, "gpu_resumed")), what="the event")
            (event,) = events(second, "gpu_resumed")
            assert "while the agent was stopped" in event.message
            await until(lambda: "gpuwarden_gpu_up" in names(second), what="GPU series")
        finally:
            await stop(second)


class TestHeartbeat:
    async def test_the_heartbeat_says_paused(self, running: tuple[Runtime, FakeNvml]) -> None:
        runtime, _ = running

        def beat() -> dict[str, Any]:
            payload = heartbeat_payload(
                runtime, seq=1, bdseq=1, now=time.time(), outbox_depth={}, outbox_dropped={}
            )
            data: dict[str, Any] = json.loads(payload)
            return data

        assert beat()["gpu"] == "active" and beat()["paused"] is None
        reply = await runtime.pause.pause(60.0, "reset")
        paused = beat()
        assert paused["gpu"] == "paused"
        assert paused["paused"]["until_ts"] == pytest.approx(reply.state.until, abs=0.01)
        assert paused["paused"]["reason"] == "reset"
        assert paused["health"] == "ok"
        await runtime.pause.resume()
        assert beat()["gpu"] == "active"


class TestWatcher:
    """The off-node watcher does not alert on a paused node's GPU collectors, and still does on
    the rest of the node."""

    @staticmethod
    def fleet_after(problems: list[str], paused: list[str] | None) -> set[tuple[str, str]]:
        fleet = Fleet(now=T0)
        fleet.broker_connected(T0 - SETTLE_SECONDS)
        fleet.ingest(
            "gpuwarden/v1/a/status",
            json.dumps({"state": "online", "bdseq": 1, "ts": T0, "version": "0.1"}).encode(),
            False,
            T0,
        )
        body: dict[str, Any] = {"seq": 1, "ts": T0, "interval_s": 10.0, "health": problems}
        if paused is not None:
            body |= {"gpu": "paused", "paused": {"until_ts": T0 + 600, "collectors": paused}}
        fleet.ingest("gpuwarden/v1/a/heartbeat", json.dumps(body).encode(), False, T0)
        return {c.alert.key for c in fleet.evaluate(T0 + 1) if c.raised}

    def test_paused_gpu_collectors_raise_nothing(self) -> None:
        gpu = "collector gpu stale for 40 s (round timed out)"
        bench = "collector benchmark stale for 900 s (no successful round)"
        assert self.fleet_after([gpu, bench], None) == {("node_unhealthy", "a")}
        assert self.fleet_after([gpu, bench], ["benchmark", "gpu"]) == set()

    def test_the_rest_of_the_node_still_alerts(self) -> None:
        disk = "collector disk stale for 40 s (statvfs hung)"
        raised = self.fleet_after([disk, "collector gpu stale for 40 s (x)"], ["gpu"])
        assert raised == {("node_unhealthy", "a")}

    def test_a_heartbeat_that_only_claims_a_pause_names_nothing(self) -> None:
        """`gpu: paused` without a list of collectors, or with junk, silences nothing."""
        gpu = "collector gpu stale for 40 s (x)"
        assert self.fleet_after([gpu], []) == {("node_unhealthy", "a")}
        assert self.fleet_after([gpu], ["GPU; rm -rf", ""]) == {("node_unhealthy", "a")}

    async def test_the_agents_heartbeat_names_its_paused_collectors(
        self, running: tuple[Runtime, FakeNvml]
    ) -> None:
        runtime, _ = running
        await runtime.pause.pause(60.0)
        payload = heartbeat_payload(
            runtime, seq=1, bdseq=1, now=time.time(), outbox_depth={}, outbox_dropped={}
        )
        parsed = parse_heartbeat(payload)
        assert not isinstance(parsed, Malformed)
        assert parsed.paused == ("gpu",)
