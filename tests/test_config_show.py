"""`config show` prints TOML that `config check` accepts and that loads to the same settings:
for the embedded defaults and for a configuration with every table set (lists, nested tables,
arrays of tables, paths, secrets in files); `--json` stays JSON."""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.program import toml_text
from agent.program.cli import main as cli_main
from tests.test_config_files import SECRET, config_text, good_values, tls

__all__ = ["tls"]  # the fixture, from the module that builds the certificates

KEYS = st.text(min_size=1, max_size=12)
SCALARS = (
    st.text(max_size=20)
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False)
)
VALUES = st.recursive(
    SCALARS | st.lists(SCALARS, max_size=4),
    lambda inner: (
        st.dictionaries(KEYS, inner, max_size=4)
        | st.lists(st.dictionaries(KEYS, inner, min_size=1, max_size=3), min_size=1, max_size=3)
    ),
    max_leaves=20,
)


@given(st.dictionaries(KEYS, VALUES, max_size=6))
def test_any_table_reads_back_the_same(table: dict[str, Any]) -> None:
    """The writer's class: every key (quoted where it must be), string (control characters
    escaped), number, array, table and array of tables reads back as it was."""
    text = toml_text.dumps(table)
    assert tomllib.loads(text) == table, text


def test_floats_stay_floats() -> None:
    text = toml_text.dumps({"a": 10.0, "b": math.inf, "c": -0.5, "d": 1e300})
    assert tomllib.loads(text) == {"a": 10.0, "b": math.inf, "c": -0.5, "d": 1e300}
    assert isinstance(tomllib.loads(text)["a"], float)


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli_main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _round_trip(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: Path | None
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    given_args = ["--config", str(config)] if config is not None else []
    code, shown, err = _run(capsys, "config", "show", *given_args)
    assert code == 0, err
    tomllib.loads(shown)  # TOML, not JSON
    pasted = tmp_path / "pasted.toml"
    pasted.write_text(shown)
    code, _, err = _run(capsys, "config", "check", "--config", str(pasted))
    assert code == 0, err + shown
    _, before, _ = _run(capsys, "config", "show", "--json", *given_args)
    _, after, _ = _run(capsys, "config", "show", "--json", "--config", str(pasted))
    return shown, json.loads(before)["config"], json.loads(after)["config"]


def test_embedded_defaults_round_trip(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("agent.program.config_loader.DEFAULT_CONFIG_PATH", tmp_path / "absent.toml")
    shown, before, after = _round_trip(tmp_path, capsys, None)
    assert after == before
    assert "[collectors.gpu]" in shown


def test_every_table_set_round_trips(
    tmp_path: Path, tls: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoints = tmp_path / "ckpt"
    checkpoints.mkdir()
    probe = tmp_path / "probe"
    probe.mkdir()
    extra: dict[str, dict[str, Any]] = {
        "heartbeat": {"interval": 20.0, "stale_after_intervals": 4},
        "actions__slurm": {"enabled": True, "resume": "when_cleared", "drain_on": ["reboot_node"]},
        "actions__exec": {"command": ["/bin/echo", "a b", 'quote"d'], "timeout": 5.0},
        "collectors__io_probe": {"enabled": True, "directories": [str(probe)]},
        "collectors__disk": {"mountpoints_include": ["/", "/data*"]},
        "collectors__gpu": {"expected_gpus": 8},
    }
    text = config_text(good_values(tmp_path / "files", tls), tmp_path / "state", **extra)
    text += (
        "[collectors.checkpoints]\nenabled = true\n"
        f'[[collectors.checkpoints.locations]]\nname = "job-a"\npath = "{checkpoints}"\n'
        f'[[collectors.checkpoints.locations]]\nname = "job-b"\npath = "{checkpoints}"\n'
        "max_age = 7200.0\n"
    )
    config = tmp_path / "gpuwarden.toml"
    config.write_text(text)
    shown, before, after = _round_trip(tmp_path, capsys, config)
    assert after == before
    assert "[[collectors.checkpoints.locations]]" in shown
    assert 'command = ["/bin/echo", "a b", "quote\\"d"]' in shown
    assert SECRET not in shown  # the secret stays in its file; the file is named
    assert str(tmp_path / "files" / "mqtt-password") in shown
    assert before["collectors"]["checkpoints"]["locations"][1]["max_age"] == 7200.0


def test_json_stays_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "config", "show", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["ok"] is True and "collectors" in data["config"]
