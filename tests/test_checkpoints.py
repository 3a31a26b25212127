"""The checkpoints collector, round by round, on real checkpoint files in a real directory."""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.contracts.errors import ConfigError
from agent.contracts.model import Collection
from agent.contracts.settings import build, to_table
from collectors.checkpoints.checksums import Expected, HashJob
from collectors.checkpoints.settings import CheckpointSettings
from tests.support.checkpoints import (
    HOUR,
    Harness,
    age,
    kinds,
    location,
    values,
    write_hf,
    write_safetensors,
    write_sidecar,
    write_torch,
)

LOC = ("train",)
MakeHarness = Callable[..., Harness]


@pytest.fixture
def ckpt_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    return directory


@pytest.fixture
def harness_for(ckpt_dir: Path) -> Iterator[MakeHarness]:
    made: list[Harness] = []

    def make(**changes: object) -> Harness:
        loc_changes = {
            k: v for k, v in changes.items() if k in ("max_age", "copy_dir", "offnode_max_lag")
        }
        rest = {k: v for k, v in changes.items() if k not in loc_changes}
        settings = CheckpointSettings(
            enabled=True,
            locations=(location(ckpt_dir, **loc_changes),),
            **rest,  # type: ignore[arg-type]
        )
        harness = Harness(settings)
        made.append(harness)
        return harness

    yield make
    for harness in made:
        harness.close()


def count(collection: Collection, status: str) -> float:
    return values(collection, "gpuwarden_checkpoints")[("train", status)]


