"""gpuwarden diag: what the bundle holds, that no planted secret survives in any member, that the
manifest matches, that the state store is left alone, and that the write is atomic."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import IO, Any

import bcrypt
import pytest

from agent.contracts.collector import SharedServices
from agent.contracts.config import Config
from agent.contracts.model import Event, Severity
from agent.program.diagnose.bundle import MANIFEST, REDACTION_REPORT, Bundle, write_atomically
from agent.program.diagnose.diag import DiagOptions, build_bundle, secret_files
from agent.program.diagnose.redact import Redactor
from agent.runtime.state import StateStore
from collectors._nvml import NvmlBackend
from tests.support.agent_proc import AgentProcess
from tests.support.diag import load, make_proc_tree, write_config
from tests.support.nvml_fake import FakeGpu, FakeNvml
from tests.support.redaction import (
    CORPUS_DIR,
    CORPUS_FILES,
    keep_lines,
    openssl_hash,
    planted,
    surviving_secrets,
)

LEAKY_EVENT = f"upload failed for {planted()[0].value}: 403 from s3"


def read_bundle(path: Path) -> dict[str, bytes]:
    with tarfile.open(path, "r:gz") as tar:
        out = {}
        for member in tar.getmembers():
            handle = tar.extractfile(member)
            assert handle is not None
            out[member.name.split("/", 1)[1]] = handle.read()
        return out


def skipped(report: dict[str, Any]) -> dict[str, str]:
    return {entry["name"]: entry["reason"] for entry in report["skipped_files"]}


def populate_state(state_dir: Path) -> None:
    store = StateStore.open(state_dir)
    store.record_event(
        Event(
            source="bench",
            kind="upload_failed",
            severity=Severity.WARNING,
            message=LEAKY_EVENT,
            subject="GPU-5f1c2a3e",
        ),
        outbox=True,
    )
    store.put("ledger", "mqtt", {"last_delivery": 1795970000.0})
    store.put("bench", "baseline", {"tflops": 674.0})
    store.close()
    (state_dir / "bench-history.jsonl").write_text(
        json.dumps({"gpu": 0, "tflops": 671.2, "note": "run by jane.doe@example-lab.org"}) + "\n"
    )


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Config, Path]:
    cfg = load(write_config(tmp_path / "conf", proc_root=make_proc_tree(tmp_path / "proc")))
    populate_state(cfg.state_dir)
    return cfg, tmp_path


async def make_bundle(cfg: Config, out: Path, includes: tuple[Path, ...] = ()) -> dict[str, bytes]:
    options = DiagOptions(output=out, includes=includes, run_torch_probe=False, process_gap=0.05)
    path, _ = await build_bundle(cfg, options)
    assert path == out
    return read_bundle(out)


class TestContents:
    """The members support needs are there, and nothing secret is in any of them."""

    async def test_members(self, setup: tuple[Config, Path]) -> None:
        cfg, tmp = setup
        members = await make_bundle(cfg, tmp / "b.tar.gz", (CORPUS_DIR / "train.log",))
        for name in (
            MANIFEST,
            REDACTION_REPORT,
            "versions.json",
            "check.json",
            "collectors/system.json",
            "config/effective.json",
            "config/gpuwarden.toml",
            "state/summary.json",
            "state/events.json",
            "state/bench-history.jsonl",
            "include/train.log",
        ):
            assert name in members, sorted(members)
        versions = json.loads(members["versions.json"])
        assert versions["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
        assert "torch" in versions["packages"]
        summary = json.loads(members["state/summary.json"])
        assert summary["outbox"]["depth"] == 1
        assert summary["kv"]["bench"]["baseline"] == {"tflops": 674.0}
        events = json.loads(members["state/events.json"])
        assert events[0]["kind"] == "upload_failed"
        system = json.loads(members["collectors/system.json"])
        assert any(s["name"] == "gpuwarden_memory_total_bytes" for s in system["samples"])

    async def test_no_planted_secret_in_any_member(self, setup: tuple[Config, Path]) -> None:
        cfg, tmp = setup
        includes = tuple(CORPUS_DIR / name for name in CORPUS_FILES)
        members = await make_bundle(cfg, tmp / "b.tar.gz", includes)
        texts = [data.decode() for data in members.values()] + list(members)
        assert surviving_secrets(texts) == []
        assert "jane.doe@example-lab.org" not in "".join(texts)

    async def test_diagnostic_lines_survive(self, setup: tuple[Config, Path]) -> None:
        cfg, tmp = setup
        includes = tuple(CORPUS_DIR / name for name in CORPUS_FILES)
        members = await make_bundle(cfg, tmp / "b.tar.gz", includes)
        joined = "\n".join(data.decode() for data in members.values())
        assert [line for line in keep_lines() if line not in joined] == []
        assert "upload failed for [REDACTED:aws_access_key_id]: 403 from s3" in joined

    async def test_redaction_report_counts_without_values(self, setup: tuple[Config, Path]) -> None:
        cfg, tmp = setup
        members = await make_bundle(cfg, tmp / "b.tar.gz", (CORPUS_DIR / "dotenv",))
        report = json.loads(members[REDACTION_REPORT])
        assert report["by_file"]["include/dotenv"]["anthropic_key"] == 1
        assert report["by_kind"]["aws_access_key_id"] >= 1  # from the state store's event
        assert report["total"] == sum(report["by_kind"].values())

    async def test_binary_include_left_out(self, setup: tuple[Config, Path]) -> None:
        cfg, tmp = setup
        core = tmp / "core.1234"
        core.write_bytes(b"\x7fELF\x00\x00" + b"AKIAABCDEFGHIJKLMNOP")
        members = await make_bundle(cfg, tmp / "b.tar.gz", (core, tmp / "missing.log"))
        report = json.loads(members[REDACTION_REPORT])
        assert "include/core.1234" not in members
        assert "binary" in skipped(report)["include/core.1234"]
        assert "not a regular file" in skipped(report)["include/missing.log"]

    async def test_password_hashes_of_included_files_go(self, setup: tuple[Config, Path]) -> None:
        """A shadow copy and an htpasswd file asked for with --include leave no hash."""
        cfg, tmp = setup
        hashes = [openssl_hash(scheme, "hunter22") for scheme in ("1", "5", "6", "apr1")]
        hashes.append(bcrypt.hashpw(b"hunter22", bcrypt.gensalt(4)).decode())
        shadow = tmp / "shadow.bak"
        shadow.write_text("".join(f"u{i}:{h}:19700:0:99999:7:::\n" for i, h in enumerate(hashes)))
        htpasswd = tmp / "htpasswd"
        htpasswd.write_text("".join(f"u{i}:{h}\n" for i, h in enumerate(hashes)))
        members = await make_bundle(cfg, tmp / "b.tar.gz", (shadow, htpasswd))
        joined = "\n".join(data.decode() for data in members.values())
        assert [h for h in hashes if h.rsplit("$", 1)[1] in joined] == []
        assert "u0:[REDACTED:password_hash]:19700:0:99999:7:::" in joined
        report = json.loads(members[REDACTION_REPORT])
        assert report["by_file"]["include/shadow.bak"]["password_hash"] == len(hashes)


class TestGpuSnapshot:
    """The gpu collector's round (here on the fake NVML) and the NVIDIA versions are in it."""

    async def test_snapshot_and_versions(self, setup: tuple[Config, Path]) -> None:
        cfg, tmp = setup
        shared = SharedServices()
        shared.put(NvmlBackend, NvmlBackend(FakeNvml([FakeGpu.h200(0)])))
        options = DiagOptions(output=tmp / "b.tar.gz", run_torch_probe=False, process_gap=0.05)
        await build_bundle(cfg, options, shared=shared)
        members = read_bundle(tmp / "b.tar.gz")
        gpu = json.loads(members["collectors/gpu.json"])
        temperatures = [
            s for s in gpu["samples"] if s["name"] == "gpuwarden_gpu_temperature_celsius"
        ]
        assert {s["labels"]["uuid"] for s in temperatures} == {FakeGpu.h200(0).uuid}
        assert json.loads(members["versions.json"])["nvidia"]["driver_version"] == "580.159.04"
        check = json.loads(members["check.json"])
        assert any(f["name"] == "NVIDIA driver" and f["status"] == "OK" for f in check["findings"])


