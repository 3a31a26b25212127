"""SIGHUP reload in the runtime: what needs a restart waits for one (and says so), a collector is
built before the old one stops, a failed build keeps the old one and a revert works, and no bad
file (however it is bad) ends reloading."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from agent.contracts.collector import CollectorDeps, CollectorSettings, CollectorSpec
from agent.program import config_file as config
from agent.program import registry
from agent.program.commands import run as run_command
from agent.runtime.core import ReloadReport, Runtime
from agent.runtime.pause import PauseRefused
from agent.runtime.state import StateStore
from exporters.heartbeat import heartbeat_payload
from exporters.prometheus import PrometheusSettings, PrometheusSink
from tests.support.collectors import ScriptedCollector
from tests.support.waiting import until
from tests.test_config_nesting import deep_array, deep_table

FAST = CollectorSettings(interval=0.05, timeout=0.3)


class Rig:
    """A runtime on scripted collectors; every instance a factory built is kept, in order.

    `refuse[name] = "why"` makes that collector's factory raise (a build that fails);
    `closed_at_build` records, for each build, which earlier instances were closed by then."""

    def __init__(
        self,
        modes: Mapping[str, str],
        settings: CollectorSettings = FAST,
        data: Mapping[str, Any] | None = None,
    ) -> None:
        self.modes = dict(modes)
        self.built: dict[str, list[ScriptedCollector]] = {name: [] for name in modes}
        self.refuse: dict[str, str] = {}
        self.closed_at_build: list[tuple[str, list[bool]]] = []
        specs: dict[str, CollectorSpec[Any]] = {
            name: CollectorSpec(name, "test", CollectorSettings, self._factory(name))
            for name in modes
        }
        self.config = self.file(data or {}, dict.fromkeys(modes, settings))
        self.runtime = Runtime(
            self.config, StateStore.in_memory(), collectors=specs, sinks=registry.SINKS
        )

    def _factory(self, name: str) -> Any:
        def make(settings: CollectorSettings, deps: CollectorDeps) -> ScriptedCollector:
            earlier = [c.closed for instances in self.built.values() for c in instances]
            self.closed_at_build.append((name, earlier))
            if name in self.refuse:
                raise RuntimeError(self.refuse[name])
            collector = ScriptedCollector(name, self.modes[name], deps)
            self.built[name].append(collector)
            return collector

        return make

    @staticmethod
    def file(data: Mapping[str, Any], collectors: Mapping[str, CollectorSettings]) -> config.Config:
        """What loading a file with `data` gives, with these collectors."""
        parsed = config.parse({"prometheus": {"enabled": False}, **data}, "/etc/test.toml")
        return dataclasses.replace(parsed, collectors=dict(collectors))

    def with_collectors(self, **changes: CollectorSettings) -> config.Config:
        return dataclasses.replace(self.config, collectors={**self.config.collectors, **changes})

    def current(self, name: str) -> ScriptedCollector:
        return self.built[name][-1]


@pytest.fixture
async def rig() -> Any:
    instance = Rig({"a": "ok", "b": "ok"})
    await instance.runtime.start()
    yield instance
    await instance.runtime.stop()


RESTART_ONLY = [
    pytest.param({"node_id": "other-node"}, "node_id", id="node_id"),
    pytest.param({"state_dir": "/tmp/gpuwarden-elsewhere"}, "state_dir", id="state_dir"),
    pytest.param({"heartbeat": {"interval": 5.0}}, "[heartbeat] interval", id="hb-interval"),
    pytest.param(
        {"heartbeat": {"stale_after_intervals": 7}},
        "[heartbeat] stale_after_intervals",
        id="hb-stale",
    ),
    pytest.param(
        {"prometheus": {"enabled": False, "listen": "127.0.0.1:1"}},
        "[prometheus] listen",
        id="prometheus-listen",
    ),
    pytest.param({"prometheus": {"enabled": True}}, "[prometheus] enabled", id="prom-enabled"),
    pytest.param({"mqtt": {"url": "mqtt://192.0.2.1:1883"}}, "[mqtt] url", id="mqtt-url"),
    pytest.param({"mqtt": {"enabled": True}}, "[mqtt] enabled", id="mqtt-enabled"),
]


def payload(runtime: Runtime) -> dict[str, Any]:
    raw = heartbeat_payload(
        runtime, seq=1, bdseq=1, now=time.time(), outbox_depth={}, outbox_dropped={}
    )
    data: dict[str, Any] = json.loads(raw)
    return data


class TestRestartOnlySettings:
    """A setting read once at start is not half-applied by a reload: the running value stays,
    and the change is reported and shown as a notice until the restart."""

    @pytest.mark.parametrize(("data", "key"), RESTART_ONLY)
    async def test_not_applied_reported_and_shown(
        self, rig: Rig, data: dict[str, Any], key: str
    ) -> None:
        runtime = rig.runtime
        before = runtime.config
        node_id, interval = runtime.node_id, runtime.heartbeat_settings.interval
        instance = rig.current("a")
        report = await runtime.reload(Rig.file(data, rig.config.collectors))
        assert key in report.pending_restart
        assert not report.applied
        # Nothing that was started with the old value sees the new one.
        assert runtime.config.core == before.core
        assert dict(runtime.config.sections) == dict(before.sections)
        assert runtime.heartbeat_settings.interval == interval
        assert runtime.node_id == node_id
        assert runtime.config.state_dir == before.state_dir
        assert rig.current("a") is instance  # collectors are not restarted for it
        # A notice, not a failure: a node is not paged for an edit.
        health = runtime.health()
        assert health.ok, health.problems
        assert any(
            n.startswith("configuration change pending restart") and key in n
            for n in health.notices
        ), health.notices
        assert "pending restart" in health.summary()
        beat = payload(runtime)
        assert beat["interval_s"] == interval
        assert beat["health"] == "ok"
        assert any(key in n for n in beat["notices"])
        # Reverting the file takes the notice away again.
        report = await runtime.reload(rig.config)
        assert report.pending_restart == ()
        assert runtime.health().notices == ()
        assert payload(runtime)["notices"] == []

    async def test_heartbeat_interval_keeps_the_running_cadence(self, rig: Rig) -> None:
        """The reported defect: heartbeats said interval_s 5 while MQTT kept sending every 15 s,
        and the watcher paged a healthy node."""
        await rig.runtime.reload(Rig.file({"heartbeat": {"interval": 5.0}}, rig.config.collectors))
        assert payload(rig.runtime)["interval_s"] == 15.0
        assert rig.runtime.heartbeat_settings.interval == 15.0

    async def test_collector_change_applies_beside_a_pending_one(self, rig: Rig) -> None:
        new = Rig.file(
            {"heartbeat": {"interval": 5.0}},
            {**rig.config.collectors, "a": FAST.replace(interval=0.07)},
        )
        report = await rig.runtime.reload(new)
        assert report.pending_restart == ("[heartbeat] interval",)
        assert report.applied == ("collector a restarted",)
        assert rig.runtime.collectors["a"].settings.interval == 0.07
        assert rig.runtime.configured is new

    async def test_log_level_applies_at_once(self, rig: Rig) -> None:
        saved = structlog.get_config()
        try:
            report = await rig.runtime.reload(
                Rig.file({"log_level": "error"}, rig.config.collectors)
            )
            assert "log_level" in report.applied[0]
            assert report.pending_restart == ()
            assert rig.runtime.config.core.log_level == "error"
            with capture_logs() as logs:
                structlog.get_logger().warning("filtered out")
                structlog.get_logger().error("kept")
            assert [entry["event"] for entry in logs] == ["kept"]
        finally:
            structlog.configure(**saved)

    async def test_a_section_the_agent_does_not_read(self, rig: Rig) -> None:
        """[watch] is `gpuwarden watch`'s: changing it is no restart of the agent."""
        report = await rig.runtime.reload(
            Rig.file({"watch": {"stale_after_intervals": 9}}, rig.config.collectors)
        )
        assert report.pending_restart == ()
        assert report.unused == ("[watch] stale_after_intervals",)
        assert rig.runtime.health().notices == ()


