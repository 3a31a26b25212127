"""dcgm-exporter compatibility: configs/prometheus/dcgm-compat-rules.yml rebuilds
dcgm-exporter's series (DCGM's names, labels and units) from gpuwarden's, so that NVIDIA's own
Grafana dashboard works unchanged.

- the info label the rules join on (the PCI address in NVML's form);
- the rules file: promtool accepts it, its promtool unit test passes, that test's input series
  are what the agent really renders, every rule has a unit test and an expected value here;
- end to end: the real agent on a fake NVML (2 GPUs, GPM supported) scraped by a real
  Prometheus that loads the rules; every DCGM series has DCGM's label set and the fake's value
  in DCGM's unit, and every query of NVIDIA's dashboard (variables included, substituted as
  Grafana does) returns series through the HTTP API; the same with the second GPU in MIG mode,
  its series then per GPU instance (GPU_I_ID, GPU_I_PROFILE) as dcgm-exporter gives them;
- on a real GPU (`gpu`, Hopper or later; the lead runs them on the H200): the NVML-form address
  is the one nvidia-smi prints, and the real agent scraped by a real Prometheus answers every
  dashboard query with nvidia-smi's labels (the same checks run on the fake here).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from collectors._nvml import NvmlBackend, NvmlUnavailable
from collectors.gpu.collector import GpuSettings
from tests.support.agent_proc import AgentProcess
from tests.support.fake_gpu_agent import MIB, scripted_gpus, scripted_mig_gpus
from tests.support.grafana import (
    LEGEND_LABEL,
    Dashboard,
    Panel,
    Variable,
    query_all_panels,
    resolve,
)
from tests.support.nvml import GpuRig, find
from tests.support.nvml_fake import FakeGpu, FakeMemory, FakeNvml
from tests.support.prometheus_server import PrometheusServer
from tests.support.rules import ROOT, declared_metric_names, promtool
from tests.test_gpu_promtool import exposition
from tests.test_gpu_real import one_round

DCGM_RULES = ROOT / "configs/prometheus/dcgm-compat-rules.yml"
DCGM_RULE_TESTS = ROOT / "configs/prometheus/tests/dcgm-compat-rules.test.yml"
DOCS = ROOT / "docs/dcgm-compat.md"
LABELS_RULE = "gpuwarden:dcgm_labels:info"
INFO_RULES = frozenset({"gpuwarden:dcgm_gpu:info", "gpuwarden:dcgm_gpu_instance:info", LABELS_RULE})
"""The rules that record labels, not a DCGM series."""
NODE = "test-node"
GPUS = 2

# -- NVIDIA's dashboard: the facts of its published versions ---------------------------------

_REPO = "https://github.com/NVIDIA/dcgm-exporter/blob"
RELEASED = Dashboard(
    title="NVIDIA DCGM Exporter Dashboard (uid Oxed_c6Wz)",
    source=f"{_REPO}/d5e5f510a1b6b393f39a43293ccd9dc985defc79/grafana/dcgm-exporter-dashboard.json",
    commit="d5e5f510a1b6b393f39a43293ccd9dc985defc79",
    version="main of 2026-05-12; the file is unchanged since cffaeb8 ('Fix Grafana dashboard "
    "(#183)', 2023-08-11) and the same in every release from 3.2.5-3.1.7 to 4.5.3-4.8.2 "
    "(JSON version 1, schemaVersion 22). The project's README calls grafana.com dashboard "
    "12239 the official one; the repository's file is what this list is taken from.",
    variables=(
        Variable("instance", "label_values(DCGM_FI_DEV_GPU_TEMP, instance)"),
        Variable("gpu", "label_values(DCGM_FI_DEV_GPU_TEMP, gpu)"),
    ),
    panels=(
        Panel(
            "GPU Temperature",
            'DCGM_FI_DEV_GPU_TEMP{instance=~"$instance", gpu=~"$gpu"}',
            "GPU {{gpu}}",
        ),
        Panel("GPU Avg. Temp", 'avg(DCGM_FI_DEV_GPU_TEMP{instance=~"$instance", gpu=~"$gpu"})'),
        Panel(
            "GPU Power Usage",
            'DCGM_FI_DEV_POWER_USAGE{instance=~"$instance", gpu=~"$gpu"}',
            "GPU {{gpu}}",
        ),
        Panel(
            "GPU Power Total", 'sum(DCGM_FI_DEV_POWER_USAGE{instance=~"$instance", gpu=~"$gpu"})'
        ),
        Panel(
            "GPU SM Clocks",
            'DCGM_FI_DEV_SM_CLOCK{instance=~"$instance", gpu=~"$gpu"} * 1000000',
            "GPU {{gpu}}",
        ),
        Panel(
            "GPU Utilization",
            'DCGM_FI_DEV_GPU_UTIL{instance=~"$instance", gpu=~"$gpu"}',
            "GPU {{gpu}}",
        ),
        Panel(
            "GPU Framebuffer Mem Used",
            'DCGM_FI_DEV_FB_USED{instance=~"$instance", gpu=~"$gpu"}',
            "GPU {{gpu}}",
        ),
        Panel(
            "Tensor Core Utilization",
            'DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{instance=~"$instance", gpu=~"$gpu"}',
            "GPU {{gpu}}",
        ),
    ),
)
# The rework proposed upstream (not merged when this was written): Hostname instead of
# instance, MIG-aware aggregations, FB_FREE and GR_ENGINE_ACTIVE. Users import it from the PR.
REWORK = Dashboard(
    title="NVIDIA DCGM Exporter Dashboard (uid Oxed_c6Wz), reworked",
    source=f"{_REPO}/a52c9c0561c216b9deb848093f1459a0a946a3b5/grafana/dcgm-exporter-dashboard.json",
    commit="a52c9c0561c216b9deb848093f1459a0a946a3b5",
    version="pull request #355 '[dashboard] Rework dashboard (MIG support, Grafana "
    "deprecations, Hostname)', 2024-07-08 (JSON version 1, schemaVersion 37)",
    variables=(
        Variable("Hostname", "label_values(DCGM_FI_DEV_FB_FREE, Hostname)"),
        Variable("gpu", 'label_values(DCGM_FI_DEV_FB_FREE{Hostname=~"$Hostname"}, gpu)'),
    ),
    panels=(
        Panel(
            "GPU Temperature",
            'max(DCGM_FI_DEV_GPU_TEMP{Hostname=~"$Hostname", gpu=~"$gpu"}) by (Hostname, gpu, uuid)',
            "{{Hostname}} - GPU {{gpu}}",
        ),
        Panel("GPU Avg. Temp", 'avg(DCGM_FI_DEV_GPU_TEMP{Hostname=~"$Hostname", gpu=~"$gpu"})'),
        Panel(
            "GPU Power Usage",
            'max(DCGM_FI_DEV_POWER_USAGE{Hostname=~"$Hostname", gpu=~"$gpu"}) by (Hostname, gpu, uuid)',
            "{{Hostname}} - GPU {{gpu}}",
        ),
        Panel(
            "GPU Power Total",
            'sum(max(DCGM_FI_DEV_POWER_USAGE{Hostname=~"$Hostname", gpu=~"$gpu"}) by (gpu))',
        ),
        Panel(
            "GPU SM Clocks",
            'max(DCGM_FI_DEV_SM_CLOCK{Hostname=~"$Hostname", gpu=~"$gpu"} * 1000000) '
            "by (Hostname, UUID, gpu)",
            "{{Hostname}} - GPU {{gpu}}",
        ),
        Panel(
            "GPU Utilization",
            'max(DCGM_FI_PROF_GR_ENGINE_ACTIVE{Hostname=~"$Hostname", gpu=~"$gpu"}) '
            "by (Hostname, gpu, GPU_I_ID, GPU_I_PROFILE)",
            "GPU {{gpu}}/{{GPU_I_ID}} ({{GPU_I_PROFILE}})",
        ),
        Panel(
            "Tensor Core Utilization",
            'max(DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{Hostname=~"$Hostname", gpu=~"$gpu"}) '
            "by (Hostname, gpu, GPU_I_ID, GPU_I_PROFILE)",
            "{{Hostname}} GPU {{gpu}}/{{GPU_I_ID}} ({{GPU_I_PROFILE}})",
        ),
        Panel(
            "GPU Framebuffer Mem Used",
            'max(DCGM_FI_DEV_FB_USED{Hostname=~"$Hostname", gpu=~"$gpu"}) '
            "by (Hostname, gpu, GPU_I_ID, GPU_I_PROFILE)",
            "{{Hostname}} - GPU {{gpu}}/{{GPU_I_ID}} ({{GPU_I_PROFILE}})",
        ),
    ),
)
DASHBOARDS = (RELEASED, REWORK)
MIG_ONLY_LABELS = frozenset({"GPU_I_ID", "GPU_I_PROFILE"})
"""dcgm-exporter sets these on MIG instances only; a legend shows them empty elsewhere."""

# -- DCGM's series: labels, and each value in DCGM's unit from the fake's NVML answer --------

DCGM_LABELS = frozenset(
    {"gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname", "DCGM_FI_DRIVER_VERSION"}
)
"""What dcgm-exporter 4.5.3-4.8.2 labels a GPU series with (internal/pkg/rendermetrics),
besides the scrape's instance and job."""