class TestSecretFiles:
    """Files named by `*_file` keys are never read into the bundle, even when asked for."""

    async def test_include_of_a_secret_file_is_refused(self, tmp_path: Path) -> None:
        secret = tmp_path / "mqtt-password"
        secret.write_text("Zq81-broker-pw-never-shown\n")
        secret.chmod(0o600)
        extra = (
            f'[mqtt]\nurl = "mqtt://127.0.0.1:1"\nusername = "node"\npassword_file = "{secret}"\n'
        )
        cfg = load(
            write_config(
                tmp_path / "conf", proc_root=make_proc_tree(tmp_path / "proc"), extra=extra
            )
        )
        assert secret.resolve() in secret_files(cfg)
        members = await make_bundle(cfg, tmp_path / "b.tar.gz", (secret,))
        assert all(b"Zq81-broker-pw-never-shown" not in data for data in members.values())
        report = json.loads(members[REDACTION_REPORT])
        assert "secret file" in skipped(report)["include/mqtt-password"]


class TestManifest:
    """Every member is listed with the size and SHA-256 of what is in the archive."""

    async def test_checksums_match(self, setup: tuple[Config, Path]) -> None:
        cfg, tmp = setup
        members = await make_bundle(cfg, tmp / "b.tar.gz", (CORPUS_DIR / "bash_history",))
        manifest = json.loads(members[MANIFEST])
        listed = {f["name"]: f for f in manifest["files"]}
        assert set(listed) == set(members) - {MANIFEST}
        for name, data in members.items():
            if name != MANIFEST:
                assert listed[name]["size"] == len(data)
                assert listed[name]["sha256"] == hashlib.sha256(data).hexdigest()
        assert manifest["node_id"] == "test-node-1"
        assert manifest["created_utc"].endswith("Z")


