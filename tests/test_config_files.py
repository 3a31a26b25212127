"""Every file a configuration key names is judged once, at load, the same by every command.

`gpuwarden config check` must refuse exactly what `gpuwarden run` (or `gpuwarden watch`, for
the [watch] table) refuses. Each case below breaks one key of an otherwise valid
configuration and runs the CLI's `config check` and the command that reads the key, in
process (their `serve` replaced by a trap that fails the test if they get that far), and
asserts both exit 2 with the same message naming the file, the key and what was expected. A
few cases run the real commands as subprocesses as well.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bcrypt
import pytest

from agent.contracts.config import CoreSettings
from agent.contracts.errors import ConfigError
from agent.program import cli, registry
from agent.program import config_file as config_module
from agent.program.commands import run as run_command
from agent.program.commands import watch as watch_command
from agent.runtime import logs
from tests.support.agent_proc import REPO
from tests.support.ports import free_port
from tests.support.tls import Authority

HASH = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(4)).decode()  # cost 4: fast, same check
SECRET = "Secret-Broker-Password"
PRIVATE = ("secret", "private_key")


@dataclass(frozen=True)
class FileKey:
    key: str
    """section.key as in the message"""
    kind: str
    """secret | private_key | certificate | readable: what the key must name"""
    command: str
    """the command that reads the file: run or watch"""


FILE_KEYS = (
    FileKey("mqtt.password_file", "secret", "run"),
    FileKey("mqtt.ca_file", "certificate", "run"),
    FileKey("mqtt.cert_file", "certificate", "run"),
    FileKey("mqtt.key_file", "private_key", "run"),
    FileKey("prometheus.tls_cert_file", "certificate", "run"),
    FileKey("prometheus.tls_key_file", "private_key", "run"),
    FileKey("prometheus.basic_auth_users_file", "secret", "run"),
    FileKey("prometheus.web_config_file", "secret", "run"),
    FileKey("watch.password_file", "secret", "watch"),
    FileKey("watch.ca_file", "certificate", "watch"),
    FileKey("watch.cert_file", "certificate", "watch"),
    FileKey("watch.key_file", "private_key", "watch"),
    FileKey("watch.inventory_file", "readable", "watch"),
    FileKey("watch.alertmanager_password_file", "secret", "watch"),
    FileKey("watch.alertmanager_bearer_token_file", "secret", "watch"),
    FileKey("watch.alertmanager_ca_file", "certificate", "watch"),
)
BY_KEY = {f.key: f for f in FILE_KEYS}

PATH_KEYS = (
    # path keys that name no file to check at load (created on demand, or observed at run
    # time by a collector that reports a missing one as its own error): only the characters
    # of the path are judged at load.
    "state_dir",
    "runtime_dir",
    "collectors.system.proc_root",
    "collectors.disk.proc_root",
    "collectors.disk.rootfs",
    "collectors.processes.proc_root",
    "collectors.kernel_log.path",
    "collectors.kernel_log.boot_id_path",
    "collectors.io_probe.directories",
    "collectors.benchmark.python",
)


# -- a valid configuration with every file key set ---------------------------------------------


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """CA, server and client certificates, and a second key that matches neither."""
    workdir = tmp_path_factory.mktemp("tls")
    authority = Authority(workdir).create()
    server = authority.issue("server", ip_addresses=("127.0.0.1",))
    client = authority.issue("node", client=True)
    other = Authority(workdir, "other").create()
    other.key.chmod(0o600)
    encrypted = workdir / "encrypted.key"
    subprocess.run(
        [
            *("openssl", "pkey", "-aes256", "-passout", "pass:x"),
            *("-in", str(client.key), "-out", str(encrypted)),
        ],
        check=True,
        capture_output=True,
    )
    encrypted.chmod(0o600)
    return {
        "ca": authority.cert,
        "server_cert": server.cert,
        "server_key": server.key,
        "client_cert": client.cert,
        "client_key": client.key,
        "other_key": other.key,
        "encrypted_key": encrypted,
    }


def private(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


WEB_CONFIG_REPLACES = (
    "prometheus.tls_cert_file",
    "prometheus.tls_key_file",
    "prometheus.basic_auth_users_file",
)
"""The keys web_config_file stands for: a configuration sets one or the other."""
BEARER_REPLACES = ("watch.alertmanager_username", "watch.alertmanager_password_file")
"""Alertmanager's basic auth, which a bearer token replaces."""