class TestCompleteOrNot:
    async def test_a_file_still_growing_is_incomplete_until_it_stops(
        self, ckpt_dir: Path, harness_for: MakeHarness
    ) -> None:
        h = harness_for()
        path = write_torch(ckpt_dir / "step_100.pt", step=100)
        first = await h.round()
        assert count(first, "incomplete") == 1, "a fresh file seen once has not shown it stopped"
        with path.open("ab") as handle:
            handle.write(b"\0" * 1024)  # the writer is still at it
        second = await h.round()
        assert count(second, "incomplete") == 1
        write_torch(path, step=100)  # the save finishes
        await h.round()
        settled = await h.round()
        assert count(settled, "complete") == 1
        assert values(settled, "gpuwarden_checkpoint_newest_step") == {LOC: 100}
        assert values(settled, "gpuwarden_checkpoint_newest_size_bytes") == {
            LOC: path.stat().st_size
        }

    async def test_temp_named_uploads_are_never_complete(
        self, ckpt_dir: Path, harness_for: MakeHarness
    ) -> None:
        old = write_hf(ckpt_dir / "checkpoint-100", step=100)
        age(old, 2 * HOUR)
        for name in ("tmp-checkpoint-200", "checkpoint-300.tmp"):
            write_hf(ckpt_dir / name, step=200)
            age(ckpt_dir / name, HOUR)  # long stable: the name alone keeps it out
        write_safetensors(ckpt_dir / ".model.safetensors.a8Zq")
        age(ckpt_dir / ".model.safetensors.a8Zq", HOUR)
        h = harness_for(max_age=3 * HOUR)
        result = await h.round()
        assert count(result, "incomplete") == 3
        assert count(result, "complete") == 1
        assert values(result, "gpuwarden_checkpoint_newest_step") == {LOC: 100}

    async def test_truncated_checkpoints_are_corrupt_once_stable(
        self, ckpt_dir: Path, harness_for: MakeHarness
    ) -> None:
        good = write_torch(ckpt_dir / "step_1.pt")
        age(good, 2 * HOUR)
        for name, writer in (("step_2.pt", write_torch), ("step_3.safetensors", write_safetensors)):
            path = writer(ckpt_dir / name)
            os.truncate(path, path.stat().st_size * 2 // 3)
            age(path, HOUR)
        h = harness_for()
        result = await h.round()
        assert count(result, "corrupt") == 2
        assert kinds(result).count("checkpoint_corrupt") == 2
        assert values(result, "gpuwarden_checkpoint_latest_corrupt") == {LOC: 1}
        assert values(result, "gpuwarden_checkpoint_newest_step") == {LOC: 1}
        again = await h.round()
        assert "checkpoint_corrupt" not in kinds(again), "a known corrupt checkpoint is news once"


class TestChecksums:
    async def test_a_wrong_sidecar_is_corrupt_a_right_one_complete(
        self, ckpt_dir: Path, harness_for: MakeHarness
    ) -> None:
        right = write_safetensors(ckpt_dir / "step_10.safetensors", seed=1)
        write_sidecar(right)
        wrong = write_safetensors(ckpt_dir / "step_20.safetensors", seed=2)
        write_sidecar(wrong, "0" * 64)
        age(right, 2 * HOUR)
        age(wrong, HOUR)
        h = harness_for(hash_newest=5)
        result = await h.round()
        corrupt = [e for e in result.events if e.kind == "checkpoint_corrupt"]
        assert [e.attributes["checkpoint"] for e in corrupt] == ["step_20.safetensors"]
        assert corrupt[0].attributes["check"] == "checksum"
        assert values(result, "gpuwarden_checkpoint_newest_step") == {LOC: 10}

    async def test_directory_manifest_is_checked(
        self, ckpt_dir: Path, harness_for: MakeHarness
    ) -> None:
        directory = write_hf(ckpt_dir / "checkpoint-5", step=5)
        lines = [
            f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}"
            for p in sorted(directory.iterdir())
        ]
        (directory / "SHA256SUMS").write_text("\n".join(lines) + "\n")
        age(directory, HOUR)
        h = harness_for()
        assert count(await h.round(), "complete") == 1
        optimizer = directory / "optimizer.pt"
        data = bytearray(optimizer.read_bytes())
        data[-200] ^= 0xFF  # one flipped bit in the data: the structure still reads
        optimizer.write_bytes(bytes(data))
        age(directory, HOUR)
        result = await h.round()
        assert count(result, "corrupt") == 1
        assert "optimizer.pt" in next(
            e.message for e in result.events if e.kind == "checkpoint_corrupt"
        )

    async def test_a_big_checkpoint_is_hashed_over_several_rounds(
        self, ckpt_dir: Path, harness_for: MakeHarness
    ) -> None:
        """Hashing is bounded per round: verifying until the last byte is read, then complete."""
        path = write_safetensors(ckpt_dir / "step_1.safetensors", rows=16_000)  # ~2.2 MiB
        write_sidecar(path)
        age(path, HOUR)
        # 4 MiB/s and a 0.25 s call timeout: 0.5 MiB a call, and a round has time for one.
        h = harness_for(hash_bandwidth_mib_s=4.0, interval=0.05, timeout=0.25)
        statuses = []
        for _ in range(40):
            result = await h.round()
            statuses.append("verifying" if count(result, "verifying") else "complete")
            if statuses[-1] == "complete":
                break
        assert statuses[0] == "verifying" and statuses[-1] == "complete", statuses
        assert len(statuses) >= 3, statuses
        assert values(result, "gpuwarden_checkpoint_newest_step") == {LOC: 1}

    def test_hashing_keeps_to_its_rate(self, tmp_path: Path) -> None:
        path = tmp_path / "blob"
        path.write_bytes(os.urandom(3 * 2**20 + 5))
        rate = 2**20  # 1 MiB/s
        clock = [0.0]
        slept: list[float] = []

        def sleep(seconds: float) -> None:
            slept.append(seconds)
            clock[0] += seconds

        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        job = HashJob([Expected(path, digest)], rate)
        steps = 0
        while not job.step(2**20, clock=lambda: clock[0], sleep=sleep):
            steps += 1
        assert job.mismatches == [] and job.hashed_bytes == path.stat().st_size
        assert steps >= 3, "a budget of 1 MiB a call takes several calls for 3 MiB"
        # The reads took no time on the fake clock: every second of the rate was slept.
        assert sum(slept) == pytest.approx(path.stat().st_size / rate, rel=0.01)

    def test_a_file_changing_under_the_hash_ends_the_job(self, tmp_path: Path) -> None:
        path = tmp_path / "blob"
        path.write_bytes(b"a" * (3 * 2**20))
        job = HashJob([Expected(path, "0" * 64)], 1e12)
        assert not job.step(2**20)
        with path.open("ab") as handle:
            handle.write(b"b")
        assert job.step(2**20)
        assert "changed" in job.changed and job.mismatches == []


