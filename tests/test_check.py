"""gpuwarden check: statuses and exit codes on fixture trees, real sockets and real children."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from agent.contracts.model import Event, Severity
from agent.program.diagnose import probes
from agent.program.diagnose.check import CheckOptions, check_state, run_check
from agent.program.diagnose.findings import Finding, Status, exit_code
from agent.runtime.state import StateStore
from tests.support.diag import GIB_KB, load, make_proc_tree, make_tls_files, write_config
from tests.support.mosquitto import Broker
from tests.support.ports import free_port

NO_TORCH = CheckOptions(torch=False, expect_gpus=0, process_gap=0.05)


def finding(findings: list[Finding], name: str) -> Finding:
    matches = [f for f in findings if f.name.startswith(name)]
    assert len(matches) == 1, [f.name for f in findings]
    return matches[0]


class TestExitCode:
    """The worst line decides: FAIL 2, WARN 1, otherwise 0 (N/A and SKIP are not problems)."""

    @pytest.mark.parametrize(
        ("statuses", "code"),
        [
            ([Status.OK, Status.NA, Status.SKIP], 0),
            ([Status.OK, Status.WARN, Status.NA], 1),
            ([Status.WARN, Status.FAIL, Status.OK], 2),
            ([], 0),
        ],
    )
    def test_worst_wins(self, statuses: list[Status], code: int) -> None:
        assert exit_code([Finding("x", "y", s, "d") for s in statuses]) == code

    def test_event_severity_maps_to_status(self) -> None:
        assert Status.from_severity(Severity.WARNING) is Status.WARN
        assert Status.from_severity(Severity.CRITICAL) is Status.FAIL
        assert Status.from_severity(Severity.FATAL) is Status.FAIL
        assert Status.from_severity(Severity.INFO) is Status.OK


class TestMemoryOnFixtureTrees:
    """The system collector's own round on a fixture /proc, judged against the thresholds."""

    @pytest.mark.parametrize(
        ("available_gib", "status", "code"),
        [
            (48, Status.OK, 0),
            (5, Status.WARN, 1),
            (2, Status.FAIL, 2),
        ],
    )
    async def test_memory_status_and_exit_code(
        self, tmp_path: Path, available_gib: int, status: Status, code: int
    ) -> None:
        proc = make_proc_tree(tmp_path / "proc", 64 * GIB_KB, available_gib * GIB_KB)
        cfg = load(write_config(tmp_path, proc_root=proc))
        report = await run_check(cfg, NO_TORCH)
        memory = finding(report.findings, "memory")
        assert memory.status is status
        assert f"{available_gib:.1f} GiB available of 64.0 GiB" in memory.detail
        assert report.exit_code == code
        assert report.collectors["system"].ok

    async def test_unreadable_proc_is_a_warning_not_a_crash(self, tmp_path: Path) -> None:
        cfg = load(write_config(tmp_path, proc_root=tmp_path / "nowhere"))
        report = await run_check(cfg, NO_TORCH)
        memory = finding(report.findings, "memory")
        assert memory.status is Status.WARN
        assert "FileNotFoundError" in memory.detail


class TestStateDir:
    """Writable or creatable is OK; a file in the way fails; nothing is written."""

    def test_existing_writable(self, tmp_path: Path) -> None:
        assert probes.check_state_dir(tmp_path).status is Status.OK

    def test_creatable(self, tmp_path: Path) -> None:
        line = probes.check_state_dir(tmp_path / "a" / "b")
        assert line.status is Status.OK
        assert "does not exist yet" in line.detail
        assert not (tmp_path / "a").exists()

    def test_file_in_the_way(self, tmp_path: Path) -> None:
        (tmp_path / "blocker").write_text("")
        line = probes.check_state_dir(tmp_path / "blocker" / "state")
        assert line.status is Status.FAIL
        assert "not a directory" in line.detail

    @pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
    def test_not_writable(self, tmp_path: Path) -> None:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
        assert probes.check_state_dir(locked).status is Status.FAIL


