"""Who uses each GPU: compute processes with their memory, name, user and cgroup owner.

The owner comes from `/proc/<pid>/cgroup` in every shape the fleet has (cgroup v1 and v2; a
systemd service, a docker container under either cgroup driver, containerd and CRI-O under the
kubelet, a login session), the user from the owner of `/proc/<pid>`. Cardinality is bounded: the
top `top_processes` by memory per GPU; the series of a process that left disappear.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.program.diagnose.collect_once import CollectorResult
from agent.program.diagnose.findings import Status
from agent.program.diagnose.gpu_findings import classify_gpus
from collectors._procfs import parse_cgroup, read_owner
from collectors.gpu.collector import GpuSettings
from tests.support.nvml import GpuRig, fake_gpus, find
from tests.support.nvml_fake import FakeNvml, FakeProcess

MiB = 2**20
C64 = "4f3c" * 16  # a 64-hex container id
POD = "0b7f3a52-91c4-4d6e-9a3e-2f5d6c7e8f90"

# (cgroup file, unit, container id, pod uid): one row per shape seen on GPU hosts.
SHAPES = [
    pytest.param("0::/system.slice/slurmd.service\n", "slurmd.service", "", "", id="v2-service"),
    pytest.param(
        "0::/user.slice/user-1000.slice/session-4.scope\n",
        "session-4.scope",
        "",
        "",
        id="v2-session",
    ),
    pytest.param(
        f"0::/system.slice/docker-{C64}.scope\n", f"docker-{C64}.scope", C64, "", id="v2-docker"
    ),
    pytest.param(
        "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
        f"{POD.replace('-', '_')}.slice/cri-containerd-{C64}.scope\n",
        f"cri-containerd-{C64}.scope",
        C64,
        POD,
        id="v2-kubelet-containerd-systemd",
    ),
    pytest.param(
        f"0::/kubepods.slice/kubepods-pod{POD.replace('-', '_')}.slice/crio-{C64}.scope\n",
        f"crio-{C64}.scope",
        C64,
        POD,
        id="v2-kubelet-crio-guaranteed",
    ),
    pytest.param(
        f"0::/kubepods/besteffort/pod{POD}/{C64}\n", "", C64, POD, id="v2-kubelet-cgroupfs"
    ),
    pytest.param(
        "12:memory:/docker/" + C64 + "\n11:cpu,cpuacct:/docker/" + C64 + "\n"
        "1:name=systemd:/docker/" + C64 + "\n0::/\n",
        "",
        C64,
        "",
        id="v1-docker-cgroupfs",
    ),
    pytest.param(
        f"13:pids:/kubepods/burstable/pod{POD}/{C64}\n"
        f"4:memory:/kubepods/burstable/pod{POD}/{C64}\n"
        f"1:name=systemd:/kubepods/burstable/pod{POD}/{C64}\n",
        "",
        C64,
        POD,
        id="v1-kubelet-cgroupfs",
    ),
    pytest.param(
        "5:memory:/system.slice/jupyter.service\n1:name=systemd:/system.slice/jupyter.service\n",
        "jupyter.service",
        "",
        "",
        id="v1-service",
    ),
    pytest.param(
        f"0::/system.slice/containerd.service/default/{C64}\n",
        "containerd.service",
        C64,
        "",
        id="v2-containerd-nerdctl",
    ),
    pytest.param("0::/\n", "", "", "", id="v2-root"),
    pytest.param("", "", "", "", id="empty"),
]


class TestCgroupShapes:
    @pytest.mark.parametrize(("text", "unit", "container", "pod"), SHAPES)
    def test_owner(self, text: str, unit: str, container: str, pod: str) -> None:
        owner = parse_cgroup(text)
        assert (owner.unit, owner.container_id, owner.pod_uid) == (unit, container, pod)

    def test_garbage_lines_are_not_an_owner(self) -> None:
        owner = parse_cgroup("not a cgroup line\n::\n7:memory\n")
        assert (owner.unit, owner.container_id, owner.pod_uid) == ("", "", "")


def fake_proc(root: Path, pid: int, comm: str, cgroup: str, uid: int = 0) -> None:
    """A /proc/<pid> with the files read: comm, cgroup, and the directory's owner."""
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "comm").write_text(comm + "\n")
    (d / "cgroup").write_text(cgroup)
    os.chown(d, uid, uid)