class TestEvents:
    async def test_stale_then_fresh(self, ckpt_dir: Path, harness_for: MakeHarness) -> None:
        path = write_torch(ckpt_dir / "step_1.pt")
        age(path, 5 * HOUR)
        h = harness_for(max_age=4 * HOUR)
        result = await h.round()
        stale = [e for e in result.events if e.kind == "checkpoint_stale"]
        assert len(stale) == 1 and "step_1.pt" in stale[0].message
        assert values(result, "gpuwarden_checkpoint_newest_age_seconds")[LOC] > 4 * HOUR
        assert values(result, "gpuwarden_checkpoint_max_age_seconds") == {LOC: 4 * HOUR}
        assert "checkpoint_stale" not in kinds(await h.round()), "stale is news once"
        new = write_torch(ckpt_dir / "step_2.pt")
        age(new, 10)
        await h.round()
        result = await h.round()
        assert "checkpoint_fresh" in kinds(result)

    async def test_nothing_complete_is_critical(
        self, ckpt_dir: Path, harness_for: MakeHarness
    ) -> None:
        h = harness_for()
        result = await h.round()
        stale = [e for e in result.events if e.kind == "checkpoint_stale"]
        assert stale and stale[0].severity.name == "CRITICAL"
        assert "gpuwarden_checkpoint_newest_age_seconds" not in {
            s.family.name for s in result.samples
        }

    async def test_the_last_good_overwritten_in_place(
        self, ckpt_dir: Path, harness_for: MakeHarness
    ) -> None:
        path = write_torch(ckpt_dir / "model.pt", rows=256)
        age(path, HOUR)
        h = harness_for()
        assert count(await h.round(), "complete") == 1
        inode = path.stat().st_ino
        with path.open("r+b") as handle:  # the next save, into the same file
            handle.write(b"\0" * 4096)
        assert path.stat().st_ino == inode
        result = await h.round()
        events = [e for e in result.events if e.kind == "checkpoint_overwritten"]
        assert len(events) == 1
        assert events[0].severity.name == "CRITICAL" and events[0].attributes["same_inode"] is True
        assert count(result, "complete") == 0

    async def test_a_new_checkpoint_much_smaller_than_the_last_has_shrunk(
        self, ckpt_dir: Path, harness_for: MakeHarness
    ) -> None:
        big = write_torch(ckpt_dir / "step_1.pt", rows=1024)
        age(big, 2 * HOUR)
        h = harness_for()
        await h.round()
        small = write_torch(ckpt_dir / "step_2.pt", rows=16)
        age(small, HOUR)
        result = await h.round()
        assert kinds(result).count("checkpoint_shrunk") == 1
        same = write_torch(ckpt_dir / "step_3.pt", rows=16)
        age(same, HOUR / 2)
        assert "checkpoint_shrunk" not in kinds(await h.round())

    async def test_a_missing_location_is_an_error_series_and_one_event(
        self, tmp_path: Path, harness_for: MakeHarness, ckpt_dir: Path
    ) -> None:
        h = harness_for()
        shutil.rmtree(ckpt_dir)
        first = await h.round()
        assert values(first, "gpuwarden_checkpoint_location_error") == {LOC: 1}
        assert kinds(first) == ["checkpoint_location_error"]
        assert kinds(await h.round()) == []


class TestOffNodeDirectory:
    async def test_copy_holds_newest_behind_and_mismatch(
        self, ckpt_dir: Path, tmp_path: Path, harness_for: MakeHarness
    ) -> None:
        copy = tmp_path / "copy"
        copy.mkdir()
        now = time.time()
        first = write_hf(ckpt_dir / "checkpoint-100", step=100)
        age(first, 4 * HOUR, now)
        shutil.copytree(first, copy / "checkpoint-100")
        age(copy / "checkpoint-100", 4 * HOUR, now)
        h = harness_for(copy_dir=copy, offnode_max_lag=HOUR)
        labels = ("train", str(copy))
        result = await h.round(now)
        assert values(result, "gpuwarden_checkpoint_offnode_ok") == {labels: 1}
        assert values(result, "gpuwarden_checkpoint_offnode_newest_step") == {labels: 100}
        second = write_hf(ckpt_dir / "checkpoint-200", step=200)
        age(second, 2 * HOUR, now)  # complete two hours ago, and not copied
        result = await h.round(now)
        assert values(result, "gpuwarden_checkpoint_offnode_ok") == {labels: 0}
        assert values(result, "gpuwarden_checkpoint_offnode_lag_seconds")[labels] == pytest.approx(
            2 * HOUR, abs=1
        )
        assert "checkpoint_offnode_behind" in kinds(result)
        shutil.copytree(second, copy / "checkpoint-200")
        with (copy / "checkpoint-200" / "optimizer.pt").open("ab") as handle:
            handle.write(b"\0")
        age(copy / "checkpoint-200", HOUR, now)
        result = await h.round(now)
        assert "checkpoint_offnode_mismatch" in kinds(result)
        assert values(result, "gpuwarden_checkpoint_offnode_ok") == {labels: 0}