class TestPauseSettingsApply:
    """[pause] is read at each `gpuwarden pause`: a reload applies it at once. Before, the
    runtime kept the values it started with, and the reload logged the change as keys "the
    agent does not read", with no notice: a lowered max_duration was not in force, and
    nothing said so."""

    @pytest.mark.parametrize(
        ("pause", "applied"),
        [
            pytest.param(
                {"max_duration": 60.0, "default_duration": 30.0},
                ("[pause] default_duration 30", "[pause] max_duration 60"),
                id="both",
            ),
            pytest.param({"default_duration": 600.0}, ("[pause] default_duration 600",), id="one"),
            pytest.param({"max_duration": 28800.0}, ("[pause] max_duration 28800",), id="raised"),
        ],
    )
    async def test_applied_at_once(
        self, rig: Rig, pause: dict[str, float], applied: tuple[str, ...]
    ) -> None:
        runtime = rig.runtime
        new = Rig.file({"pause": pause}, rig.config.collectors)
        report = await runtime.reload(new)
        assert report.applied == applied
        assert report.unused == () and report.pending_restart == ()
        assert runtime.health().notices == ()
        settings = new.sections["pause"]
        assert runtime.pause.settings == settings
        assert runtime.pause.duration(None) == pause.get("default_duration", 1800.0)
        longest = pause.get("max_duration", 14400.0)
        assert runtime.pause.duration(longest) == longest
        with pytest.raises(PauseRefused, match="max_duration"):
            runtime.pause.duration(longest + 1)
        # The same file again changes nothing; the old one puts the old values back.
        assert (await runtime.reload(new)).applied == ()
        assert (await runtime.reload(rig.config)).applied != ()
        assert runtime.pause.settings == rig.config.sections["pause"]