_ECC = {
    ("SBE", "VOL"): (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC),
    ("DBE", "VOL"): (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC),
    ("SBE", "AGG"): (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_AGGREGATE_ECC),
    ("DBE", "AGG"): (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_AGGREGATE_ECC),
}
_NVLINK = {
    "CRC_FLIT": pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT,
    "CRC_DATA": pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA,
    "REPLAY": pynvml.NVML_NVLINK_ERROR_DL_REPLAY,
    "RECOVERY": pynvml.NVML_NVLINK_ERROR_DL_RECOVERY,
}
_RATIOS = {
    "GR_ENGINE_ACTIVE": pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL,
    "SM_ACTIVE": pynvml.NVML_GPM_METRIC_SM_UTIL,
    "SM_OCCUPANCY": pynvml.NVML_GPM_METRIC_SM_OCCUPANCY,
    "PIPE_TENSOR_ACTIVE": pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL,
    "DRAM_ACTIVE": pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL,
}
_THROUGHPUTS = {
    "PCIE_TX_BYTES": pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC,
    "PCIE_RX_BYTES": pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC,
    "NVLINK_TX_BYTES": pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC,
    "NVLINK_RX_BYTES": pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC,
}
_SBE_PAGES = pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
_DBE_PAGES = pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR


def dcgm_values(g: FakeGpu) -> dict[str, float]:
    """Each DCGM series of this GPU, in DCGM's unit, from what the fake NVML answers (the
    utilizations only where NVML gives them: not on a GPU in MIG mode)."""
    memory, utilization, rows = g.memory, g.utilization, g.remapped_rows
    assert memory is not None and rows is not None
    assert g.retired_pages is not None and g.gpm is not None
    values = {
        "DCGM_FI_DEV_GPU_TEMP": float(g.temperature or 0),
        "DCGM_FI_DEV_MEMORY_TEMP": float(g.memory_temperature or 0),
        "DCGM_FI_DEV_POWER_USAGE": (g.power_mw or 0) / 1000,  # W
        "DCGM_FI_DEV_ENFORCED_POWER_LIMIT": (g.power_limit_mw or 0) / 1000,
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": float(g.energy_mj or 0),  # mJ
        "DCGM_FI_DEV_SM_CLOCK": float(g.clocks_mhz[pynvml.NVML_CLOCK_SM]),  # MHz
        "DCGM_FI_DEV_MEM_CLOCK": float(g.clocks_mhz[pynvml.NVML_CLOCK_MEM]),
        "DCGM_FI_DEV_FB_RESERVED": float(memory.reserved // MIB),
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": float(rows[0]),
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": float(rows[1]),
        "DCGM_FI_DEV_ROW_REMAP_PENDING": float(rows[2]),
        "DCGM_FI_DEV_ROW_REMAP_FAILURE": float(rows[3]),
        "DCGM_FI_DEV_RETIRED_SBE": float(len(g.retired_pages[_SBE_PAGES])),
        "DCGM_FI_DEV_RETIRED_DBE": float(len(g.retired_pages[_DBE_PAGES])),
        "DCGM_FI_DEV_RETIRED_PENDING": float(g.retired_pending or 0),
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": float(g.pcie_replays or 0),
    }
    if utilization is not None:
        values["DCGM_FI_DEV_GPU_UTIL"] = float(utilization.gpu)  # percent
        values["DCGM_FI_DEV_MEM_COPY_UTIL"] = float(utilization.memory)
    for (bits, span), key in _ECC.items():
        values[f"DCGM_FI_DEV_ECC_{bits}_{span}_TOTAL"] = float(g.ecc[key])
    for name, counter in _NVLINK.items():
        total = sum(v for (_, c), v in g.nvlink_errors.items() if c == counter)
        values[f"DCGM_FI_DEV_NVLINK_{name}_ERROR_COUNT_TOTAL"] = float(total)
    values.update(_own_values(memory, g.gpm))
    return values


def _own_values(memory: FakeMemory, gpm: dict[int, float]) -> dict[str, float]:
    """The series a MIG GPU instance has of its own (framebuffer, profiling), or the GPU's."""
    values = {
        "DCGM_FI_DEV_FB_USED": float(memory.used // MIB),  # whole MiB
        "DCGM_FI_DEV_FB_FREE": float(memory.free // MIB),
        "DCGM_FI_DEV_FB_TOTAL": float(memory.total // MIB),
    }
    for name, metric in _RATIOS.items():
        values[f"DCGM_FI_PROF_{name}"] = gpm[metric] / 100  # ratio 0-1
    for name, metric in _THROUGHPUTS.items():
        values[f"DCGM_FI_PROF_{name}"] = gpm[metric] * MIB  # bytes per second
    return values


Entity = tuple[dict[str, str], dict[str, float]]


def dcgm_entities(gpus: list[FakeGpu]) -> list[Entity]:
    """What dcgm-exporter reports for this fleet (its default, flex, mode): a GPU without GPU
    instances as itself; a GPU in MIG mode only through each GPU instance (GPU_I_ID and
    GPU_I_PROFILE, its compute instances folded into it), the GPU-wide readings repeated
    and the framebuffer and profiling series the instance's own (dcgm-exporter issues #50,
    #272, #544). Each entity: its DCGM labels, and its series' values."""
    entities: list[Entity] = []
    for index, g in enumerate(gpus):
        labels, values = dcgm_labels_of(g, index), dcgm_values(g)
        devices = [d for d in g.mig_devices if d is not None]
        if not (g.mig_mode and g.mig_mode[0] and devices):
            entities.append((labels, values))
            continue
        assert g.memory is not None and g.gpm is not None
        own_names = {*_own_values(g.memory, g.gpm), "DCGM_FI_DEV_FB_RESERVED"}
        # (NVML has no reserved figure for a GPU instance.)
        wide = {k: v for k, v in values.items() if k not in own_names}
        for gi in sorted({d.gpu_instance for d in devices}):
            device = next(d for d in devices if d.gpu_instance == gi)
            assert device.memory is not None and device.gpm is not None
            profile = re.sub(r"^\d+c\.", "", device.profile)
            own = {"GPU_I_ID": str(gi), "GPU_I_PROFILE": profile}
            entities.append(({**labels, **own}, {**wide, **_own_values(device.memory, device.gpm)}))
    return entities


def recorded_names() -> list[str]:
    rules = yaml.safe_load(DCGM_RULES.read_text())
    return [r["record"] for group in rules["groups"] for r in group["rules"]]


def dcgm_labels_of(g: FakeGpu, index: int) -> dict[str, str]:
    """The labels dcgm-exporter gives this GPU (NVML's busId string unchanged, device
    nvidia<gpu>) on a host whose name is NODE."""
    return {
        "gpu": str(index),
        "UUID": g.uuid,
        "pci_bus_id": g.pci_bus_id,
        "device": f"nvidia{index}",
        "modelName": g.name,
        "Hostname": NODE,
        "DCGM_FI_DRIVER_VERSION": "580.159.04",
    }


# -- the info label ----------------------------------------------------------------------------


class TestNvmlPciBusIdLabel:
    """gpuwarden_gpu_info carries the PCI address as NVML (and so DCGM) writes it, which
    PromQL cannot make from the Linux form (no upper case in label_replace)."""

    @pytest.mark.parametrize(
        "nvml_form",
        ["00000000:18:00.0", "00000000:3B:00.0", "00000001:AF:1F.7", "0000ABCD:00:00.0"],
    )
    async def test_the_fakes_own_busid_string(self, nvml_form: str) -> None:
        rig = GpuRig(
            FakeNvml([FakeGpu.h200(0, pci_bus_id=nvml_form)]), GpuSettings(event_thread=False)
        )
        try:
            collection = await rig.collect()
        finally:
            await rig.close()
        (info,) = find(collection, "gpuwarden_gpu_info")
        assert info.labels["nvml_pci_bus_id"] == nvml_form
        assert info.labels["pci_bus_id"] == nvml_form[4:].lower()  # the contract's form stays

    async def test_lower_case_from_nvml_is_written_as_nvml_does(self) -> None:
        rig = GpuRig(FakeNvml([FakeGpu.h200(0, pci_bus_id="00000000:3b:00.0")]))
        try:
            collection = await rig.collect()
        finally:
            await rig.close()
        (info,) = find(collection, "gpuwarden_gpu_info")
        assert info.labels["nvml_pci_bus_id"] == "00000000:3B:00.0"


UNIT_CASES: dict[str, Callable[[int], list[FakeGpu]]] = {
    "every series": scripted_gpus,
    "a GPU in MIG mode": scripted_mig_gpus,
}
"""The promtool tests (by how their name starts) whose inputs are the agent's rendering of a
scripted fleet, and that fleet."""


def unit_case(start: str) -> dict[str, Any]:
    tests = yaml.safe_load(DCGM_RULE_TESTS.read_text())["tests"]
    found: dict[str, Any] = next(t for t in tests if t["name"].startswith(start))
    return found


async def rendered_series(
    gpus: list[FakeGpu],
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The agent's exposition of these GPUs after a GPM interval: series -> value."""
    rig = GpuRig(
        FakeNvml(gpus), GpuSettings(event_thread=False, gpm_interval=10.0, slow_interval=1.0)
    )
    try:
        await rig.collect(advance=10.0)  # GPM needs two samples
        collection = await rig.collect()
    finally:
        await rig.close()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(exposition(collection).decode())
        for s in family.samples
    }


# -- the rules file ----------------------------------------------------------------------------


@pytest.mark.skipif(not shutil.which("promtool"), reason="promtool not installed")
class TestRulesFile:
    def test_promtool_check_rules(self) -> None:
        done = promtool("check", "rules", DCGM_RULES)
        assert done.returncode == 0, done.stdout + done.stderr

    def test_promtool_unit_tests_pass(self) -> None:
        done = promtool("test", "rules", DCGM_RULE_TESTS)
        assert done.returncode == 0, done.stdout + done.stderr

    def test_a_wrong_mapping_fails_the_unit_test(self, tmp_path: Path) -> None:
        """The unit test can fail: the same test against rules with the MiB divisor wrong."""
        (tmp_path / "tests").mkdir()
        broken = DCGM_RULES.read_text().replace("/ 1048576", "/ 1000000")
        assert broken != DCGM_RULES.read_text()
        (tmp_path / DCGM_RULES.name).write_text(broken)
        (tmp_path / "tests" / DCGM_RULE_TESTS.name).write_text(DCGM_RULE_TESTS.read_text())
        done = promtool("test", "rules", tmp_path / "tests" / DCGM_RULE_TESTS.name)
        assert done.returncode != 0
        assert "DCGM_FI_DEV_FB_USED" in done.stdout + done.stderr

    def test_every_rule_has_a_unit_test_and_an_expected_value(self) -> None:
        tests = yaml.safe_load(DCGM_RULE_TESTS.read_text())["tests"]
        tested = {
            name
            for test in tests
            for case in test.get("promql_expr_test", [])
            for name in re.findall(r"\b(?:DCGM_FI_\w+|gpuwarden:\w+:\w+)", case["expr"])
        }
        names = recorded_names()
        assert len(names) == len(set(names)), "a series recorded twice"
        assert set(names) - tested == set(), "rules without a promtool unit test"
        expected = set(dcgm_values(scripted_gpus(1)[0]))
        assert set(names) - INFO_RULES == expected, "rules without an expected value"

    def test_the_docs_list_every_series(self) -> None:
        text = DOCS.read_text()
        section = text.split("\n## Series\n", 1)[1].split("\n## ", 1)[0]
        documented = set(re.findall(r"`(DCGM_FI_\w+)`", section))
        assert documented == set(recorded_names()) - INFO_RULES

    def test_only_declared_gpuwarden_series_are_used(self) -> None:
        used = set(re.findall(r"\bgpuwarden_[a-z0-9_]+\b", DCGM_RULES.read_text()))
        assert used, "the rules read no gpuwarden series?"
        assert used - declared_metric_names() == set()

    @pytest.mark.parametrize("case", list(UNIT_CASES))
    async def test_unit_test_inputs_are_what_the_agent_renders(self, case: str) -> None:
        """A promtool test's gpuwarden series (labels and first value) are the agent's
        exposition of its fleet, every series the rules read that the agent renders: the
        unit test cannot drift from the exporter."""
        rendered = await rendered_series(UNIT_CASES[case](GPUS))
        full = unit_case(case)
        inputs = {}
        for item in full["input_series"]:
            name, labels = parse_series(item["series"])
            if name == "gpuwarden_node_info":
                continue  # the runtime's, not the gpu collector's
            for scrape_label in ("instance", "job", "cluster"):
                labels.pop(scrape_label, None)
            inputs[(name, tuple(sorted(labels.items())))] = float(
                str(item["values"]).partition("x")[0]
            )
        used = set(re.findall(r"\bgpuwarden_[a-z0-9_]+\b", DCGM_RULES.read_text()))
        wanted = {key: value for key, value in rendered.items() if key[0] in used}
        assert inputs == wanted

    @pytest.mark.parametrize("case", list(UNIT_CASES))
    def test_unit_test_expectations_are_dcgm_exporters(self, case: str) -> None:
        """Each DCGM series a promtool test expects is what dcgm-exporter gives for its fleet
        (dcgm_entities, worked out from the fake's NVML answers, not from the rules): the
        same entities, labels and values."""
        scrape = {"cluster": "a", "instance": "gpu-host-17:9445", "job": "gpuwarden"}
        entities = dcgm_entities(UNIT_CASES[case](GPUS))
        node = next(
            parse_series(i["series"])[1]["node"]
            for i in unit_case(case)["input_series"]
            if i["series"].startswith("gpuwarden_node_info")
        )
        problems = []
        for test in unit_case(case)["promql_expr_test"]:
            name = test["expr"]
            if name in INFO_RULES:
                continue
            got = {
                tuple(sorted(parse_series(s["labels"])[1].items())): float(s["value"])
                for s in test["exp_samples"]
            }
            want = {
                tuple(sorted({**labels, **scrape, "Hostname": node}.items())): values[name]
                for labels, values in entities
                if name in values
            }
            if got != want:
                problems.append(f"{name}: expects {got}, dcgm-exporter gives {want}")
        tested = {test["expr"] for test in unit_case(case)["promql_expr_test"]}
        assert set(recorded_names()) - tested == set(), "series the case does not check"
        assert not problems, "\n".join(problems)


_SERIES = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)\{(?P<labels>.*)\}$")
_PAIR = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_series(text: str) -> tuple[str, dict[str, str]]:
    match = _SERIES.match(text.strip())
    assert match is not None, text
    return match["name"], dict(_PAIR.findall(match["labels"]))


# -- end to end: the agent on a fake NVML, a real Prometheus, NVIDIA's dashboard --------------


@dataclass
class Stack:
    agent: AgentProcess
    prom: PrometheusServer
    gpus: list[FakeGpu]


AGENT_CONFIG = """
[collectors.gpu]
interval = 0.5
slow_interval = 1.0
energy_interval = 1.0
gpm_interval = 1.0
event_thread = false
sysfs_root = "/nonexistent-sysfs"
[collectors.kernel_log]
enabled = false
[collectors.disk]
enabled = false
[collectors.processes]
enabled = false
[collectors.benchmark]
enabled = false
"""


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.25)


@contextlib.contextmanager
def scraped(
    agent: AgentProcess, workdir: Path, ready: Callable[[PrometheusServer], bool]
) -> Iterator[PrometheusServer]:
    """`agent` started and scraped each second by a real Prometheus loading the rules, until
    `ready` says the series a test needs are recorded."""
    if not (shutil.which("prometheus") or Path("/usr/bin/prometheus").exists()):
        pytest.skip("prometheus not installed")
    workdir.mkdir(parents=True)
    shutil.copy(DCGM_RULES, workdir / DCGM_RULES.name)
    prom = PrometheusServer(
        workdir,
        "global: {scrape_interval: 1s, evaluation_interval: 1s, scrape_timeout: 1s}\n"
        f"rule_files: [{DCGM_RULES.name}]\nscrape_configs:\n"
        f"  - job_name: gpuwarden\n    static_configs: [{{targets: ['127.0.0.1:{agent.port}']}}]\n",
    )
    try:
        agent.start()
        prom.start()
        wait_for(lambda: ready(prom), 60, "the rules to record every series the test needs")
        yield prom
    finally:
        prom.stop()
        agent.stop()


def fake_stack(factory: pytest.TempPathFactory, mig: bool) -> Iterator[Stack]:
    """The agent on scripted_gpus (mig: scripted_mig_gpus) scraped by a real Prometheus,
    once every DCGM series is recorded for each entity."""
    workdir = factory.mktemp("dcgm-mig" if mig else "dcgm")
    flags = ["--gpus", str(GPUS), *(["--mig"] if mig else [])]
    agent = AgentProcess(
        workdir / "agent",
        AGENT_CONFIG,
        node_id=NODE,
        prefix=[sys.executable, "-m", "tests.support.fake_gpu_agent", *flags, "--"],
    )
    gpus = scripted_mig_gpus(GPUS) if mig else scripted_gpus(GPUS)
    with scraped(agent, workdir / "prometheus", recorded_entities(gpus)) as prom:
        yield Stack(agent, prom, gpus)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from fake_stack(tmp_path_factory, mig=False)


@pytest.fixture(scope="module")
def mig_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """GPU 1 in MIG mode with two GPU instances."""
    yield from fake_stack(tmp_path_factory, mig=True)


def entity_problems(stack: Stack) -> list[str]:
    """Where Prometheus's DCGM series differ from dcgm_entities of the stack's fleet: a
    series missing or extra, a label set, a value."""
    problems = []
    entities = dcgm_entities(stack.gpus)
    for name in sorted({n for _, values in entities for n in values}):
        want = {}
        for labels, values in entities:
            if name in values:
                key = tuple(sorted({**labels, "Hostname": NODE}.items()))
                want[key] = values[name]
        got = {}
        for series in stack.prom.query(name):
            labels = dict(series["metric"])
            del labels["__name__"]
            assert labels.pop("job") == "gpuwarden"
            assert labels.pop("instance") == f"127.0.0.1:{stack.agent.port}"
            got[tuple(sorted(labels.items()))] = float(series["value"][1])
        if set(got) != set(want):
            problems.append(f"{name}: series {sorted(got)}, expected {sorted(want)}")
            continue
        for key, value in want.items():
            if got[key] != pytest.approx(value, rel=1e-9):
                problems.append(f"{name} {dict(key)}: {got[key]}, expected {value}")
    return problems


def recorded_entities(gpus: list[FakeGpu]) -> Callable[[PrometheusServer], bool]:
    """Ready once every DCGM series has a series for each entity that has it."""
    wanted: dict[str, int] = {}
    for _, values in dcgm_entities(gpus):
        for name in values:
            wanted[name] = wanted.get(name, 0) + 1

    def ready(prom: PrometheusServer) -> bool:
        counts = prom.query('count by (__name__) ({__name__=~"DCGM_.+"})')
        got = {c["metric"]["__name__"]: int(c["value"][1]) for c in counts}
        return all(got.get(name) == count for name, count in wanted.items())

    return ready


def recorded_for(names: set[str], gpus: int) -> Callable[[PrometheusServer], bool]:
    """Ready once each of these DCGM series has a series per GPU (GPUs without MIG)."""

    def ready(prom: PrometheusServer) -> bool:
        counts = prom.query('count by (__name__) ({__name__=~"DCGM_.+"})')
        got = {c["metric"]["__name__"]: int(c["value"][1]) for c in counts}
        return all(got.get(name) == gpus for name in names)

    return ready


def dashboard_check(panel: Panel, query: str, result: list[dict[str, Any]]) -> str | None:
    """A panel's answer is good when it has series and each carries its legend's labels."""
    if not result:
        return "no series"
    legend = set(LEGEND_LABEL.findall(panel.legend)) - MIG_ONLY_LABELS
    for series in result:
        if missing := legend - set(series["metric"]):
            return f"legend labels {sorted(missing)} missing on {series['metric']}"
    return None


@pytest.mark.slow
class TestAgainstPrometheus:
    def test_dcgm_label_set_and_values(self, stack: Stack) -> None:
        """Every DCGM series: exactly DCGM's labels with dcgm-exporter's values, and the
        fake's reading in DCGM's unit."""
        assert entity_problems(stack) == []

    @pytest.mark.parametrize("dashboard", DASHBOARDS, ids=lambda d: d.commit[:7])
    def test_every_dashboard_query_returns_series(self, stack: Stack, dashboard: Dashboard) -> None:
        problems = query_all_panels(stack.prom, dashboard, dashboard_check)
        assert not problems, f"{dashboard.source}:\n" + "\n".join(problems)

    def test_the_real_gpu_checks_pass_on_the_fake(self, stack: Stack) -> None:
        """The checks the `gpu` test makes against nvidia-smi, here against the rows
        nvidia-smi would print for the fake GPUs: they pass, and fail for a wrong row."""
        rows = [
            {
                "index": str(i),
                "uuid": g.uuid,
                "name": g.name,
                "pci.bus_id": g.pci_bus_id,
                "driver_version": "580.159.04",
                "temperature.gpu": str(g.temperature),
                "memory.total": str((g.memory.total if g.memory else 0) // MIB),
            }
            for i, g in enumerate(stack.gpus)
        ]
        assert agrees_with_nvidia_smi(stack.prom, rows) == []
        rows[1]["pci.bus_id"] = "0000:28:00.0"  # the Linux form is not DCGM's
        assert len(agrees_with_nvidia_smi(stack.prom, rows)) == 1

    @pytest.mark.parametrize("dashboard", DASHBOARDS, ids=lambda d: d.commit[:7])
    def test_variables_offer_every_gpu_and_host(self, stack: Stack, dashboard: Dashboard) -> None:
        found, _ = resolve(stack.prom, dashboard)
        assert found["gpu"] == [str(i) for i in range(GPUS)]
        for name, values in found.items():
            if name == "instance":
                assert values == [f"127.0.0.1:{stack.agent.port}"]
            if name == "Hostname":
                assert values == [NODE]


_NOT_ON_MIG = re.compile(r"\bDCGM_FI_DEV_(GPU|MEM_COPY)_UTIL\b")
"""NVML's utilization, which a GPU in MIG mode does not give: no series there from
dcgm-exporter either (its issues #50, #105)."""


def mig_dashboard_check(panel: Panel, query: str, result: list[dict[str, Any]]) -> str | None:
    """dashboard_check, but a panel of NVML utilization for the MIG GPU alone is empty."""
    mig_gpu_alone = f'gpu=~"{GPUS - 1}"' in query
    if not result and mig_gpu_alone and _NOT_ON_MIG.search(query):
        return None
    return dashboard_check(panel, query, result)


@pytest.mark.slow
class TestMigAgainstPrometheus:
    """A GPU in MIG mode beside one without: DCGM's series per GPU instance, as
    dcgm-exporter's default mode gives them, and NVIDIA's dashboards on them."""

    def test_dcgm_series_per_gpu_instance(self, mig_stack: Stack) -> None:
        assert entity_problems(mig_stack) == []

    @pytest.mark.parametrize("dashboard", DASHBOARDS, ids=lambda d: d.commit[:7])
    def test_every_dashboard_query_returns_series(
        self, mig_stack: Stack, dashboard: Dashboard
    ) -> None:
        problems = query_all_panels(mig_stack.prom, dashboard, mig_dashboard_check)
        assert not problems, f"{dashboard.source}:\n" + "\n".join(problems)

    def test_the_reworked_dashboard_shows_each_gpu_instance(self, mig_stack: Stack) -> None:
        """Its panels that group by GPU_I_ID and GPU_I_PROFILE get one line per GPU
        instance of the MIG GPU and one for the other GPU, as from dcgm-exporter."""
        found, _ = resolve(mig_stack.prom, REWORK)
        grouped = [p for p in REWORK.panels if "GPU_I_ID" in p.expr]
        assert grouped
        for panel in grouped:
            query = panel.expr.replace('"$Hostname"', f'"{NODE}"').replace('"$gpu"', '".*"')
            lines = {
                (
                    s["metric"]["gpu"],
                    s["metric"].get("GPU_I_ID", ""),
                    s["metric"].get("GPU_I_PROFILE", ""),
                )
                for s in mig_stack.prom.query(query)
            }
            assert lines == {("0", "", ""), ("1", "1", "3g.71gb"), ("1", "2", "2g.35gb")}, (
                panel.title
            )
        assert found["gpu"] == ["0", "1"]


# -- on a real GPU -----------------------------------------------------------------------------


@pytest.mark.gpu
class TestRealGpu:
    """NVML's busId as nvidia-smi prints it is what the info series carries (DCGM's form)."""

    def test_nvml_pci_bus_id_is_nvidia_smis(self) -> None:
        smi = shutil.which("nvidia-smi")
        if smi is None:
            pytest.skip("no nvidia-smi")
        backend = NvmlBackend()
        try:
            backend.start()
        except NvmlUnavailable as exc:
            pytest.skip(f"no NVML here: {exc}")
        try:
            # Synchronous on purpose: the GPU machine may lack pytest-asyncio.
            collection = asyncio.run(one_round(backend))
        finally:
            backend.stop()
        rows = nvidia_smi(smi, "index,pci.bus_id")
        for row in rows:
            index, bus_id = row["index"], row["pci.bus_id"]
            (info,) = find(collection, "gpuwarden_gpu_info", gpu=index)
            assert info.labels["nvml_pci_bus_id"] == bus_id


def nvidia_smi(smi: str, fields: str) -> list[dict[str, str]]:
    """One dict per GPU; skips the test where nvidia-smi finds no driver."""
    done = subprocess.run(
        [smi, f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    if done.returncode != 0 or not done.stdout.strip():
        pytest.skip(f"nvidia-smi: {done.stdout or done.stderr}")
    names = fields.split(",")
    return [
        dict(zip(names, (v.strip() for v in line.split(",")), strict=True))
        for line in done.stdout.splitlines()
    ]


# What NVIDIA's dashboards read; GPM (the PROF series) is there on Hopper and later.
DASHBOARD_SERIES = {
    name
    for dashboard in DASHBOARDS
    for panel in dashboard.panels
    for name in re.findall(r"\bDCGM_FI_\w+", panel.expr)
}


@pytest.mark.gpu
@pytest.mark.slow
def test_nvidias_dashboard_on_the_real_gpus(tmp_path: Path) -> None:
    """The real agent on the real GPUs: every query of both dashboards answers, the DCGM
    labels are nvidia-smi's values, and a few readings agree with nvidia-smi's."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        pytest.skip("no nvidia-smi")
    fields = "index,uuid,name,pci.bus_id,driver_version,temperature.gpu,memory.total,compute_cap"
    rows = nvidia_smi(smi, fields)
    if any(float(row["compute_cap"]) < 9.0 for row in rows):
        pytest.skip("NVIDIA's dashboard reads a GPM series: Hopper or later needed")
    agent = AgentProcess(
        tmp_path / "agent",
        AGENT_CONFIG.replace('sysfs_root = "/nonexistent-sysfs"\n', ""),
        node_id=NODE,
    )
    with scraped(agent, tmp_path / "prometheus", recorded_for(DASHBOARD_SERIES, len(rows))) as prom:
        for name in sorted(DASHBOARD_SERIES):  # what the H200 showed, for the closing note
            for series in prom.query(name):
                print(f"{name}{{gpu={series['metric']['gpu']}}} {series['value'][1]}")
        problems = agrees_with_nvidia_smi(prom, rows)
    assert not problems, "\n".join(problems)


def agrees_with_nvidia_smi(prom: PrometheusServer, rows: list[dict[str, str]]) -> list[str]:
    """Every query of both dashboards answers; the DCGM labels of each GPU are nvidia-smi's
    values; temperature and memory size agree with it."""
    problems = [p for d in DASHBOARDS for p in query_all_panels(prom, d, dashboard_check)]
    temperatures = {s["metric"]["gpu"]: s for s in prom.query("DCGM_FI_DEV_GPU_TEMP")}
    totals = {s["metric"]["gpu"]: s for s in prom.query("DCGM_FI_DEV_FB_TOTAL")}
    for row in rows:
        if row["index"] not in temperatures or row["index"] not in totals:
            problems.append(f"GPU {row['index']}: no DCGM series")
            continue
        labels = temperatures[row["index"]]["metric"]
        want = {
            "UUID": row["uuid"],
            "pci_bus_id": row["pci.bus_id"],
            "modelName": row["name"],
            "DCGM_FI_DRIVER_VERSION": row["driver_version"],
            "device": f"nvidia{row['index']}",
            "Hostname": NODE,
        }
        if got := {k: labels.get(k) for k in want if labels.get(k) != want[k]}:
            problems.append(f"GPU {row['index']}: labels {got}, nvidia-smi says {want}")
        temperature = float(temperatures[row["index"]]["value"][1])
        if abs(temperature - float(row["temperature.gpu"])) > 3:
            problems.append(f"GPU {row['index']}: {temperature} C, nvidia-smi {row}")
        total = float(totals[row["index"]]["value"][1])
        if abs(total - float(row["memory.total"])) > 1:
            problems.append(f"GPU {row['index']}: {total} MiB, nvidia-smi {row}")
    return problems