class TestSettings:
    def test_locations_are_an_array_of_tables(self, tmp_path: Path) -> None:
        table = {"enabled": True, "locations": [{"path": str(tmp_path), "max_age": 60}]}
        settings = build(CheckpointSettings, table, "collectors.checkpoints")
        assert settings.locations[0].max_age == 60
        assert to_table(settings)["locations"][0]["path"] == str(tmp_path)

    def test_bad_locations_name_the_key(self, tmp_path: Path) -> None:
        cases: dict[str, dict[str, object]] = {
            "locations[0].path": {"locations": [{"path": "relative/dir"}]},
            "locations[0].max_age": {"locations": [{"path": str(tmp_path), "max_age": 0}]},
            "locations[0].typo": {"locations": [{"path": str(tmp_path), "typo": 1}]},
        }
        for key, table in cases.items():
            with pytest.raises(ConfigError) as caught:
                build(CheckpointSettings, {"enabled": True, **table}, "collectors.checkpoints")
            assert key.split(".")[-1] in str(caught.value), (key, str(caught.value))
        with pytest.raises(ConfigError, match="at least one"):
            build(CheckpointSettings, {"enabled": True}, "collectors.checkpoints")


class TestReadme:
    def test_every_key_has_a_row(self) -> None:
        import dataclasses

        from collectors.checkpoints.settings import LocationSettings

        text = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
        missing = [
            f.name
            for f in dataclasses.fields(CheckpointSettings)
            if f"[collectors.checkpoints] {f.name}" not in text
            and not (f.name in ("interval", "timeout") and "interval` / `timeout" in text)
        ]
        missing += [
            f.name
            for f in dataclasses.fields(LocationSettings)
            if not any(
                row.startswith("| `[[collectors.checkpoints.locations]]") and f"{f.name}`" in row
                for row in text.splitlines()
            )
        ]
        assert not missing, f"docs/configuration.md lacks rows for {missing}"


class TestConfigFiles:
    def test_a_location_secret_file_readable_by_others_is_refused(self, tmp_path: Path) -> None:
        """Files named inside an array of tables are checked as any other file key."""
        from agent.program import config_file

        key_id, secret = tmp_path / "id", tmp_path / "secret"
        for path in (key_id, secret):
            path.write_text("x\n")
            path.chmod(0o600)
        secret.chmod(0o644)
        conf = tmp_path / "gpuwarden.toml"
        conf.write_text(
            f'state_dir = "{tmp_path / "state"}"\n'
            "[collectors.checkpoints]\nenabled = true\n"
            "[[collectors.checkpoints.locations]]\n"
            f'path = "{tmp_path}"\ns3_bucket = "b"\n'
            f's3_access_key_id_file = "{key_id}"\ns3_secret_access_key_file = "{secret}"\n'
        )
        with pytest.raises(ConfigError) as caught:
            config_file.load(conf)
        assert "collectors.checkpoints.locations[0].s3_secret_access_key_file" in str(caught.value)
        assert "chmod 600" in str(caught.value)
        secret.chmod(0o600)
        shown = to_table(config_file.load(conf).collectors["checkpoints"])
        assert shown["locations"][0]["s3_bucket"] == "b"


class TestRestart:
    async def test_the_last_good_checkpoint_survives_a_restart(self, ckpt_dir: Path) -> None:
        """A shrunk save is seen against the checkpoint the agent knew before it restarted."""
        from agent.contracts.collector import MemoryKeyValueStore

        settings = CheckpointSettings(enabled=True, locations=(location(ckpt_dir),))
        state = MemoryKeyValueStore()
        age(write_torch(ckpt_dir / "step_1.pt", rows=1024), 2 * HOUR)
        before = Harness(settings, state)
        try:
            await before.round()
        finally:
            before.close()
        age(write_torch(ckpt_dir / "step_2.pt", rows=16), HOUR)
        after = Harness(settings, state)
        try:
            assert "checkpoint_shrunk" in kinds(await after.round())
        finally:
            after.close()