class TestStateStoreUntouched:
    """The store is read, never written: same files, same bytes."""

    async def test_stopped_agent(self, setup: tuple[Config, Path]) -> None:
        cfg, tmp = setup

        def snapshot() -> dict[str, str]:
            return {
                p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in cfg.state_dir.iterdir()
            }

        before = snapshot()
        await make_bundle(cfg, tmp / "b.tar.gz")
        assert snapshot() == before

    async def test_running_agent_wal_is_read(self, setup: tuple[Config, Path]) -> None:
        cfg, tmp = setup
        live = StateStore.open(cfg.state_dir)  # holds the WAL open, as the daemon does
        try:
            live.record_event(
                Event(
                    source="gpu",
                    kind="xid",
                    severity=Severity.CRITICAL,
                    message="Xid 79 on GPU 0000:3b:00.0",
                ),
                outbox=True,
            )
            db_before = (cfg.state_dir / "state.db").read_bytes()
            members = await make_bundle(cfg, tmp / "b.tar.gz")
            assert (cfg.state_dir / "state.db").read_bytes() == db_before
        finally:
            live.close()
        kinds = [e["kind"] for e in json.loads(members["state/events.json"])]
        assert "xid" in kinds


class TestAtomicWrite:
    """A failure mid-write leaves no final file and no temp file; an old bundle survives."""

    def test_failure_mid_write(self, tmp_path: Path) -> None:
        final = tmp_path / "bundle.tar.gz"

        def half_then_fail(handle: IO[bytes]) -> None:
            handle.write(b"\x1f\x8b" + b"x" * 100_000)
            raise OSError(28, "No space left on device")

        with pytest.raises(OSError, match="No space left"):
            write_atomically(final, half_then_fail)
        assert list(tmp_path.iterdir()) == []

    def test_old_file_kept_on_failure(self, tmp_path: Path) -> None:
        final = tmp_path / "bundle.tar.gz"
        final.write_bytes(b"previous bundle")

        def fail(handle: IO[bytes]) -> None:
            handle.write(b"partial")
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            write_atomically(final, fail)
        assert final.read_bytes() == b"previous bundle"
        assert [p.name for p in tmp_path.iterdir()] == ["bundle.tar.gz"]

    def test_bundle_tar_is_complete(self, tmp_path: Path) -> None:
        bundle = Bundle(Redactor())
        bundle.add_text("a.txt", "hello")
        bundle.finish({"format": 1})
        final = tmp_path / "b.tar.gz"
        write_atomically(final, lambda h: bundle.write_tar(h, "top", 0.0))
        with tarfile.open(final) as tar:
            assert sorted(tar.getnames()) == [
                "top/a.txt",
                "top/manifest.json",
                "top/redaction.json",
            ]
        assert io.BytesIO(final.read_bytes()).read(2) == b"\x1f\x8b"


