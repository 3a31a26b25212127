"""The system collector: readings from a fixture tree and reboot detection across agent runs."""

from __future__ import annotations

from pathlib import Path

from agent.contracts.collector import KeyValueStore, MemoryKeyValueStore
from agent.contracts.model import Severity
from agent.runtime.state import StateStore
from collectors.system import SystemCollector, SystemSettings
from tests.support.host import FIXTURES, ProcTree, make_deps, pooled_caller, run_round, values
from tests.support.stores import StateOnDisk

BOOT_A = "11111111-2222-3333-4444-555555555555"
BOOT_B = "66666666-7777-8888-9999-000000000000"


def _collector(proc_root: Path, store: KeyValueStore) -> SystemCollector:
    return SystemCollector(SystemSettings(proc_root=proc_root), make_deps(store))


class TestReadings:
    """Memory, swap, load, uptime and boot id from a fixture tree."""

    async def test_fixture_values(self) -> None:
        with pooled_caller() as caller:
            result = await run_round(_collector(FIXTURES / "host1", MemoryKeyValueStore()), caller)
        assert values(result, "gpuwarden_memory_available_bytes") == {(): 8192000 * 1024}
        assert values(result, "gpuwarden_swap_free_bytes") == {(): 2097148 * 1024}
        assert values(result, "gpuwarden_load_average")[("5m",)] == 1.25
        assert values(result, "gpuwarden_uptime_seconds") == {(): 86400.25}
        assert values(result, "gpuwarden_boot_info") == {
            ("8d3c1e0a-5b7f-4a58-9d3e-2f0c6b1a7e42",): 1
        }


class TestRebootDetection:
    """The boot id and last-alive time persist every round; a new boot id is an event."""

    async def test_reboot_between_runs_with_a_real_state_store(self, tmp_path: Path) -> None:
        tree = ProcTree(tmp_path / "proc")
        tree.set_system(BOOT_A)
        store = StateStore.open(tmp_path / "state")
        try:
            with pooled_caller() as caller:
                collector = _collector(tree.root, store)
                first = await run_round(collector, caller, now=1_000_000.0)
                await run_round(collector, caller, now=1_000_015.0)
            assert first.events == []
            assert store.get("system", "last_alive") == 1_000_015.0
        finally:
            store.close()

        tree.set_system(BOOT_B, uptime=60.0)
        store = StateStore.open(tmp_path / "state")
        try:
            with pooled_caller() as caller:
                collector = _collector(tree.root, store)
                after = await run_round(collector, caller, now=1_000_500.0)
                again = await run_round(collector, caller, now=1_000_515.0)
            assert store.get("system", "boot_id") == BOOT_B
        finally:
            store.close()
        (event,) = after.events
        assert (event.kind, event.severity, event.subject) == (
            "host_rebooted",
            Severity.WARNING,
            BOOT_B,
        )
        assert event.attributes["previous_boot_id"] == BOOT_A
        assert event.attributes["previous_last_alive"] == 1_000_015.0
        assert event.attributes["boot_time"] == 1_000_440.0
        assert "journalctl -b -1" in event.action
        assert again.events == []
        assert values(again, "gpuwarden_previous_boot_last_alive_timestamp_seconds") == {
            (): 1_000_015.0
        }

    async def test_a_restart_in_the_same_boot_is_not_a_reboot(self, tmp_path: Path) -> None:
        tree = ProcTree(tmp_path / "proc")
        tree.set_system(BOOT_A)
        store = MemoryKeyValueStore()
        with pooled_caller() as caller:
            await run_round(_collector(tree.root, store), caller, now=10.0)
            restarted = await run_round(_collector(tree.root, store), caller, now=20.0)
        assert restarted.events == []
        assert values(restarted, "gpuwarden_previous_boot_last_alive_timestamp_seconds") == {}

    async def test_first_run_ever_is_not_a_reboot(self, tmp_path: Path) -> None:
        tree = ProcTree(tmp_path / "proc")
        tree.set_system(BOOT_A)
        store = MemoryKeyValueStore()
        with pooled_caller() as caller:
            result = await run_round(_collector(tree.root, store), caller, now=10.0)
        assert result.events == []
        assert store.get("system", "boot_id") == BOOT_A


class TestStateStoreFull:
    """A disk that refuses every write costs neither the samples nor a repeated reboot
    event, and the new boot is stored once there is room."""

    async def test_rounds_keep_their_samples_and_report_the_reboot_once(
        self, tmp_path: Path, state_on_disk: StateOnDisk
    ) -> None:
        tree = ProcTree(tmp_path / "proc")
        tree.set_system(BOOT_B)
        state_on_disk.seed("system", "boot_id", BOOT_A)
        state_on_disk.seed("system", "last_alive", 5.0)
        state_on_disk.fill()
        collector = _collector(tree.root, state_on_disk.state)
        with pooled_caller() as caller:
            first = await run_round(collector, caller, now=10.0)
            assert not state_on_disk.end_round()
            second = await run_round(collector, caller, now=25.0)
            assert not state_on_disk.end_round()
        assert [e.kind for e in first.events] == ["host_rebooted"]
        assert second.events == []
        for result in (first, second):
            assert values(result, "gpuwarden_boot_info") == {(BOOT_B,): 1}
            assert values(result, "gpuwarden_memory_available_bytes") == {(): 8192000 * 1024}
        assert state_on_disk.store.get("system", "boot_id") == BOOT_A
        state_on_disk.disk.free()
        assert state_on_disk.end_round()
        assert state_on_disk.store.get("system", "boot_id") == BOOT_B
        assert state_on_disk.store.get("system", "last_alive") == 25.0
