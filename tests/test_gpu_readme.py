"""docs/configuration.md's [collectors.gpu] table documents every setting of the gpu collector."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from agent.contracts.collector import CollectorSettings
from collectors.gpu.collector import GpuSettings

CONFIG_DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_every_gpu_setting_has_a_row() -> None:
    text = CONFIG_DOC.read_text()
    section = text.split("\n## `[collectors.gpu]`", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `\[collectors\.gpu\] (\w+)`", section, re.MULTILINE))
    common = {f.name for f in dataclasses.fields(CollectorSettings)}  # documented once for all
    keys = {f.name for f in dataclasses.fields(GpuSettings)} - common
    assert keys - documented == set(), (
        f"docs/configuration.md [collectors.gpu] lacks {sorted(keys - documented)}"
    )
    assert documented - keys - common == set(), (
        f"docs/configuration.md documents unknown keys {sorted(documented - keys)}"
    )