class TestBuildFirst:
    """Every new collector is built before any old one stops; a failed build keeps the old one
    running, is reported, and reverting the file is a reload like any other."""

    async def test_failed_build_keeps_the_old_collector(self, rig: Rig) -> None:
        runtime = rig.runtime
        old = rig.current("a")
        rig.refuse["a"] = "cannot open /dev/thing"
        report = await runtime.reload(rig.with_collectors(a=FAST.replace(interval=0.07)))
        assert report.applied == ()
        assert len(report.failed) == 1
        assert "collector a" in report.failed[0]
        assert "cannot open /dev/thing" in report.failed[0]
        # The old collector still runs, with its old settings.
        assert runtime.collectors["a"].collector is old
        assert runtime.collectors["a"].settings.interval == FAST.interval
        rounds = len(old.rounds)
        await until(lambda: len(old.rounds) > rounds + 2, what="the old collector's rounds")
        assert not old.closed
        health = runtime.health()
        assert health.ok, health.problems  # collection goes on: a notice
        assert any("collector a" in n and "cannot open /dev/thing" in n for n in health.notices)
        # Reverting the file: nothing to build, nothing restarted, the notice goes.
        del rig.refuse["a"]
        builds = len(rig.closed_at_build)
        report = await runtime.reload(rig.config)
        assert report.failed == ()
        assert len(rig.closed_at_build) == builds
        assert runtime.collectors["a"].collector is old
        assert runtime.health().notices == ()
        # And the change itself, once it can be built, applies.
        report = await runtime.reload(rig.with_collectors(a=FAST.replace(interval=0.07)))
        assert report.applied == ("collector a restarted",)
        assert runtime.collectors["a"].settings.interval == 0.07
        assert old.closed

    async def test_nothing_stops_before_every_build_is_done(self, rig: Rig) -> None:
        rig.refuse["b"] = "bad b"
        old_a, old_b = rig.current("a"), rig.current("b")
        builds = len(rig.closed_at_build)
        report = await rig.runtime.reload(
            rig.with_collectors(a=FAST.replace(interval=0.07), b=FAST.replace(interval=0.08))
        )
        assert [name for name, _ in rig.closed_at_build[builds:]] == ["a", "b"]
        assert not any(any(closed) for _, closed in rig.closed_at_build[builds:])
        # Collectors are independent: a's change applies, b keeps its old instance.
        assert report.applied == ("collector a restarted",)
        assert old_a.closed
        assert rig.runtime.collectors["b"].collector is old_b
        assert not old_b.closed

    async def test_a_collector_that_cannot_start_is_a_problem(self) -> None:
        rig = Rig({"a": "ok", "b": "ok"})
        rig.refuse["b"] = "no such device"
        runtime = rig.runtime
        sink = PrometheusSink(PrometheusSettings(listen="127.0.0.1:1"), runtime)
        await runtime.start()  # does not raise: the other collectors run
        try:
            await asyncio.wait_for(runtime.first_round.wait(), 5)
            assert "a" in runtime.collectors and "b" not in runtime.collectors
            health = runtime.health()
            assert not health.ok
            assert health.problems == ("collector b failed to start: RuntimeError: no such device",)
            status, body = sink.healthz()
            assert status == 503
            assert b"collector b failed to start" in body
            started = {
                s.label_values[0]: s.value
                for s in runtime.samples()
                if s.family.name == "gpuwarden_collector_start_failed"
            }
            assert started == {"a": 0.0, "b": 1.0}
            # Announced once stored, and the store is written off the loop: wait for it.
            await until(
                lambda: any(e.kind == "collector_start_failed" for e in runtime.recent_events),
                what="the start failure announced",
            )
            failed = [e for e in runtime.recent_events if e.kind == "collector_start_failed"]
            assert [(e.subject, e.severity.label) for e in failed] == [("b", "critical")]
            # The same file again, once the cause is gone: it starts.
            del rig.refuse["b"]
            report = await runtime.reload(rig.config)
            assert report.applied == ("collector b started",)
            await until(lambda: runtime.collectors["b"].rounds_done > 0, what="b's first round")
            assert runtime.health().ok
            assert sink.healthz()[0] == 200
        finally:
            await runtime.stop()

    async def test_enabling_a_collector_that_fails_then_disabling_it(self, rig: Rig) -> None:
        runtime = rig.runtime
        await runtime.reload(rig.with_collectors(b=FAST.replace(enabled=False)))
        assert "b" not in runtime.collectors
        rig.refuse["b"] = "broken"
        report = await runtime.reload(rig.with_collectors(b=FAST))
        assert "collector b" in report.failed[0]
        assert not runtime.health().ok
        report = await runtime.reload(rig.with_collectors(b=FAST.replace(enabled=False)))
        assert runtime.health().ok
        assert runtime.health().notices == ()