class TestStateStore:
    """Outbox depth from the real store, read without changing it."""

    def _store(self, tmp_path: Path, entries: int) -> Path:
        state_dir = tmp_path / "state"
        store = StateStore.open(state_dir)
        for i in range(entries):
            store.outbox_put("event", f"e{i}", b"{}")
        store.record_event(
            Event(
                source="disk", kind="disk_full", severity=Severity.WARNING, message="/ is 97% full"
            ),
            outbox=False,
        )
        store.close()
        return tmp_path

    @pytest.mark.parametrize(("entries", "status"), [(3, Status.OK), (1001, Status.WARN)])
    def test_outbox_depth(self, tmp_path: Path, entries: int, status: Status) -> None:
        cfg = load(write_config(self._store(tmp_path, entries)))
        before = sorted(p.name for p in cfg.state_dir.iterdir())
        line = finding(check_state(cfg), "state store")
        assert line.status is status
        assert f"outbox depth {entries}" in line.detail
        assert sorted(p.name for p in cfg.state_dir.iterdir()) == before

    def test_no_store_yet(self, tmp_path: Path) -> None:
        cfg = load(write_config(tmp_path))
        assert finding(check_state(cfg), "state store").status is Status.NA


class TestPrometheusAddress:
    """A free port is OK, an answering agent is read, an address of another host fails."""

    async def test_free_port(self) -> None:
        line = await probes.check_prometheus_listen("127.0.0.1", free_port())
        assert line.status is Status.OK
        assert "free" in line.detail

    @pytest.mark.parametrize(
        ("reply", "status"),
        [
            (b"HTTP/1.0 200 OK\r\n\r\nok\n", Status.OK),
            (b"HTTP/1.0 503 Service Unavailable\r\n\r\ndegraded\n", Status.WARN),
            (b"HTTP/1.0 401 Unauthorized\r\n\r\n", Status.OK),
            (b"SSH-2.0-OpenSSH_9.2\r\n", Status.WARN),
        ],
    )
    async def test_something_answers(self, reply: bytes, status: Status) -> None:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(reply)
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            line = await probes.check_prometheus_listen("127.0.0.1", port)
        assert line.status is status

    async def test_address_of_another_host(self) -> None:
        # 192.0.2.0/24 is TEST-NET-1 (RFC 5737): never an address of this machine.
        line = await probes.check_prometheus_listen("192.0.2.10", free_port())
        assert line.status is Status.FAIL


class TestBroker:
    """A real mosquitto: TCP connect, and a TLS handshake verified against a CA file."""

    async def test_reachable(self, broker: Broker) -> None:
        line = await probes.check_broker(probes.Endpoint("127.0.0.1", broker.port, tls=False))
        assert line.status is Status.OK
        assert "TCP connect ok" in line.detail

    async def test_refused(self) -> None:
        line = await probes.check_broker(probes.Endpoint("127.0.0.1", free_port(), tls=False))
        assert line.status is Status.FAIL
        assert "refused" in line.detail

    async def test_tls_verified(self, tmp_path: Path) -> None:
        ca, cert, key = make_tls_files(tmp_path / "tls")
        # Started as root, mosquitto drops to its own user, which cannot read pytest's private
        # tmp dirs; `user root` keeps it able to load the key.
        keep_user = ["user root"] if os.geteuid() == 0 else []
        tls_broker = Broker(
            tmp_path / "broker",
            extra_config=[*keep_user, f"cafile {ca}", f"certfile {cert}", f"keyfile {key}"],
        ).start()
        try:
            endpoint = probes.Endpoint("127.0.0.1", tls_broker.port, tls=True)
            good = await probes.check_broker(endpoint, probes.TlsFiles(ca_file=ca))
            unknown_ca = await probes.check_broker(endpoint)
        finally:
            tls_broker.stop()
        assert good.status is Status.OK
        assert "TLS handshake ok" in good.detail
        assert unknown_ca.status is Status.FAIL
        assert "certificate" in unknown_ca.detail

    async def test_tls_against_plain_listener_fails(self, broker: Broker) -> None:
        line = await probes.check_broker(probes.Endpoint("127.0.0.1", broker.port, tls=True))
        assert line.status is Status.FAIL

    async def test_from_the_configuration(self, tmp_path: Path, broker: Broker) -> None:
        extra = f'[mqtt]\nenabled = true\nurl = "{broker.url}"\n'
        cfg = load(write_config(tmp_path, proc_root=make_proc_tree(tmp_path / "proc"), extra=extra))
        report = await run_check(cfg, NO_TORCH)
        line = finding(report.findings, "MQTT broker")
        assert line.status is Status.OK
        assert line.name == f"MQTT broker 127.0.0.1:{broker.port}"