def good_values(directory: Path, tls: dict[str, Path], testing: str = "") -> dict[str, str]:
    """Every file key set to a good file; with the web config in place of the three keys it
    replaces when that is the key under test."""
    values = _good_values(directory, tls)
    dropped: tuple[str, ...] = (
        "prometheus.web_config_file",
        "watch.alertmanager_bearer_token_file",
    )
    if testing == "prometheus.web_config_file":
        dropped = (*WEB_CONFIG_REPLACES, "watch.alertmanager_bearer_token_file")
    if testing == "watch.alertmanager_bearer_token_file":
        dropped = ("prometheus.web_config_file", *BEARER_REPLACES)
    return {key: value for key, value in values.items() if key not in dropped}


def _good_values(directory: Path, tls: dict[str, Path]) -> dict[str, str]:
    directory.mkdir(parents=True, exist_ok=True)
    web_config = (
        f"tls_server_config:\n  cert_file: {tls['server_cert']}\n  key_file: {tls['server_key']}\n"
        f"basic_auth_users:\n  prom: {HASH}\n"
    )
    values = {
        "mqtt.password_file": private(directory / "mqtt-password", SECRET + "\n"),
        "mqtt.ca_file": tls["ca"],
        "mqtt.cert_file": tls["client_cert"],
        "mqtt.key_file": tls["client_key"],
        "prometheus.tls_cert_file": tls["server_cert"],
        "prometheus.tls_key_file": tls["server_key"],
        "prometheus.basic_auth_users_file": private(directory / "users", f"prom:{HASH}\n"),
        "prometheus.web_config_file": private(directory / "web-config.yml", web_config),
        "watch.password_file": private(directory / "watch-password", SECRET + "\n"),
        "watch.ca_file": tls["ca"],
        "watch.cert_file": tls["client_cert"],
        "watch.key_file": tls["client_key"],
        "watch.inventory_file": private(directory / "inventory", "gpu-1\ngpu-2\n"),
        "watch.alertmanager_username": "watcher",  # not a file: what the password goes with
        "watch.alertmanager_password_file": private(directory / "am-password", SECRET + "\n"),
        "watch.alertmanager_bearer_token_file": private(directory / "am-token", SECRET + "\n"),
        "watch.alertmanager_ca_file": tls["ca"],
    }
    return {key: str(value) for key, value in values.items()}