def file_config(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "gpuwarden.toml"
    path.write_text(f'state_dir = "{tmp_path / "state"}"\n[prometheus]\nenabled = false\n' + body)
    return path


BAD_FILES: list[Any] = [
    pytest.param(lambda p: p.write_text(deep_array(2000)), "nested", id="deep-array"),
    pytest.param(lambda p: p.write_text(deep_array(200_000)), "nested", id="very-deep-array"),
    pytest.param(lambda p: p.write_text(deep_table(3000)), "nested", id="deep-inline-table"),
    pytest.param(lambda p: p.write_bytes(b"node_id = '\xff'\n"), "UTF-8", id="not-utf8"),
    pytest.param(lambda p: p.write_text("node_id = \n"), "TOML syntax", id="syntax"),
    pytest.param(lambda p: p.write_text("[collectors.system]\ninterval = 'x'\n"), "interval"),
    pytest.param(lambda p: p.unlink(), "cannot read", id="removed"),
    pytest.param(lambda p: (p.unlink(), p.mkdir()), "cannot read", id="a-directory"),
]


def scripted_for_registry() -> tuple[
    dict[str, CollectorSpec[Any]], dict[str, list[ScriptedCollector]]
]:
    """Scripted stand-ins under every registered collector name, so that a real file can be
    loaded and reloaded without touching this machine's hardware."""
    built: dict[str, list[ScriptedCollector]] = {name: [] for name in registry.COLLECTORS}

    def factory(name: str) -> Any:
        def make(settings: CollectorSettings, deps: CollectorDeps) -> ScriptedCollector:
            collector = ScriptedCollector(name, "ok", deps)
            built[name].append(collector)
            return collector

        return make

    specs: dict[str, CollectorSpec[Any]] = {
        name: CollectorSpec(name, "test", CollectorSettings, factory(name))
        for name in registry.COLLECTORS
    }
    return specs, built


@pytest.fixture
def logs() -> Iterator[list[MutableMapping[str, Any]]]:
    with capture_logs() as captured:
        yield captured


class TestReloadLoop:
    """Whatever is wrong with the new file, the old configuration keeps running, the log says
    why, and the next SIGHUP with a good file applies it."""

    @pytest.mark.parametrize(("spoil", "why"), BAD_FILES)
    async def test_bad_file_then_good_file(
        self, tmp_path: Path, logs: list[MutableMapping[str, Any]], spoil: Any, why: str
    ) -> None:
        good = "[collectors.system]\ninterval = 0.05\n"
        path = file_config(tmp_path, good)
        specs, built = scripted_for_registry()
        runtime = Runtime(
            config.load(path), StateStore.in_memory(), collectors=specs, sinks=registry.SINKS
        )
        await runtime.start()
        reloads: asyncio.Queue[None] = asyncio.Queue()
        loop = asyncio.create_task(run_command._reload_loop(runtime, path, reloads))
        try:
            system = built["system"][-1]
            spoil(path)
            reloads.put_nowait(None)
            await until(lambda: any("refused" in e["event"] for e in logs), what="the refusal")
            refused = next(e for e in logs if "refused" in e["event"])
            assert refused["log_level"] == "error"
            assert why in refused["error"]
            assert str(path) in refused["error"]
            assert runtime.collectors["system"].collector is system
            assert runtime.collectors["system"].settings.interval == 0.05
            assert not loop.done()
            health = runtime.health()
            assert health.ok
            assert any("reload refused" in n and why in n for n in health.notices), health
            reloaded = _sample(runtime, "gpuwarden_config_last_reload_successful")
            assert reloaded == 0.0
            # The next SIGHUP, with a good file, is honoured.
            if path.is_dir():
                path.rmdir()
            file_config(tmp_path, "[collectors.system]\ninterval = 0.07\n")
            reloads.put_nowait(None)
            await until(
                lambda: runtime.collectors["system"].settings.interval == 0.07,
                what="the good file to apply",
            )
            assert system.closed
            assert runtime.health().notices == ()
            assert _sample(runtime, "gpuwarden_config_last_reload_successful") == 1.0
            assert any(e["event"] == "configuration reloaded" for e in logs)
        finally:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
            await runtime.stop()

    async def test_an_unexpected_error_in_reload_is_logged(
        self, tmp_path: Path, logs: list[MutableMapping[str, Any]]
    ) -> None:
        path = file_config(tmp_path, "")
        calls: list[str] = []

        class Breaks:
            async def reload(self, new: config.Config) -> Any:
                calls.append(new.source)
                if len(calls) == 1:
                    raise RecursionError("maximum recursion depth exceeded")
                return ReloadReport()

            def reload_refused(self, reason: str) -> None:
                calls.append(reason)

        reloads: asyncio.Queue[None] = asyncio.Queue()
        loop = asyncio.create_task(run_command._reload_loop(Breaks(), path, reloads))  # type: ignore[arg-type]
        try:
            reloads.put_nowait(None)
            await until(lambda: len(calls) == 2, what="the failed reload")
            reloads.put_nowait(None)  # the next SIGHUP (one sent with it: the same reload)
            await until(lambda: len(calls) == 3, what="two reloads")
            assert calls[1].startswith("RecursionError")
            assert any(
                e["log_level"] == "error" and "RecursionError" in e.get("error", "") for e in logs
            )
        finally:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)


def _sample(runtime: Runtime, name: str) -> float:
    (value,) = [s.value for s in runtime.samples() if s.family.name == name]
    return value
