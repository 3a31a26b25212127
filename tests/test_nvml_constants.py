"""NVML numbers written out in collectors/_nvml.py: equal to pynvml's, and the agent imports
with an nvidia-ml-py that lacks the newest names (13.610 on the lent H200 had no
NVML_GPU_RECOVERY_ACTION_BUS_RESET, and the whole agent failed to import)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pynvml
import pytest

from collectors import _nvml

REPO = Path(__file__).resolve().parents[1]

RECOVERY_NAMES = {
    "none": "NONE",
    "gpu_reset": "GPU_RESET",
    "node_reboot": "NODE_REBOOT",
    "drain_p2p": "DRAIN_P2P",
    "drain_and_reset": "DRAIN_AND_RESET",
    "recover_imex_domain": "RECOVER_IMEX_DOMAIN",
    "bus_reset": "BUS_RESET",
    "system_reboot": "SYSTEM_REBOOT",
}
GPM_NAMES = {
    "graphics_active": "GRAPHICS_UTIL",
    "sm_active": "SM_UTIL",
    "sm_occupancy": "SM_OCCUPANCY",
    "tensor_active": "ANY_TENSOR_UTIL",
    "dram_active": "DRAM_BW_UTIL",
}


class TestNumbersMatchPynvml:
    """Where the installed pynvml has a name, the written-out number is the same."""

    @pytest.mark.parametrize(("code", "label"), sorted(_nvml.RECOVERY_ACTIONS.items()))
    def test_recovery_actions(self, code: int, label: str) -> None:
        name = f"NVML_GPU_RECOVERY_ACTION_{RECOVERY_NAMES[label]}"
        if not hasattr(pynvml, name):
            pytest.skip(f"this nvidia-ml-py has no {name}")
        assert getattr(pynvml, name) == code

    @pytest.mark.parametrize(("label", "code"), sorted(_nvml.GPM_RATIOS.items()))
    def test_gpm_ratio_ids(self, label: str, code: int) -> None:
        name = f"NVML_GPM_METRIC_{GPM_NAMES[label]}"
        if not hasattr(pynvml, name):
            pytest.skip(f"this nvidia-ml-py has no {name}")
        assert getattr(pynvml, name) == code

    def test_fields_and_versions(self) -> None:
        for name, value in (
            ("NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", _nvml.FIELD_GPU_RECOVERY_ACTION),
            ("NVML_GPM_METRICS_GET_VERSION", _nvml.GPM_METRICS_GET_VERSION),
            # nvmlEventData_t's gpuInstanceId / computeInstanceId for "no MIG instance"
            ("NVML_GPU_INSTANCE_ID_ANY", _nvml.INSTANCE_ID_NONE),
            ("NVML_COMPUTE_INSTANCE_ID_ANY", _nvml.INSTANCE_ID_NONE),
        ):
            if hasattr(pynvml, name):
                assert getattr(pynvml, name) == value, name


OLD_PYNVML = """
import pynvml
# As an nvidia-ml-py older than the driver: the names added by recent releases are missing.
for name in [n for n in dir(pynvml) if n.startswith(("NVML_GPU_RECOVERY_ACTION_",
        "NVML_GPM_", "NVML_GPU_FABRIC_", "NVML_FI_DEV_GET_GPU_RECOVERY"))
        or n in ("c_nvmlGpuFabricInfo_t", "c_nvmlGpmMetricsGet_t", "nvmlGpmQueryDeviceSupport",
                 "nvmlGpmMigSampleGet", "NVML_GPU_INSTANCE_ID_ANY",
                 "NVML_COMPUTE_INSTANCE_ID_ANY")]:
    delattr(pynvml, name)
from agent.program import registry
from collectors import _nvml
print("imported", len(registry.COLLECTORS), _nvml._HAS_GPM_API)
"""


def test_the_agent_imports_with_an_older_nvidia_ml_py() -> None:
    """The class, not the one name: any of the newer names missing costs a reading at most."""
    done = subprocess.run(
        [sys.executable, "-c", OLD_PYNVML], capture_output=True, text=True, cwd=REPO, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "False"