class TestReadOwner:
    def test_real_child_process(self) -> None:
        child = subprocess.Popen(
            [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(30)"],
            stdout=subprocess.PIPE,
        )
        try:
            assert child.stdout is not None
            assert child.stdout.readline() == b"up\n"  # exec'd: comm is the interpreter's now
            owner = read_owner(Path("/proc"), child.pid)
            assert owner is not None
            assert owner.pid == child.pid
            assert owner.name == Path(sys.executable).name[:15]
            assert owner.user == pwd.getpwuid(os.getuid()).pw_name
            wanted = parse_cgroup(Path(f"/proc/{child.pid}/cgroup").read_text())
            assert owner.cgroup == wanted
        finally:
            child.kill()
            child.wait()
        assert read_owner(Path("/proc"), child.pid) is None  # gone: no owner, no error

    def test_unknown_uid_is_the_number(self, tmp_path: Path) -> None:
        fake_proc(tmp_path, 42, "python3", "0::/system.slice/x.service\n", uid=54321)
        owner = read_owner(tmp_path, 42)
        assert owner is not None
        assert owner.user == "54321"
        assert owner.name == "python3"
        assert owner.cgroup.unit == "x.service"


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    fake_proc(tmp_path, 100, "train.py", "0::/system.slice/trainer.service\n")
    fake_proc(
        tmp_path,
        200,
        "python3",
        "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
        f"{POD.replace('-', '_')}.slice/cri-containerd-{C64}.scope\n",
        uid=1000,
    )
    fake_proc(tmp_path, 300, "small", "0::/user.slice/user-0.slice/session-1.scope\n")
    return tmp_path


@pytest.fixture
async def rig(proc: Path) -> AsyncIterator[GpuRig]:
    gpus = fake_gpus(2)
    gpus[0].processes = [
        FakeProcess(100, 40_000 * MiB),
        FakeProcess(200, 70_000 * MiB),
        FakeProcess(300, 500 * MiB),
    ]
    settings = GpuSettings(event_thread=False, proc_root=str(proc), top_processes=2)
    instance = GpuRig(FakeNvml(gpus), settings=settings)
    yield instance
    await instance.close()


def procs(result: object, gpu: str) -> dict[str, dict[str, str]]:
    return {
        s.labels["pid"]: {**s.labels, "value": str(s.value)}
        for s in find(result, "gpuwarden_gpu_process_memory_used_bytes", gpu=gpu)  # type: ignore[arg-type]
    }


class TestCollector:
    async def test_top_n_by_memory_with_owners(self, rig: GpuRig) -> None:
        result = await rig.collect()
        shown = procs(result, "0")
        assert set(shown) == {"100", "200"}  # the top 2 by memory; 300 (500 MiB) left out
        assert shown["200"]["value"] == str(float(70_000 * MiB))
        assert shown["200"]["process"] == "python3"
        assert shown["200"]["pod_uid"] == POD
        assert shown["200"]["container_id"] == C64
        assert shown["200"]["user"] == (pwd.getpwuid(1000).pw_name if _has_uid(1000) else "1000")
        assert shown["100"]["unit"] == "trainer.service"
        assert shown["100"]["uuid"] == rig.fake.gpus[0].uuid
        assert procs(result, "1") == {}
        # the count still says all three
        count = find(result, "gpuwarden_gpu_compute_processes", gpu="0")
        assert [s.value for s in count] == [3]

    async def test_gone_processes_disappear_and_new_ones_appear(self, rig: GpuRig) -> None:
        await rig.collect()
        rig.fake.gpus[0].processes = [FakeProcess(300, 500 * MiB)]
        result = await rig.collect()
        assert set(procs(result, "0")) == {"300"}
        rig.fake.gpus[0].processes = []
        result = await rig.collect()
        assert procs(result, "0") == {}

    async def test_process_gone_from_proc_keeps_pid(self, rig: GpuRig) -> None:
        # NVML lists a pid that /proc no longer has (it exited between the two reads, or it
        # lives in another pid namespace): the series stays, with what is known.
        rig.fake.gpus[1].processes = [FakeProcess(999, 10 * MiB)]
        result = await rig.collect()
        shown = procs(result, "1")
        assert set(shown) == {"999"}
        assert shown["999"]["process"] == ""
        assert shown["999"]["unit"] == ""

    async def test_memory_not_available_sorts_last_and_has_no_series(self, rig: GpuRig) -> None:
        rig.fake.gpus[0].processes = [FakeProcess(100, None), FakeProcess(300, 1 * MiB)]
        result = await rig.collect()
        assert set(procs(result, "0")) == {"300"}
        count = find(result, "gpuwarden_gpu_compute_processes", gpu="0")
        assert [s.value for s in count] == [2]

    async def test_owner_read_once_per_process(self, rig: GpuRig, proc: Path) -> None:
        await rig.collect()
        # A changed cgroup file is not re-read while the pid stays on the GPU: the owner of a
        # running process is read once (a steady round makes no /proc reads).
        (proc / "100" / "cgroup").write_text("0::/system.slice/other.service\n")
        result = await rig.collect()
        assert procs(result, "0")["100"]["unit"] == "trainer.service"
        rig.fake.gpus[0].processes = []
        await rig.collect()
        rig.fake.gpus[0].processes = [FakeProcess(100, 1 * MiB)]
        result = await rig.collect()
        assert procs(result, "0")["100"]["unit"] == "other.service"  # a new process: read again

    async def test_zero_disables(self, proc: Path) -> None:
        gpus = fake_gpus(1)
        gpus[0].processes = [FakeProcess(100, 1 * MiB)]
        rig = GpuRig(
            FakeNvml(gpus),
            settings=GpuSettings(event_thread=False, proc_root=str(proc), top_processes=0),
        )
        try:
            result = await rig.collect()
        finally:
            await rig.close()
        assert procs(result, "0") == {}
        assert [s.value for s in find(result, "gpuwarden_gpu_compute_processes")] == [1]

    async def test_unsupported_list_is_absent(self, rig: GpuRig) -> None:
        rig.fake.gpus[0].unsupported.add("nvmlDeviceGetComputeRunningProcesses")
        result = await rig.collect()
        assert procs(result, "0") == {}
        assert find(result, "gpuwarden_gpu_compute_processes", gpu="0") == []


class TestCheck:
    async def test_check_names_the_processes(self, rig: GpuRig) -> None:
        result = await rig.collect()
        findings = classify_gpus(CollectorResult("gpu", result.samples, result.events), expected=2)
        lines = [f for f in findings if f.name.endswith("processes")]
        assert len(lines) == 2, [f.name for f in findings]  # one line per GPU, never folded
        gpu0, gpu1 = lines
        assert gpu0.name == "GPU 0 processes"
        assert gpu0.status is Status.OK
        assert "pid 200" in gpu0.detail and "python3" in gpu0.detail and POD in gpu0.detail
        assert "trainer.service" in gpu0.detail
        assert "3 processes" in gpu0.detail and "1 more" in gpu0.detail
        assert gpu0.detail.index("pid 200") < gpu0.detail.index("pid 100")  # largest first
        assert gpu1.name == "GPU 1 processes"
        assert gpu1.detail == "none"


def _has_uid(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True
