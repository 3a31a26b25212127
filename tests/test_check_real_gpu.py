"""check and diag on a real NVIDIA GPU: the lines a healthy H200 must give, and a bundle with
nvidia-smi -q and the GPU snapshot in it.

Run on the GPU machine: `python -m pytest -q -m gpu tests/test_check_real_gpu.py`. Without NVML
every test here skips. Synchronous on purpose (the GPU machine may lack pytest-asyncio).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from collectors._nvml import NvmlBackend, NvmlUnavailable
from tests.support.diag import write_config

pytestmark = [pytest.mark.gpu]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def nvml() -> None:
    backend = NvmlBackend()
    try:
        backend.start()
    except NvmlUnavailable as exc:
        pytest.skip(f"no NVML here: {exc}")
    backend.stop()


def gpuwarden(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=ROOT,
    )


class TestCheckOnRealGpu:
    """The driver and every GPU answer; nothing here is N/A that an H200 reports."""

    def test_driver_and_gpu_lines(self, nvml: None, tmp_path: Path) -> None:
        config = write_config(tmp_path)
        done = gpuwarden("check", "--config", str(config), "--json")
        data = json.loads(done.stdout)
        lines = {f["name"]: f for f in data["findings"]}
        driver = lines["NVIDIA driver"]
        assert driver["status"] == "OK", driver
        assert "CUDA" in driver["detail"]
        assert lines["GPU count"]["status"] == "OK"
        identity = [f for f in data["findings"] if f["name"].endswith("identity")]
        assert identity and all(f["status"] == "OK" for f in identity)
        temperature = [f for f in data["findings"] if f["name"].endswith("temperature")]
        assert temperature and all(f["status"] in ("OK", "WARN", "FAIL") for f in temperature)
        torch_line = lines["torch on this driver"]
        assert torch_line["status"] in ("OK", "N/A"), (
            torch_line
        )  # OK where a CUDA torch is installed
        assert done.returncode == data["exit_code"]


class TestDiagOnRealGpu:
    """The bundle holds nvidia-smi -q and the GPU snapshot, UUIDs intact."""

    def test_bundle(self, nvml: None, tmp_path: Path) -> None:
        config = write_config(tmp_path)
        out = tmp_path / "bundle.tar.gz"
        done = gpuwarden("diag", "--config", str(config), "-o", str(out), "--json")
        assert done.returncode == 0, done.stderr
        with tarfile.open(out) as tar:
            names = {n.split("/", 1)[1] for n in tar.getnames()}
            top = tar.getnames()[0].split("/", 1)[0]
            handle = tar.extractfile(f"{top}/collectors/gpu.json")
            assert handle is not None
            gpu = json.loads(handle.read())
        assert "nvidia-smi-q.txt" in names
        uuids = {s["labels"]["uuid"] for s in gpu["samples"] if "uuid" in s["labels"]}
        assert uuids and all(u.startswith("GPU-") for u in uuids)
