"""The command line imports only the command it runs (issue 14: every module a process imports
stays resident, and `gpuwarden run` is the daemon), and reads the same as when it imported all."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys

import pytest

from agent.program import cli


def help_text(parser_argv: list[str], only: str | None) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.build_parser(only).parse_args(parser_argv)
    return out.getvalue()


def commands_loaded(code: str) -> set[str]:
    """The command modules a fresh interpreter holds after running `code`."""
    probe = (
        f"{code}\nimport json, sys\n"
        "prefix = 'agent.program.commands.'\n"
        "print(json.dumps(sorted(m[len(prefix):] for m in sys.modules if m.startswith(prefix))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    names: list[str] = json.loads(out.stdout.splitlines()[-1])
    return set(names)


def after_main(argv: list[str]) -> set[str]:
    """After `gpuwarden ARGV` (ARGV asks for help, so nothing runs)."""
    return commands_loaded(
        "import contextlib, io\n"
        "from agent.program import cli\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n"
        f"        cli.main({argv!r})\n"
        "    except SystemExit:\n"
        "        pass\n"
    )


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_a_command_loads_what_its_own_module_imports_only(name: str) -> None:
    module = cli.COMMANDS[name][0]
    own = commands_loaded(f"import agent.program.commands.{module}")
    assert module in own
    assert after_main([name, "--help"]) == own


def test_the_top_level_help_loads_every_command_it_describes() -> None:
    assert after_main(["--help"]) >= {m for m, _ in cli.COMMANDS.values()}


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_help_reads_the_same_with_one_command_loaded(name: str) -> None:
    assert help_text(["--help"], name) == help_text(["--help"], None)
    assert help_text([name, "--help"], name) == help_text([name, "--help"], None)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["run", "--config", "x.toml"], "run"),
        (["--version"], None),
        (["-h", "scan", "f.log"], "scan"),
        (["nonsense", "run"], None),
        ([], None),
    ],
)
def test_named_command(argv: list[str], named: str | None) -> None:
    assert cli.named_command(argv) == named


def test_an_unknown_command_is_refused_as_before(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        cli.main(["nonsense"])
    assert stop.value.code == 2
    assert "invalid choice: 'nonsense'" in capsys.readouterr().err