class TestIncludeTail:
    """An --include file cut to its last bytes loses no secret to the cut."""

    def test_key_whose_begin_line_was_cut_off(self, tmp_path: Path) -> None:
        body = [
            f"{n}" * 4 + "QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo0NTY3ODkrLw" + f"{n}" * 10
            for n in range(8)
        ]
        text = "\n".join(
            [
                "step=1 loss=2.0",
                "-----BEGIN RSA PRIVATE KEY-----",
                *body,
                "-----END RSA PRIVATE KEY-----",
                "step=2 loss=1.9",
                "",
            ]
        )
        log = tmp_path / "job.log"
        log.write_text(text)
        # The cut lands inside the key's body: the BEGIN line and the first lines are gone.
        limit = len(text) - text.index(body[2])
        bundle = Bundle(Redactor())
        name = bundle.add_file("include/job.log", log, limit)
        assert name is not None
        member = bundle.members[name].decode()
        assert [line for line in body if line in member] == []
        assert member.endswith("[REDACTED:private_key]\nstep=2 loss=1.9\n")


class TestCommandLine:
    """`gpuwarden diag` as a user runs it."""

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "agent", "diag", *args],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd=Path(__file__).parent.parent,
        )

    def test_writes_and_reports(self, setup: tuple[Config, Path]) -> None:
        _, tmp = setup
        out = tmp / "out.tar.gz"
        done = self._run(
            "--config",
            str(tmp / "conf" / "gpuwarden.toml"),
            "-o",
            str(out),
            "--include",
            str(CORPUS_DIR / "dotenv"),
            "--no-torch",
            "--json",
        )
        assert done.returncode == 0, done.stderr
        data = json.loads(done.stdout)
        assert data["path"] == str(out)
        assert data["redaction"]["by_kind"]["openai_key"] == 1
        assert out.is_file()

    def test_unwritable_destination_is_exit_code_1(self, setup: tuple[Config, Path]) -> None:
        _, tmp = setup
        done = self._run(
            "--config",
            str(tmp / "conf" / "gpuwarden.toml"),
            "--no-torch",
            "-o",
            str(tmp / "no" / "such" / "dir" / "b.tar.gz"),
        )
        assert done.returncode == 1
        assert "cannot write the bundle" in done.stderr
        assert not (tmp / "no").exists()


class TestLiveAgent:
    """With the agent running: its /metrics and /healthz (the in-memory delivery ledger) and
    its live state store go into the bundle, and check sees it serving."""

    async def test_bundle_and_check_with_a_running_agent(
        self, agent_process: AgentProcess, tmp_path: Path
    ) -> None:
        agent_process.start()
        cfg = load(agent_process.config_path)
        out = tmp_path / "live.tar.gz"
        options = DiagOptions(output=out, run_torch_probe=False, process_gap=0.05)
        _, bundle = await build_bundle(cfg, options)
        members = read_bundle(out)
        metrics = members["agent/metrics.txt"].decode()
        assert metrics.startswith("# GET /metrics: HTTP 200")
        assert 'gpuwarden_sink_last_delivery_timestamp_seconds{sink="prometheus"}' in metrics
        assert members["agent/healthz.txt"].decode().startswith("# GET /healthz: HTTP ")
        # The running agent may write its database meanwhile; that diag itself never writes is
        # TestStateStoreUntouched's business. Here: the live store could be read.
        assert json.loads(members["state/summary.json"])["available"] is True
        check = json.loads(members["check.json"])
        prometheus = next(f for f in check["findings"] if f["name"].startswith("Prometheus listen"))
        assert "the agent is serving" in prometheus["detail"]
        assert not any("no live metrics" in note for note in bundle.notes)

    async def test_note_when_the_agent_is_not_running(self, setup: tuple[Config, Path]) -> None:
        cfg, tmp = setup
        _, bundle = await build_bundle(
            cfg, DiagOptions(output=tmp / "b.tar.gz", run_torch_probe=False, process_gap=0.05)
        )
        assert any("no live metrics or delivery ledger (is it running?)" in n for n in bundle.notes)