class TestTorch:
    """The probe runs in a child interpreter; each outcome maps to a status."""

    @pytest.mark.parametrize(
        ("probe", "gpus", "status"),
        [
            ({"missing": "No module named 'torch'"}, True, Status.NA),
            ({"error": "no answer within 90 s", "timeout": True}, True, Status.WARN),
            ({"error": "exit code -11: Segmentation fault"}, True, Status.FAIL),
            ({"version": "2.13.0+cpu", "cuda_build": None}, False, Status.NA),
            ({"version": "2.13.0+cpu", "cuda_build": None}, True, Status.WARN),
            (
                {
                    "version": "2.11.0",
                    "cuda_build": "13.0",
                    "available": False,
                    "warnings": ["The NVIDIA driver on your system is too old"],
                },
                True,
                Status.FAIL,
            ),
            (
                {
                    "version": "2.11.0",
                    "cuda_build": "13.0",
                    "available": True,
                    "device_count": 1,
                    "arch_list": ["sm_80", "sm_90"],
                    "capabilities": [[9, 0]],
                    "op_ok": True,
                },
                True,
                Status.OK,
            ),
            (
                {
                    "version": "2.11.0",
                    "cuda_build": "13.0",
                    "available": True,
                    "device_count": 1,
                    "arch_list": ["sm_80"],
                    "capabilities": [[10, 0]],
                    "op_ok": True,
                },
                True,
                Status.FAIL,
            ),
        ],
    )
    def test_classification(self, probe: dict[str, object], gpus: bool, status: Status) -> None:
        assert probes.classify_torch(probe, gpus, "python3").status is status

    async def test_real_child_reports_the_installed_torch(self) -> None:
        from importlib import metadata

        probe = await probes.run_torch_probe()
        assert probe["version"] == metadata.version("torch")
        assert probe["pid"] != os.getpid()  # the probe ran in a child, not here

    async def test_interpreter_without_torch(self, tmp_path: Path) -> None:
        fake = tmp_path / "python"
        fake.write_text('#!/bin/sh\nexec /usr/bin/env -i python3 -I -S "$@"\n')
        fake.chmod(0o755)
        probe = await probes.run_torch_probe(str(fake))
        assert "missing" in probe

    async def test_hanging_child_times_out(self, tmp_path: Path) -> None:
        fake = tmp_path / "python"
        fake.write_text("#!/bin/sh\nexec sleep 30\n")
        fake.chmod(0o755)
        probe = await probes.run_torch_probe(str(fake), timeout=0.5)
        assert probe.get("timeout") is True


class TestCommandLine:
    """`gpuwarden check` as a user runs it: table or JSON, and the exit code."""

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "agent", "check", *args],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd=Path(__file__).parent.parent,
        )

    def test_json_on_this_machine(self, tmp_path: Path) -> None:
        cfg = write_config(tmp_path, proc_root=make_proc_tree(tmp_path / "proc"))
        done = self._run("--config", str(cfg), "--json", "--no-torch")
        data = json.loads(done.stdout)
        driver = next(f for f in data["findings"] if f["name"] == "NVIDIA driver")
        expected = 0 if Path("/proc/driver/nvidia/version").exists() else 2
        assert done.returncode == data["exit_code"] == expected
        assert driver["status"] == ("OK" if expected == 0 else "FAIL")

    def test_table_without_gpus_expected(self, tmp_path: Path) -> None:
        cfg = write_config(tmp_path, proc_root=make_proc_tree(tmp_path / "proc"))
        done = self._run("--config", str(cfg), "--expect-gpus", "0", "--no-torch")
        assert done.returncode == 0, done.stdout + done.stderr
        assert "N/A   GPUs " in done.stdout
        assert "\x1b[" not in done.stdout  # no colours when not on a terminal
        assert done.stdout.splitlines()[-1].startswith("OK: ")  # led by the worst status

    def test_bad_config_is_exit_code_2(self, tmp_path: Path) -> None:
        bad = tmp_path / "bad.toml"
        bad.write_text("nodeid = 1\n")
        done = self._run("--config", str(bad))
        assert done.returncode == 2
        assert "nodeid" in done.stderr
