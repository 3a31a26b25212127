"""Structure reads of real checkpoints (torch, safetensors, distributed), whole and damaged."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from collectors.checkpoints.detect import DEFAULT_TEMP_PATTERNS as TEMP
from collectors.checkpoints.detect import Candidate, classify, step_of, verify_structure
from collectors.checkpoints.formats import (
    Unreadable,
    read_dcp_dir,
    read_safetensors,
    read_torch_zip,
)
from tests.support.checkpoints import (
    write_dcp,
    write_hf,
    write_safetensors,
    write_torch,
)


def cut(path: Path, keep: int) -> Path:
    out = path.with_name(f"cut-{keep}-{path.name}")
    out.write_bytes(path.read_bytes()[:keep])
    return out


def cut_points(size: int) -> list[int]:
    """Truncations a crash can leave: in the header, in the data, one byte short."""
    return sorted(
        {0, 4, 8, 9, 64, size // 4, size // 2, size - 4096, size - 100, size - 1} - {size}
    )


class TestSafetensors:
    def test_whole_file_reads(self, tmp_path: Path) -> None:
        path = write_safetensors(tmp_path / "model.safetensors")
        found = read_safetensors(path)
        assert found.size_bytes == path.stat().st_size
        assert found.notes == ("3 tensors",)

    def test_every_truncation_is_unreadable(self, tmp_path: Path) -> None:
        path = write_safetensors(tmp_path / "model.safetensors", rows=256)
        size = path.stat().st_size
        for keep in cut_points(size):
            with pytest.raises(Unreadable):
                read_safetensors(cut(path, keep))

    def test_offsets_beyond_the_file_and_wrong_spans_are_named(self, tmp_path: Path) -> None:
        path = write_safetensors(tmp_path / "model.safetensors")
        raw = path.read_bytes()
        length = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + length])
        name = next(k for k in header if k != "__metadata__")
        begin, end = header[name]["data_offsets"]
        header[name]["data_offsets"] = [begin, end + 4]
        text = json.dumps(header).encode()
        bad = tmp_path / "bad.safetensors"
        bad.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length :])
        with pytest.raises(Unreadable, match=name):
            read_safetensors(bad)

    def test_extra_bytes_after_the_tensors_are_refused(self, tmp_path: Path) -> None:
        path = write_safetensors(tmp_path / "model.safetensors")
        with path.open("ab") as handle:
            handle.write(b"\0" * 16)
        with pytest.raises(Unreadable, match="cover"):
            read_safetensors(path)


class TestTorchZip:
    def test_whole_file_reads_and_names_its_storages(self, tmp_path: Path) -> None:
        path = write_torch(tmp_path / "model.pt")
        assert read_torch_zip(path).notes == ("3 storages",)

    def test_every_truncation_is_unreadable(self, tmp_path: Path) -> None:
        path = write_torch(tmp_path / "model.pt", rows=256)
        for keep in cut_points(path.stat().st_size):
            with pytest.raises(Unreadable):
                read_torch_zip(cut(path, keep))

    def test_a_missing_or_short_storage_record_is_found(self, tmp_path: Path) -> None:
        path = write_torch(tmp_path / "model.pt")
        with zipfile.ZipFile(path) as archive:
            members = [(i, archive.read(i)) for i in archive.infolist()]
        record = next(i.filename for i, _ in members if "/data/" in i.filename)
        for mode in ("drop", "short"):
            out = tmp_path / f"{mode}.pt"
            with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
                for info, data in members:
                    if info.filename == record and mode == "drop":
                        continue
                    archive.writestr(info, data[:8] if info.filename == record else data)
            with pytest.raises(Unreadable, match=record.rsplit("/", 1)[-1]):
                read_torch_zip(out)

    def test_not_a_zip_is_unreadable(self, tmp_path: Path) -> None:
        path = tmp_path / "legacy.pt"
        path.write_bytes(b"\x80\x02" + b"x" * 200)
        with pytest.raises(Unreadable, match="central directory"):
            read_torch_zip(path)

    def test_the_daemon_reads_torch_files_without_importing_torch(self, tmp_path: Path) -> None:
        path = write_torch(tmp_path / "model.pt")
        code = (
            "import sys\nfrom pathlib import Path\n"
            "from collectors.checkpoints.formats import read_torch_zip\n"
            f"print(read_torch_zip(Path({str(path)!r})).notes)\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stderr
        assert "3 storages" in done.stdout


class TestDistributed:
    def test_whole_checkpoint_reads(self, tmp_path: Path) -> None:
        directory = write_dcp(tmp_path / "step_100")
        found = read_dcp_dir(directory)
        assert found.notes == ("1 shards",)
        assert directory / ".metadata" in found.files

    def test_missing_metadata_missing_and_truncated_shard(self, tmp_path: Path) -> None:
        whole = write_dcp(tmp_path / "whole")
        shard = next(p for p in whole.iterdir() if p.suffix == ".distcp")
        cases = {"no .metadata": ".metadata", "is missing": shard.name, "truncated": shard.name}
        for match, victim in cases.items():
            broken = tmp_path / match.replace(" ", "_").replace(".", "")
            shutil.copytree(whole, broken)
            if match == "truncated":
                os.truncate(broken / victim, shard.stat().st_size - 10)
            else:
                (broken / victim).unlink()
            with pytest.raises(Unreadable, match=match):
                read_dcp_dir(broken)


class TestDirectories:
    def test_hf_checkpoint_reads_with_its_step(self, tmp_path: Path) -> None:
        directory = write_hf(tmp_path / "checkpoint-500", step=500)
        candidate = classify(directory, TEMP)
        assert candidate == Candidate(directory, "hf", False)
        assert verify_structure(candidate).step == 500

    def test_a_damaged_part_of_a_directory_is_named(self, tmp_path: Path) -> None:
        directory = write_hf(tmp_path / "checkpoint-500", step=500)
        optimizer = directory / "optimizer.pt"
        os.truncate(optimizer, optimizer.stat().st_size // 2)
        with pytest.raises(Unreadable, match=r"optimizer\.pt"):
            verify_structure(Candidate(directory, "hf", False))

    def test_an_index_naming_a_missing_shard(self, tmp_path: Path) -> None:
        directory = write_hf(tmp_path / "checkpoint-7", step=7)
        index = {"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(Unreadable, match="00002"):
            verify_structure(Candidate(directory, "hf", False))

    def test_deepspeed_dir_reads(self, tmp_path: Path) -> None:
        directory = tmp_path / "global_step1200"
        directory.mkdir()
        write_torch(directory / "mp_rank_00_model_states.pt")
        write_torch(directory / "zero_pp_rank_0_mp_rank_00_optim_states.pt", seed=1)
        candidate = classify(directory, TEMP)
        assert candidate is not None and candidate.kind == "deepspeed"
        assert verify_structure(candidate).step == 1200

    def test_names_kinds_and_temporaries(self, tmp_path: Path) -> None:
        cases = {
            "model.safetensors": ("safetensors", False, None),
            "ckpt_step300.pt": ("torch", False, 300),
            "weights.pth": ("torch", False, None),
            "model.pt.tmp": ("torch", True, None),
            ".model.safetensors.x1Y2": ("safetensors", True, None),
            "model.safetensors.part": ("safetensors", True, None),
            "step-42.pt.uploading": ("torch", True, 42),
        }
        for name, (kind, temporary, step) in cases.items():
            path = tmp_path / name
            path.write_bytes(b"x")
            candidate = classify(path, TEMP)
            assert candidate is not None, name
            assert (candidate.kind, candidate.temporary, step_of(candidate)) == (
                kind,
                temporary,
                step,
            ), name
        (tmp_path / "tmp-checkpoint-9").mkdir()
        hf_temp = classify(tmp_path / "tmp-checkpoint-9", TEMP)
        assert hf_temp is not None and hf_temp.temporary and hf_temp.kind == "hf"
        for other in ("model.safetensors.sha256", "latest", "trainer.log"):
            (tmp_path / other).write_text("x")
            assert classify(tmp_path / other, TEMP) is None, other