def config_text(values: dict[str, str], state_dir: Path, **extra: dict[str, Any]) -> str:
    """TOML (json.dumps writes strings TOML reads, \\u0000 escapes included)."""
    tables: dict[str, dict[str, Any]] = {
        "prometheus": {"listen": f"127.0.0.1:{free_port()}"},
        "mqtt": {"enabled": True, "url": "mqtts://127.0.0.1:1", "username": "node"},
        "watch": {
            "url": "mqtts://127.0.0.1:1",
            "username": "watcher",
            "listen": "",
            "alertmanager_urls": ["https://127.0.0.1:1"],
        },
    }
    for dotted, value in values.items():
        section, _, key = dotted.partition(".")
        tables[section][key] = value
    for section, table in extra.items():
        tables.setdefault(section, {}).update(table)
    lines = [f"state_dir = {json.dumps(str(state_dir))}"]
    for section, table in tables.items():
        lines.append(f"[{section.replace('__', '.')}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in table.items()]
    return "\n".join(lines) + "\n"


# -- running the commands -------------------------------------------------------------------------


@dataclass
class Outcome:
    code: int
    stderr: str


@pytest.fixture
def commands(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Commands:
    return Commands(monkeypatch, capsys)


class Commands:
    """`gpuwarden config check | run | watch` through cli.main, in this process."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
        self.capsys = capsys
        self.started: list[str] = []
        monkeypatch.setattr(run_command, "serve", self._serve_run)
        monkeypatch.setattr(watch_command, "_serve", self._serve_watch)
        monkeypatch.setattr(logs, "configure", lambda *a, **k: None)  # global logging: keep

    async def _serve_run(self, cfg: config_module.Config, path: Path | None) -> tuple[int, int]:
        self.started.append("run")
        return 0, 0

    async def _serve_watch(self, watcher: object) -> None:
        self.started.append("watch")

    def __call__(self, *argv: str) -> Outcome:
        self.capsys.readouterr()
        code = cli.main(list(argv))
        return Outcome(code, self.capsys.readouterr().err)


# -- the cases ------------------------------------------------------------------------------------

Breaker = Callable[[Path, str], tuple[str, tuple[str, ...]]]
"""(scratch dir, the valid value) -> (the bad value, fragments the message must hold)"""


def missing(scratch: Path, good: str) -> tuple[str, tuple[str, ...]]:
    bad = scratch / "not-there"
    return str(bad), (str(bad), "No such file or directory", "expected")


def directory(scratch: Path, good: str) -> tuple[str, tuple[str, ...]]:
    bad = scratch / "a-directory"
    bad.mkdir()
    return str(bad), (str(bad), "is a directory", "expected")


def fifo(scratch: Path, good: str) -> tuple[str, tuple[str, ...]]:
    bad = scratch / "a-fifo"
    os.mkfifo(bad)
    return str(bad), (str(bad), "FIFO", "expected")


def nul_byte(scratch: Path, good: str) -> tuple[str, tuple[str, ...]]:
    return good + "\x00.bak", ("NUL",)


def readable_by(mode: int) -> Breaker:
    def breaker(scratch: Path, good: str) -> tuple[str, tuple[str, ...]]:
        bad = scratch / f"copy-{mode:o}"
        shutil.copyfile(good, bad)
        bad.chmod(mode)
        return str(bad), (str(bad), f"chmod 600 {bad}", "other users")

    breaker.__name__ = f"mode_{mode:o}"
    return breaker


def content(text: str, *fragments: str) -> Breaker:
    def breaker(scratch: Path, good: str) -> tuple[str, tuple[str, ...]]:
        bad = private(scratch / "bad-content", text)
        return str(bad), (str(bad), *fragments)

    breaker.__name__ = "bad_content"
    return breaker


def file_cases() -> Iterator[Any]:
    for fk in FILE_KEYS:
        breakers: list[Breaker] = [missing, directory, fifo, nul_byte]
        if fk.kind in PRIVATE:
            breakers += [readable_by(0o644), readable_by(0o640), readable_by(0o604)]
        for breaker in breakers:
            yield pytest.param(fk, breaker, id=f"{fk.key}-{breaker.__name__}")
    not_pem = "this is not a PEM file\n"
    content_cases: list[tuple[str, str, Breaker]] = [
        ("mqtt.ca_file", "garbage", content(not_pem, "no PEM certificate")),
        ("mqtt.cert_file", "garbage", content(not_pem, "no PEM certificate")),
        ("watch.ca_file", "garbage", content(not_pem, "no PEM certificate")),
        ("watch.alertmanager_ca_file", "garbage", content(not_pem, "no PEM certificate")),
        ("prometheus.tls_cert_file", "garbage", content(not_pem, "no PEM certificate")),
        ("mqtt.key_file", "garbage", content(not_pem, "private key of", "mqtt.cert_file")),
        ("watch.cert_file", "garbage", content(not_pem, "no PEM certificate")),
        ("watch.key_file", "garbage", content(not_pem, "private key of", "watch.cert_file")),
        ("prometheus.tls_key_file", "garbage", content(not_pem, "private key of", "tls_cert_file")),
        (
            "prometheus.basic_auth_users_file",
            "not-bcrypt",
            content("prom:plaintext\n", ":1:", "not a bcrypt hash"),
        ),
        (
            "prometheus.basic_auth_users_file",
            "line-3",
            content(f"# scrapers\nprom:{HASH}\neve:{HASH[:-1]}\n", ":3:", "'eve'"),
        ),
        (
            "prometheus.basic_auth_users_file",
            "bad-cost",
            content(f"prom:{HASH[:4]}99{HASH[6:]}\n", ":1:", "not a bcrypt hash"),
        ),
        (
            "prometheus.basic_auth_users_file",
            "bad-alphabet",
            content(f"prom:{HASH[:-3]}!!!\n", ":1:", "not a bcrypt hash"),
        ),
        (
            "prometheus.basic_auth_users_file",
            "no-users",
            content("# nobody yet\n", "no users"),
        ),
        (
            "prometheus.web_config_file",
            "not-bcrypt",
            content("basic_auth_users:\n  prom: plain\n", "basic_auth_users.prom", "not a bcrypt"),
        ),
        (
            "prometheus.web_config_file",
            "client-certificates",
            content(
                "tls_server_config:\n  cert_file: c\n  key_file: k\n  client_ca_file: ca\n",
                "tls_server_config.client_ca_file",
                "not supported",
            ),
        ),
        (
            "prometheus.web_config_file",
            "cert-not-pem",
            content(
                "tls_server_config:\n  cert_file: /etc/hostname\n  key_file: /etc/hostname\n",
                "tls_server_config.cert_file",
                "no PEM certificate",
            ),
        ),
        ("watch.inventory_file", "bad-node", content("gpu-1\nbad node\n", ":2:", "'bad node'")),
    ]
    for key, name, breaker in content_cases:
        yield pytest.param(BY_KEY[key], breaker, id=f"{key}-{name}")


def key_cases() -> Iterator[Any]:
    """Keys fine on their own that do not go with their certificate."""
    for key, cert_key in (
        ("mqtt.key_file", "mqtt.cert_file"),
        ("watch.key_file", "watch.cert_file"),
        ("prometheus.tls_key_file", "prometheus.tls_cert_file"),
    ):
        yield pytest.param(BY_KEY[key], (cert_key, "other_key", "mismatch"), id=f"{key}-other")
        # encrypted: OpenSSL would ask for the passphrase on the terminal, or fail under systemd
        yield pytest.param(
            BY_KEY[key], (cert_key, "encrypted_key", "passphrase"), id=f"{key}-encrypted"
        )


# -- the tests ------------------------------------------------------------------------------------


def expect_same_refusal(
    commands: Commands, path: Path, fk_key: str, command: str, fragments: tuple[str, ...]
) -> ConfigError:
    """config check and the reading command both exit 2 with one message: file, key, why."""
    check = commands("config", "check", "--config", str(path))
    reader = commands(command, "--config", str(path))
    assert commands.started == []
    assert (check.code, reader.code) == (2, 2), (check, reader)
    with pytest.raises(ConfigError) as info:
        config_module.load(path, with_watch_files=True)  # what config check's main calls
    error = info.value
    assert check.stderr == f"gpuwarden: configuration error: {error}\n"
    assert f"configuration error: {error}\n" in reader.stderr
    assert error.file == str(path)
    assert error.key == fk_key
    for fragment in fragments:
        assert fragment in error.message, (fragment, error.message)
    return error


class TestBaseline:
    """The valid configuration the cases break one key of: every command accepts it."""

    @pytest.mark.parametrize("variant", ["", "prometheus.web_config_file"], ids=["keys", "web"])
    def test_every_command_accepts_it(
        self, tmp_path: Path, tls: dict[str, Path], commands: Commands, variant: str
    ) -> None:
        path = tmp_path / "gpuwarden.toml"
        values = good_values(tmp_path / "files", tls, variant)
        path.write_text(config_text(values, tmp_path / "state"))
        assert commands("config", "check", "--config", str(path)).code == 0
        assert commands("run", "--config", str(path)).code == 0
        assert commands("watch", "--config", str(path)).code == 0
        assert commands.started == ["run", "watch"]

    def test_the_tables_name_every_path_key(self) -> None:
        """A new *_file or path key must join FILE_KEYS or PATH_KEYS (and so these tests)."""
        found: set[str] = set()
        for name, settings_type in registry.SCHEMA.sections.items():
            found |= path_keys(settings_type, name)
        for name, spec in registry.COLLECTORS.items():
            found |= path_keys(spec.settings_type, f"collectors.{name}")
        found |= path_keys(CoreSettings, "")
        assert found == set(BY_KEY) | set(PATH_KEYS)


def path_keys(cls: type, prefix: str) -> set[str]:
    """Fields that are paths: typed Path, named *_file, or declared as a path or file."""
    hints = typing.get_type_hints(cls)
    out: set[str] = set()
    for spec in dataclasses.fields(cls):
        key = f"{prefix}.{spec.name}" if prefix else spec.name
        is_path = "Path" in str(hints[spec.name])
        if is_path or spec.name.endswith("_file") or spec.metadata.get("path"):
            out.add(key)
    return out


class TestFileKeys:
    """Each file key, broken one way: config check and the reading command refuse alike."""

    @pytest.mark.parametrize(("fk", "breaker"), list(file_cases()))
    def test_refused_alike(
        self,
        tmp_path: Path,
        tls: dict[str, Path],
        commands: Commands,
        fk: FileKey,
        breaker: Breaker,
    ) -> None:
        values = good_values(tmp_path / "files", tls, fk.key)
        scratch = tmp_path / "scratch"
        scratch.mkdir()
        values[fk.key], fragments = breaker(scratch, values[fk.key])
        path = tmp_path / "gpuwarden.toml"
        path.write_text(config_text(values, tmp_path / "state"))
        error = expect_same_refusal(commands, path, fk.key, fk.command, fragments)
        assert SECRET not in str(error)

    @pytest.mark.parametrize(("fk", "case"), list(key_cases()))
    def test_key_that_does_not_load_with_its_certificate(
        self,
        tmp_path: Path,
        tls: dict[str, Path],
        commands: Commands,
        fk: FileKey,
        case: tuple[str, str, str],
    ) -> None:
        cert_key, key_name, why = case
        values = good_values(tmp_path / "files", tls)
        values[fk.key] = str(tls[key_name])
        path = tmp_path / "gpuwarden.toml"
        path.write_text(config_text(values, tmp_path / "state"))
        fragments = (str(tls[key_name]), "private key of", cert_key, why)
        expect_same_refusal(commands, path, fk.key, fk.command, fragments)


class TestPathCharacters:
    """A NUL byte in any path key is a configuration error at load, never a traceback."""

    @pytest.mark.parametrize("key", PATH_KEYS)
    def test_nul_byte_refused(self, tmp_path: Path, commands: Commands, key: str) -> None:
        section, _, name = key.rpartition(".")
        bad: Any = "/proc\x00/x"
        if name == "directories":
            bad = [str(tmp_path), "/tmp\x00/x"]
        table = {name: bad, "enabled": True} if section else {}
        lines = [f"state_dir = {json.dumps(str(tmp_path / 'state'))}"] if key != "state_dir" else []
        if section:
            lines += [f"[{section}]", *(f"{k} = {json.dumps(v)}" for k, v in table.items())]
        else:
            lines.append(f"{name} = {json.dumps(bad)}")
        path = tmp_path / "gpuwarden.toml"
        path.write_text("\n".join(lines) + "\n")
        expected_key = key + "[1]" if name == "directories" else key
        expect_same_refusal(commands, path, expected_key, "run", ("NUL",))


def test_missing_systemd_credential_says_why(tmp_path: Path, tls: dict[str, Path]) -> None:
    """LoadCredential= files exist only while the unit runs: config check run by hand before
    the first start finds none, and says that this is why."""
    values = good_values(tmp_path / "files", tls)
    values["mqtt.password_file"] = "/run/credentials/gpuwarden.service/mqtt-password"
    path = tmp_path / "gpuwarden.toml"
    path.write_text(config_text(values, tmp_path / "state"))
    with pytest.raises(ConfigError, match="a systemd credential exists only while its unit runs"):
        config_module.load(path)


class TestScope:
    """A file is judged only where something reads it: the agent does not read [watch]'s
    files (a shared gpuwarden.toml names the watcher's systemd credential, which the agent's
    user cannot open), the watcher not [mqtt]'s, and nothing a disabled sink's."""

    def test_watch_files_are_not_the_agents_business(
        self, tmp_path: Path, tls: dict[str, Path], commands: Commands
    ) -> None:
        values = good_values(tmp_path / "files", tls)
        values["watch.password_file"] = str(tmp_path / "elsewhere")
        path = tmp_path / "gpuwarden.toml"
        path.write_text(config_text(values, tmp_path / "state"))
        assert commands("run", "--config", str(path)).code == 0
        assert commands("watch", "--config", str(path)).code == 2
        assert commands("config", "check", "--config", str(path)).code == 2

    def test_agent_files_are_not_the_watchers_business(
        self, tmp_path: Path, tls: dict[str, Path], commands: Commands
    ) -> None:
        values = good_values(tmp_path / "files", tls)
        values["mqtt.password_file"] = str(tmp_path / "elsewhere")
        path = tmp_path / "gpuwarden.toml"
        path.write_text(config_text(values, tmp_path / "state"))
        assert commands("watch", "--config", str(path)).code == 0
        assert commands("run", "--config", str(path)).code == 2

    def test_disabled_sink_files_are_not_read(
        self, tmp_path: Path, tls: dict[str, Path], commands: Commands
    ) -> None:
        values = good_values(tmp_path / "files", tls)
        values["mqtt.password_file"] = str(tmp_path / "elsewhere")
        path = tmp_path / "gpuwarden.toml"
        path.write_text(config_text(values, tmp_path / "state", mqtt={"enabled": False}))
        assert commands("config", "check", "--config", str(path)).code == 0
        assert commands("run", "--config", str(path)).code == 0


# -- the real commands, as processes --------------------------------------------------------------


def gpuwarden(
    *argv: str, state_dir: Path, timeout: float = 30.0
) -> subprocess.CompletedProcess[str]:
    """A hang (a FIFO opened for reading) fails the test through TimeoutExpired. The state
    directory is set for the embedded defaults, should a broken build start the agent."""
    return subprocess.run(
        [sys.executable, "-m", "agent", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPO), "STATE_DIRECTORY": str(state_dir)},
    )


class TestProcesses:
    """The commands as the operator runs them: same exit code, same message."""

    @pytest.mark.parametrize(
        ("key", "breaker"),
        [
            ("mqtt.password_file", readable_by(0o644)),
            ("mqtt.password_file", missing),
            ("mqtt.ca_file", missing),
            ("prometheus.tls_key_file", readable_by(0o644)),
            ("prometheus.basic_auth_users_file", content("prom:plaintext\n", ":1:")),
            ("prometheus.web_config_file", content("basic_auth_users: [\n", "not valid YAML")),
            ("mqtt.password_file", nul_byte),
            ("watch.password_file", readable_by(0o644)),
        ],
        ids=lambda v: v if isinstance(v, str) else v.__name__,
    )
    def test_same_message(
        self, tmp_path: Path, tls: dict[str, Path], key: str, breaker: Breaker
    ) -> None:
        fk = BY_KEY[key]
        values = good_values(tmp_path / "files", tls, key)
        scratch = tmp_path / "scratch"
        scratch.mkdir()
        values[key], _ = breaker(scratch, values[key])
        path = tmp_path / "gpuwarden.toml"
        path.write_text(config_text(values, tmp_path / "state"))
        state = tmp_path / "state"
        check = gpuwarden("config", "check", "--config", str(path), state_dir=state)
        reader = gpuwarden(fk.command, "--config", str(path), state_dir=state)
        assert check.returncode == 2, check
        assert reader.returncode == 2, reader
        message = check.stderr.removeprefix("gpuwarden: configuration error: ")
        assert message.startswith(f"{path}: {key}: ")
        assert message in reader.stderr
        assert "Traceback" not in reader.stderr


class TestConfigPathItself:
    """--config naming a FIFO, a device or a directory is refused at once: it is stat'ed,
    never opened (a FIFO would block the reader until a writer came)."""

    @pytest.mark.parametrize("command", ["config", "run", "watch"])
    @pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
    def test_refused(self, tmp_path: Path, command: str, kind: str) -> None:
        if kind == "fifo":
            path = tmp_path / "gpuwarden.toml"
            os.mkfifo(path)
            what = "FIFO"
        elif kind == "device":
            path, what = Path("/dev/null"), "character device"
        else:
            path, what = tmp_path, "directory"
        argv = ["config", "check"] if command == "config" else [command]
        done = gpuwarden(*argv, "--config", str(path), state_dir=tmp_path / "s", timeout=20.0)
        assert done.returncode == 2, done
        assert f"{path}: " in done.stderr
        assert what in done.stderr
        assert "expected a regular file" in done.stderr

    @pytest.mark.timeout(20)
    @pytest.mark.parametrize("kind", ["fifo", "directory"])
    def test_load_refuses(self, tmp_path: Path, kind: str) -> None:
        path = tmp_path / "c.toml"
        if kind == "fifo":
            os.mkfifo(path)  # were it opened for reading, this test would block here
        else:
            path.mkdir()
        with pytest.raises(ConfigError, match="expected a regular file") as info:
            config_module.load(path)
        assert info.value.file == str(path)
