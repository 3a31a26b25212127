"""The Ansible role (configs/ansible/roles/gpuwarden; docs/install.md, "Fifty hosts").

TestToml: the filter that renders gpuwarden.toml writes TOML that reads back as the same
mapping, for any keys and strings, and refuses what TOML cannot hold, naming the key.
The example playbook passes `ansible-playbook --syntax-check`.
TestOnHost runs the role with `ansible-playbook -c local` against this machine, installing the
package built by `make deb` (tests/support/deb.py): twice (the second run changes nothing),
then once with a key the agent refuses (validation keeps the old file). It checks the rendered
configuration with `gpuwarden config check`, the secrets' owner and mode and that they appear
in no output, the file_sd file's JSON and that a real Prometheus discovers its target, and runs
the installed agent as its own user on that configuration against a password broker.
TestWatcherOnHost then makes the same host run the watcher too (gpuwarden_runs [agent, watch]),
then the watcher alone ([watch]), each twice, and runs the installed watcher as its unit would,
with the unit's credentials; TestRoleChange then makes it an agent's host again ([agent], the
watcher's variables still set, HTTPS dropped), twice, and checks that each move left no secret,
credential or drop-in of the unit left (nor the dropped HTTPS files) and the package's credential
files as postinst makes them; TestRemoval takes the host out (state absent, purge). Marked
`host`: root only, the package purged afterwards. test_a_bad_variable_... needs neither.

Not tested here: starting and stopping the units under a running systemd (this machine's PID 1
is not systemd; they run when `systemctl is-system-running` says running or degraded); their
enabling and disabling are (`systemctl enable` needs no running systemd).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import ssl
import stat
import subprocess
import sys
import tempfile
import tomllib
import urllib.error
import urllib.request
from base64 import b64encode
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bcrypt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from configs.ansible.roles.gpuwarden.filter_plugins.gpuwarden_filters import (
    TomlRenderError,
    to_label,
    to_toml,
)
from tests.support.alertmanager import WebhookReceiver
from tests.support.deb import DebPackages, host_package
from tests.support.mosquitto import Broker, password_broker
from tests.support.ports import free_port
from tests.support.prometheus_server import PrometheusServer
from tests.support.tls import Authority, Certificate
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]
ROLES = ROOT / "configs" / "ansible" / "roles"
EXAMPLE_PLAYBOOK = ROOT / "configs" / "ansible" / "playbook.yml"
ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"
GPUWARDEN = Path("/opt/gpuwarden/venv/bin/gpuwarden")
CONFIG_DIR = Path("/etc/gpuwarden")
# The managed host's interpreter: the system's, where the apt module finds python3-apt.
HOST_PYTHON = "/usr/bin/python3"
RECAP = re.compile(r"^(\S+)\s+:\s+((?:\w+=\d+\s*)+)$", re.MULTILINE)
BROKER_PASSWORD = "broker-pw-Qx7\"'$ {{ not_a_template }}"
SCRAPE_PASSWORD = "scrape-pw-4a9"

needs_ansible = pytest.mark.skipif(
    not ANSIBLE_PLAYBOOK.exists(), reason="ansible-core is not installed (pip install -e '.[dev]')"
)


# --- the TOML filter -------------------------------------------------------------------------

KEYS = st.text(min_size=1, max_size=12)
SCALARS = (
    st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text()
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4),
    max_leaves=12,
)


def shipped_prometheus(workdir: Path) -> PrometheusServer:
    """A started Prometheus in `workdir` (beside the targets the role wrote) on the shipped
    configs/prometheus/prometheus.yml and rules, unchanged."""
    shutil.copy(ROOT / "configs" / "prometheus" / "gpuwarden-rules.yml", workdir)
    config = (ROOT / "configs" / "prometheus" / "prometheus.yml").read_text()
    return PrometheusServer(workdir, config).start()


class TestToml:
    @settings(max_examples=300, deadline=None)
    @given(st.dictionaries(KEYS, VALUES, max_size=6))
    def test_any_mapping_reads_back_the_same(self, config: dict[str, object]) -> None:
        assert tomllib.loads(to_toml(config)) == config

    def test_special_floats_and_types_keep_their_type(self) -> None:
        back = tomllib.loads(
            to_toml({"a": 3.0, "b": 1e300, "c": math.inf, "d": -math.inf, "e": True, "f": 1})
        )
        assert back == {"a": 3.0, "b": 1e300, "c": math.inf, "d": -math.inf, "e": True, "f": 1}
        assert [type(back[k]) for k in "abef"] == [float, float, bool, int]
        assert math.isnan(tomllib.loads(to_toml({"n": math.nan}))["n"])

    def test_tables_of_tables_get_no_empty_header_but_empty_tables_stay(self) -> None:
        text = to_toml({"collectors": {"gpu": {"expected_gpus": 8}, "disk": {}}})
        assert "[collectors]" not in text.splitlines()
        assert tomllib.loads(text) == {"collectors": {"gpu": {"expected_gpus": 8}, "disk": {}}}

    @pytest.mark.parametrize(
        ("config", "where", "problem"),
        [
            ({"mqtt": {"username": None}}, "mqtt.username", "TOML has no null"),
            ({"a": {"b": [1, None]}}, "a.b.1", "TOML has no null"),
            ({"a": {1: "x"}}, "a", "a key must be a string"),
            ({"a": "\ud800"}, "a", "lone surrogate"),
            ({"a": {"x", "y"}}, "a", "cannot be written as TOML: set"),
            ({"a": b"bytes"}, "a", "cannot be written as TOML: bytes"),
        ],
    )
    def test_what_toml_cannot_hold_is_refused_by_key(
        self, config: dict[object, object], where: str, problem: str
    ) -> None:
        with pytest.raises(TomlRenderError) as caught:
            to_toml(config)  # type: ignore[arg-type]
        assert f"key {where}:" in str(caught.value)
        assert problem in str(caught.value)


def test_label_values_read_as_written_in_yaml_and_only_scalars() -> None:
    assert [to_label(v) for v in ("a", 7, 1.5, True, False)] == ["a", "7", "1.5", "true", "false"]
    for bad in ({"a": 1}, [1], None):
        with pytest.raises(ValueError, match="gpuwarden_prometheus_labels: a label value must be"):
            to_label(bad)


# --- ansible-playbook --------------------------------------------------------------------------


def ansible_env(home: Path) -> dict[str, str]:
    """Ansible's state in the test's folder, no ansible.cfg of the working directory, no
    colour (the recap is parsed)."""
    home.mkdir(parents=True, exist_ok=True)
    config = home / "ansible.cfg"
    config.write_text(f"[defaults]\nroles_path = {ROLES}\n")
    return {
        **os.environ,
        "ANSIBLE_CONFIG": str(config),
        "ANSIBLE_HOME": str(home),
        "ANSIBLE_LOCAL_TEMP": str(home / "tmp"),
        "ANSIBLE_REMOTE_TEMP": str(home / "remote-tmp"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_FORCE_COLOR": "0",
        "ANSIBLE_RETRY_FILES_ENABLED": "0",
        "ANSIBLE_STDOUT_CALLBACK": "default",
        "ANSIBLE_DEPRECATION_WARNINGS": "0",
    }


@dataclass(frozen=True)
class PlaybookRun:
    returncode: int
    output: str

    def recap(self) -> dict[str, dict[str, int]]:
        """PLAY RECAP by host: {"node-a": {"ok": 10, "changed": 0, ...}}."""
        hosts = {
            host: {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", counts)}
            for host, counts in RECAP.findall(self.output.partition("PLAY RECAP")[2])
        }
        assert hosts, f"no PLAY RECAP in:\n{self.output}"
        return hosts

    def total(self, counter: str) -> int:
        return sum(counts[counter] for counts in self.recap().values())


def playbook(env: dict[str, str], *args: str, timeout: float = 300) -> PlaybookRun:
    done = subprocess.run(
        [str(ANSIBLE_PLAYBOOK), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )
    return PlaybookRun(done.returncode, done.stdout + done.stderr)


@needs_ansible
def test_the_example_playbook_passes_the_syntax_check(tmp_path: Path) -> None:
    inventory = tmp_path / "inventory.ini"
    inventory.write_text("[gpu]\ngpu-node-01\n[watcher]\nops-1\n[prometheus]\nprom-1\n")
    run = playbook(
        ansible_env(tmp_path / "home"),
        "--syntax-check",
        "-i",
        str(inventory),
        str(EXAMPLE_PLAYBOOK),
    )
    assert run.returncode == 0, run.output


@needs_ansible
def test_registration_brackets_ipv6_takes_the_listen_port_and_refuses_bad_label_names(
    tmp_path: Path,
) -> None:
    """The role's file_sd tasks alone (no package, no root), for two hosts in one run: one with
    an IPv6 address and labels of several types, one with a label name Prometheus refuses."""
    targets = tmp_path / "targets"
    inventory = tmp_path / "inventory.ini"
    inventory.write_text(
        f"[gpu]\nv6 ansible_host=fd00::7\nbadlabel\n[gpu:vars]\nansible_connection=local\n"
        f"ansible_python_interpreter={sys.executable}\n"
    )
    labels = {"v6": {"rack": 7, "spare": False}, "badlabel": {"bad-name": "x"}}
    play = [
        {
            "hosts": "gpu",
            "gather_facts": False,
            "vars": {
                "gpuwarden_prometheus_host": "{{ inventory_hostname }}",
                "gpuwarden_prometheus_file_sd_dir": str(targets),
                "gpuwarden_prometheus_labels": "{{ labels[inventory_hostname] }}",
                "labels": labels,
                "gpuwarden_effective_config": {
                    "node_id": "{{ inventory_hostname }}",
                    "prometheus": {"listen": "[::]:9500"},
                },
            },
            "tasks": [
                {
                    "ansible.builtin.include_role": {
                        "name": "gpuwarden",
                        "tasks_from": "prometheus.yml",
                    }
                }
            ],
        }
    ]
    (tmp_path / "play.yml").write_text(json.dumps(play))
    run = playbook(ansible_env(tmp_path / "home"), "-i", str(inventory), str(tmp_path / "play.yml"))
    recap = run.recap()
    assert recap["v6"]["failed"] == 0, run.output
    assert recap["badlabel"]["failed"] == 1, run.output
    assert "label names must match" in run.output
    assert "bad-name" in run.output
    assert sorted(p.name for p in targets.iterdir()) == ["gpuwarden-v6.json"]
    assert json.loads((targets / "gpuwarden-v6.json").read_text()) == [
        {"targets": ["[fd00::7]:9500"], "labels": {"node": "v6", "rack": "7", "spare": "false"}}
    ]


FATAL = re.compile(r"^fatal: \[([^\]]+)\]: FAILED! => (\{.*\})$", re.MULTILINE)
WATCH_VARS = {
    "gpuwarden_runs": ["agent", "watch"],
    "gpuwarden_watch_mqtt_url": "mqtt://broker.example:1883",
    "gpuwarden_watch_mqtt_username": "watcher",
    "gpuwarden_watch_mqtt_password_file": "secrets/watch-mqtt-password",
    "gpuwarden_watch_alertmanager_urls": ["http://am-1:9093", "http://am-2:9093"],
    "gpuwarden_watch_alertmanager_username": "watcher",
    "gpuwarden_watch_alertmanager_password_file": "secrets/am-password",
}
# Host -> the variables it differs in from WATCH_VARS, and what its failure must say.
BAD_VARIABLES: dict[str, tuple[dict[str, object], tuple[str, ...]]] = {
    "runs-typo": ({"gpuwarden_runs": ["agent", "watcher"]}, ("gpuwarden_runs", "watcher")),
    "runs-empty": ({"gpuwarden_runs": []}, ("gpuwarden_runs", "agent", "watch")),
    "runs-string": ({"gpuwarden_runs": "watch"}, ("gpuwarden_runs", "a list")),
    "urls-string": (
        {"gpuwarden_watch_alertmanager_urls": "http://am-1:9093"},
        ("gpuwarden_watch_alertmanager_urls", "a list"),
    ),
    "mqtt-password-alone": (
        {"gpuwarden_watch_mqtt_username": ""},
        ("gpuwarden_watch_mqtt_password_file", "gpuwarden_watch_mqtt_username"),
    ),
    "am-password-alone": (
        {"gpuwarden_watch_alertmanager_username": ""},
        ("gpuwarden_watch_alertmanager_password_file", "gpuwarden_watch_alertmanager_username"),
    ),
    "am-password-and-token": (
        {"gpuwarden_watch_alertmanager_bearer_token_file": "secrets/am-token"},
        (
            "gpuwarden_watch_alertmanager_password_file",
            "gpuwarden_watch_alertmanager_bearer_token_file",
        ),
    ),
    "am-token-and-user": (
        {
            "gpuwarden_watch_alertmanager_password_file": "",
            "gpuwarden_watch_alertmanager_bearer_token_file": "secrets/am-token",
        },
        ("gpuwarden_watch_alertmanager_bearer_token_file", "gpuwarden_watch_alertmanager_username"),
    ),
    "watch-labels-node": (
        {"gpuwarden_watch_prometheus_labels": {"node": "x"}},
        ("gpuwarden_watch_prometheus_labels", "node"),
    ),
    "watch-labels-bad-name": (
        {"gpuwarden_watch_prometheus_labels": {"bad-name": "x"}},
        ("gpuwarden_watch_prometheus_labels", "bad-name"),
    ),
}


@needs_ansible
def test_a_bad_variable_fails_first_naming_the_variable(tmp_path: Path) -> None:
    """One run, one inventory host per bad variable (no root, no package): each fails at the
    role's first tasks with a message naming the variable, before anything is installed; the
    control host `good`, with every watcher variable valid, passes the checks and fails only
    where the package file it names is missing."""
    hosts = {"good": {}, **{name: bad for name, (bad, _) in BAD_VARIABLES.items()}}
    inventory = tmp_path / "inventory.ini"
    inventory.write_text(
        "[gpu]\n" + "\n".join(hosts) + "\n[gpu:vars]\nansible_connection=local\n"
        f"ansible_python_interpreter={sys.executable}\n"
    )
    # Inventory variables, so that each host's own (host_vars) win over the shared ones.
    common = {
        **WATCH_VARS,
        "gpuwarden_package_file": str(tmp_path / "missing.deb"),
        "gpuwarden_package_cache_dir": str(tmp_path / "cache"),
        "gpuwarden_config_dir": str(tmp_path / "etc"),
    }
    (tmp_path / "group_vars").mkdir()
    (tmp_path / "group_vars" / "gpu.yml").write_text(json.dumps(common))
    (tmp_path / "host_vars").mkdir()
    for host, variables in hosts.items():
        (tmp_path / "host_vars" / f"{host}.yml").write_text(json.dumps(variables))
    play = [{"hosts": "gpu", "gather_facts": False, "roles": ["gpuwarden"]}]
    (tmp_path / "play.yml").write_text(json.dumps(play))
    run = playbook(ansible_env(tmp_path / "home"), "-i", str(inventory), str(tmp_path / "play.yml"))
    recap = run.recap()
    failures = {host: json.loads(text) for host, text in FATAL.findall(run.output)}
    assert set(failures) == set(hosts), run.output
    for host, (_, words) in BAD_VARIABLES.items():
        assert recap[host]["changed"] == 0, (host, run.output)
        message = failures[host]["msg"]
        for word in words:
            assert word in message, (host, message)
    assert "missing.deb" in failures["good"]["msg"], failures["good"]
    assert not (tmp_path / "etc").exists()


# --- the role on this host ---------------------------------------------------------------------


def systemd_runs() -> bool:
    """systemd as PID 1 and up: only then can the service tasks run."""
    if not shutil.which("systemctl"):
        return False
    state = subprocess.run(
        ["systemctl", "is-system-running"], capture_output=True, text=True, check=False
    )
    return state.stdout.strip() in {"running", "degraded", "starting"}


@dataclass(frozen=True)
class Deployed:
    """What the role did to this host, read once for the tests of TestOnHost."""

    first: PlaybookRun
    second: PlaybookRun
    refused: PlaybookRun
    upgraded: PlaybookRun
    config_text: str
    config_after_refusal: str
    config_after_upgrade: str
    versions: tuple[str, str]  # installed from the file, then from the repository
    check: subprocess.CompletedProcess[str]
    targets: Path
    work: Path
    listen_port: int
    broker: Broker
    manage_service: bool
    env: dict[str, str]
    inventory: Path
    deb: Path


def server_cert(work: Path) -> Certificate:
    """The endpoint's certificate and key, made by Authority.issue in the fixture."""
    stem = work / "tls" / "ca-node-a"
    return Certificate(stem.with_suffix(".crt"), stem.with_suffix(".key"))


def write_play(work: Path, deb: Path, extra: Mapping[str, object], port: int, broker: int) -> Path:
    variables: dict[str, object] = {
        "gpuwarden_package_file": str(deb),
        "gpuwarden_package_cache_dir": str(work / "cache"),
        "gpuwarden_manage_service": systemd_runs(),
        "gpuwarden_node_id": "node-a",
        "gpuwarden_listen": f"127.0.0.1:{port}",
        "gpuwarden_expected_gpus": 8,
        "gpuwarden_mqtt_url": f"mqtt://127.0.0.1:{broker}",
        "gpuwarden_mqtt_username": "gpuwarden",
        "gpuwarden_mqtt_password_file": str(work / "secrets" / "mqtt-password"),
        "gpuwarden_web_users_file": str(work / "secrets" / "web-users"),
        "gpuwarden_tls_cert_file": str(server_cert(work).cert),
        "gpuwarden_tls_key_file": str(server_cert(work).key),
        "gpuwarden_prometheus_host": "localhost",
        "gpuwarden_prometheus_address": "127.0.0.1",
        "gpuwarden_prometheus_file_sd_dir": str(work / "prometheus" / "targets"),
        "gpuwarden_prometheus_labels": {"cluster": "a", "rack": 7},
        # Any table, with values TOML must quote and escape.
        "gpuwarden_config": {
            "log_level": "debug",
            "collectors": {
                "benchmark": {"enabled": False},
                "kernel_log": {"enabled": False},
                "disk": {"mountpoints_exclude": ['/we"ird\\dir/*', "/proc/*"]},
            },
        },
        **extra,
    }
    play = [{"hosts": "gpu", "gather_facts": False, "vars": variables, "roles": ["gpuwarden"]}]
    path = work / f"play-{len(list(work.glob('play-*.yml')))}.yml"
    path.write_text(json.dumps(play, indent=2))  # JSON is YAML
    return path


def installed_version() -> str:
    return subprocess.run(
        ["dpkg-query", "-W", "-f=${Version}", "gpuwarden"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout


@contextmanager
def apt_repository(deb: Path) -> Iterator[None]:
    """A flat apt repository holding `deb`, in apt's sources while it lasts. Only this source
    is fetched (the others are neither fetched nor cleaned), and its lists go with it. It lies
    in a folder everyone can read: apt fetches as its sandbox user `_apt`."""
    folder = Path(tempfile.mkdtemp(prefix="gpuwarden-test-repo-"))
    folder.chmod(0o755)
    sources = Path("/etc/apt/sources.list.d") / f"{folder.name}.list"
    try:
        shutil.copy(deb, folder)
        packages = subprocess.run(
            ["dpkg-scanpackages", "--multiversion", "."],
            cwd=folder,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        (folder / "Packages").write_text(packages)
        sources.write_text(f"deb [trusted=yes] file:{folder} ./\n")
        only_this = ["-o", f"Dir::Etc::sourcelist={sources}", "-o", "Dir::Etc::sourceparts=-"]
        update = subprocess.run(
            ["apt-get", "update", "-q", *only_this, "-o", "APT::Get::List-Cleanup=0"],
            capture_output=True,
            text=True,
            check=False,
        )
        assert update.returncode == 0 and "E:" not in update.stdout + update.stderr, update
        yield
    finally:
        sources.unlink(missing_ok=True)
        # apt escapes the folder's name in its lists' names ("_" is "%5f"); only one session
        # installs on the host at a time (host_package), so every test repository's lists go.
        for lists in Path("/var/lib/apt/lists").glob("*gpuwarden-test-repo-*"):
            lists.unlink()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def deployed(
    deb_packages: DebPackages, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployed]:
    if not ANSIBLE_PLAYBOOK.exists():
        pytest.skip("ansible-core is not installed (pip install -e '.[dev]')")
    if not Path(HOST_PYTHON).exists():
        pytest.skip(f"the managed host's interpreter {HOST_PYTHON} is missing")
    deb = deb_packages.path()
    work = tmp_path_factory.mktemp("ansible")
    secrets = work / "secrets"
    secrets.mkdir()
    (secrets / "mqtt-password").write_text(BROKER_PASSWORD + "\n")
    hashed = bcrypt.hashpw(SCRAPE_PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
    (secrets / "web-users").write_text(f"prometheus:{hashed}\n")
    Authority(work / "tls").create().issue("node-a", ip_addresses=("127.0.0.1",))
    (work / "inventory.ini").write_text(
        f"[gpu]\nnode-a ansible_connection=local ansible_python_interpreter={HOST_PYTHON}\n"
        f"[prometheus]\nlocalhost ansible_connection=local ansible_python_interpreter={HOST_PYTHON}\n"
    )
    env = ansible_env(work / "home")
    port = free_port()
    inventory = ["-i", str(work / "inventory.ini")]
    with host_package():
        broker = password_broker(work / "broker", {"gpuwarden": BROKER_PASSWORD})
        try:
            play = write_play(work, deb, {}, port, broker.port)
            # --diff and -v: the most a run shows; no secret may be in it.
            first = playbook(env, *inventory, "--diff", "-v", str(play))
            second = playbook(env, *inventory, "--diff", str(play))
            config_text = (CONFIG_DIR / "gpuwarden.toml").read_text()
            check = subprocess.run(
                [str(GPUWARDEN), "config", "check", "--config", str(CONFIG_DIR / "gpuwarden.toml")],
                capture_output=True,
                text=True,
                check=False,
            )
            bad = write_play(work, deb, {"gpuwarden_config": {"no_such_key": 1}}, port, broker.port)
            refused = playbook(env, *inventory, str(bad))
            after_refusal = (CONFIG_DIR / "gpuwarden.toml").read_text()
            from_file = installed_version()
            # The same hosts switched to a repository holding a newer version: an upgrade over
            # the role's configuration, unattended.
            newer = deb_packages.next_version
            with apt_repository(deb_packages.path(newer)):
                from_repo = {"gpuwarden_package_file": "", "gpuwarden_package_version": newer}
                upgraded = playbook(
                    env, *inventory, str(write_play(work, deb, from_repo, port, broker.port))
                )
                versions = (from_file, installed_version())
            yield Deployed(
                first,
                second,
                refused,
                upgraded,
                config_text,
                after_refusal,
                (CONFIG_DIR / "gpuwarden.toml").read_text(),
                versions,
                check,
                work / "prometheus" / "targets",
                work,
                port,
                broker,
                systemd_runs(),
                env,
                work / "inventory.ini",
                deb,
            )
        finally:
            broker.stop()


@dataclass(frozen=True)
class Watching:
    """The same host made the watcher's too (gpuwarden_runs [agent, watch]), run twice, then
    the watcher's alone ([watch]): what each left, read before the next."""

    both: PlaybookRun
    both_again: PlaybookRun
    both_config: str
    both_units: dict[str, str]  # unit -> `systemctl is-enabled`
    both_targets: list[str]
    alone: PlaybookRun
    alone_again: PlaybookRun
    alone_config: str
    alone_units: dict[str, str]
    alone_targets: list[str]
    alone_files: dict[str, FileState | None]  # the role's files once the agent was gone
    refused: PlaybookRun
    config_after_refusal: str
    variables: Mapping[str, object]  # the watcher-only play's
    broker: Broker
    alertmanager: WebhookReceiver
    watch_port: int


WATCH_UNITS = ("gpuwarden.service", "gpuwarden-watch.service")
WATCH_DROP_IN = Path("/etc/systemd/system/gpuwarden-watch.service.d/gpuwarden-ansible.conf")
WATCH_CREDENTIALS = Path("/run/credentials/gpuwarden-watch.service")
WATCH_PASSWORD = "watch-pw-\"'$ {{ nor_this }}"
ALERTMANAGER_PASSWORD = "am-pw-Zk2 {{ x }}"


# The files the role writes for one unit, by the unit that uses them: name in /etc/gpuwarden
# (or the drop-in's path) -> what it is where that unit is not run. The two credential files
# the package's units name in their LoadCredential= go back to the package's state (postinst
# makes them empty, root's, 0600: a unit whose credential file is missing does not start);
# the others the role alone made, and they go.
FileState = tuple[str, str, int, int]  # owner, group, mode, size
EMPTIED: FileState = ("root", "root", 0o600, 0)
AGENT_FILES: dict[str, FileState | None] = {
    "mqtt-password": EMPTIED,
    "web-users": None,
    "tls.crt": None,
    "tls.key": None,
}
WATCH_FILES: dict[str, FileState | None] = {
    "watch-mqtt-password": EMPTIED,
    "watch-alertmanager-password": None,
    str(WATCH_DROP_IN): None,
}


def role_files() -> dict[str, FileState | None]:
    """Each of the role's files as it is now, None where there is none."""
    found: dict[str, FileState | None] = {}
    for name in (*AGENT_FILES, *WATCH_FILES):
        path = CONFIG_DIR / name  # an absolute name stays itself
        if not path.exists():
            found[name] = None
            continue
        info = path.stat()
        found[name] = (path.owner(), path.group(), stat.S_IMODE(info.st_mode), info.st_size)
    return found


def units_enabled() -> dict[str, str]:
    return {
        unit: subprocess.run(
            ["systemctl", "is-enabled", unit], capture_output=True, text=True, check=False
        ).stdout.strip()
        for unit in WATCH_UNITS
    }


def target_files(targets: Path) -> list[str]:
    return sorted(str(p.relative_to(targets)) for p in targets.rglob("*.json"))


@pytest.fixture(scope="module")
def watching(deployed: Deployed, deb_packages: DebPackages) -> Iterator[Watching]:
    """Runs after TestOnHost (the first test that asks for it is in TestWatcherOnHost). The
    units' boot state is set for real (`systemctl enable`/`disable` need no running systemd);
    where systemd does not run, gpuwarden_service_state "" leaves their running state alone."""
    work = deployed.work
    # The version the upgrade left installed, from its file: apt sees nothing to do.
    deb = deb_packages.path(deb_packages.next_version)
    secrets = work / "secrets"
    (secrets / "watch-mqtt-password").write_text(WATCH_PASSWORD + "\n")
    (secrets / "am-password").write_text(ALERTMANAGER_PASSWORD + "\n")
    broker = password_broker(work / "watch-broker", {"watcher": WATCH_PASSWORD})
    alertmanager = WebhookReceiver().start()
    watch_port = free_port()
    try:
        watch = {
            "gpuwarden_manage_service": True,
            "gpuwarden_service_state": "started" if deployed.manage_service else "",
            "gpuwarden_watch_mqtt_url": broker.url,
            "gpuwarden_watch_mqtt_username": "watcher",
            "gpuwarden_watch_mqtt_password_file": str(secrets / "watch-mqtt-password"),
            "gpuwarden_watch_listen": f"127.0.0.1:{watch_port}",
            "gpuwarden_watch_alertmanager_urls": [alertmanager.url.rstrip("/")],
            "gpuwarden_watch_alertmanager_username": "watcher",
            "gpuwarden_watch_alertmanager_password_file": str(secrets / "am-password"),
            "gpuwarden_watch_prometheus_labels": {"cluster": "a", "tier": 1},
        }

        def run(extra: Mapping[str, object], *args: str) -> PlaybookRun:
            play = write_play(work, deb, extra, deployed.listen_port, deployed.broker.port)
            return playbook(deployed.env, "-i", str(deployed.inventory), *args, str(play))

        both_vars = {**watch, "gpuwarden_runs": ["agent", "watch"]}
        both = run(both_vars, "--diff", "-v")
        both_again = run(both_vars, "--diff")
        both_config = (CONFIG_DIR / "gpuwarden.toml").read_text()
        both_units, both_targets = units_enabled(), target_files(deployed.targets)
        alone_vars = {**watch, "gpuwarden_runs": ["watch"]}
        alone = run(alone_vars, "--diff", "-v")
        alone_again = run(alone_vars)
        alone_config = (CONFIG_DIR / "gpuwarden.toml").read_text()
        alone_units, alone_targets = units_enabled(), target_files(deployed.targets)
        alone_files = role_files()
        # A [watch] key the watcher refuses: the old file stays.
        refused = run({**alone_vars, "gpuwarden_config": {"watch": {"no_such_key": 1}}})
        yield Watching(
            both,
            both_again,
            both_config,
            both_units,
            both_targets,
            alone,
            alone_again,
            alone_config,
            alone_units,
            alone_targets,
            alone_files,
            refused,
            (CONFIG_DIR / "gpuwarden.toml").read_text(),
            alone_vars,
            broker,
            alertmanager,
            watch_port,
        )
    finally:
        alertmanager.stop()
        broker.stop()


@dataclass(frozen=True)
class Returned:
    """The watcher's host made an agent's host again ([agent]), the watcher's variables still
    set and HTTPS dropped (gpuwarden_tls_*_file ""): run twice, read after the first."""

    back: PlaybookRun
    back_again: PlaybookRun
    files: dict[str, FileState | None]
    config: str
    units: dict[str, str]
    targets: list[str]


@pytest.fixture(scope="module")
def returned(deployed: Deployed, watching: Watching, deb_packages: DebPackages) -> Returned:
    """Runs after TestWatcherOnHost, whose tests read the watcher's host `watching` left."""
    deb = deb_packages.path(deb_packages.next_version)  # installed: apt sees nothing to do
    variables = {
        **watching.variables,
        "gpuwarden_runs": ["agent"],
        "gpuwarden_tls_cert_file": "",
        "gpuwarden_tls_key_file": "",
    }

    def run() -> PlaybookRun:
        play = write_play(deployed.work, deb, variables, deployed.listen_port, deployed.broker.port)
        return playbook(deployed.env, "-i", str(deployed.inventory), str(play))

    back = run()
    files, config = role_files(), (CONFIG_DIR / "gpuwarden.toml").read_text()
    units, targets = units_enabled(), target_files(deployed.targets)
    return Returned(back, run(), files, config, units, targets)


@dataclass(frozen=True)
class Removed:
    run: PlaybookRun
    status: str  # dpkg's state letters after it ("" once purged)
    left: list[str]  # what the role made that is still there


@pytest.fixture(scope="module")
def removed(deployed: Deployed, watching: Watching) -> Removed:
    """gpuwarden_state absent with a purge, once the tests that read the installed host ran
    (TestRemoval, the file's last class), from the watcher's host that `watching` left."""
    gone = {**watching.variables, "gpuwarden_state": "absent", "gpuwarden_purge": True}
    play = write_play(deployed.work, deployed.deb, gone, deployed.listen_port, deployed.broker.port)
    run = playbook(deployed.env, "-i", str(deployed.inventory), str(play))
    status = subprocess.run(
        ["dpkg-query", "-W", "-f=${db:Status-Abbrev}", "gpuwarden"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    made = [
        deployed.targets / "gpuwarden-node-a.json",
        deployed.targets / "gpuwarden-watch" / "node-a.json",
        deployed.work / "cache",
        CONFIG_DIR,
        WATCH_DROP_IN,
    ]
    return Removed(run, status, [str(p) for p in made if p.exists()])


@pytest.mark.host
@pytest.mark.slow
class TestOnHost:
    def test_the_first_run_changes_the_host_and_the_second_changes_nothing(
        self, deployed: Deployed
    ) -> None:
        assert deployed.first.returncode == 0, deployed.first.output
        assert deployed.first.total("failed") == 0
        assert deployed.first.total("changed") >= 5, deployed.first.recap()
        assert deployed.second.returncode == 0, deployed.second.output
        assert deployed.second.total("changed") == 0, deployed.second.output
        # A changed file restarts the agent; an unchanged one does not (skipped here without
        # systemd, but notified all the same).
        restart = "RUNNING HANDLER [gpuwarden : Restart gpuwarden]"
        assert restart in deployed.first.output
        assert restart not in deployed.second.output

    def test_the_rendered_configuration_is_accepted_and_holds_the_variables(
        self, deployed: Deployed
    ) -> None:
        assert deployed.check.returncode == 0, deployed.check.stdout + deployed.check.stderr
        config = tomllib.loads(deployed.config_text)
        assert config["node_id"] == "node-a"
        assert config["prometheus"] == {
            "listen": f"127.0.0.1:{deployed.listen_port}",
            "basic_auth_users_file": "/etc/gpuwarden/web-users",
            "tls_cert_file": "/etc/gpuwarden/tls.crt",
            "tls_key_file": "/etc/gpuwarden/tls.key",
        }
        assert config["collectors"]["gpu"] == {"expected_gpus": 8}
        assert config["collectors"]["disk"] == {
            "mountpoints_exclude": ['/we"ird\\dir/*', "/proc/*"]
        }
        assert config["mqtt"] == {
            "enabled": True,
            "url": deployed.broker.url,
            "username": "gpuwarden",
            "password_file": "/etc/gpuwarden/mqtt-password",
        }

    def test_a_configuration_the_agent_refuses_fails_the_run_and_keeps_the_old_file(
        self, deployed: Deployed
    ) -> None:
        assert deployed.refused.returncode != 0
        assert deployed.refused.recap()["node-a"]["failed"] == 1
        assert "no_such_key" in deployed.refused.output  # config check's message, shown
        assert deployed.config_after_refusal == deployed.config_text

    def test_an_upgrade_from_a_repository_keeps_the_configuration_without_a_prompt(
        self, deployed: Deployed
    ) -> None:
        assert deployed.upgraded.returncode == 0, deployed.upgraded.output
        first, then = deployed.versions
        assert then != first
        assert then.startswith(first)  # the next version of the same tree (tests/support/deb.py)
        assert deployed.config_after_upgrade == deployed.config_text
        assert not list(CONFIG_DIR.glob("*.dpkg-*"))  # no conffile question left behind

    def test_secrets_are_the_agent_users_alone_and_never_shown(self, deployed: Deployed) -> None:
        key_body = server_cert(deployed.work).key.read_text().splitlines()[1]
        secrets = (
            ("mqtt-password", BROKER_PASSWORD),
            ("web-users", "prometheus:$2b$"),
            ("tls.key", "-----BEGIN PRIVATE KEY-----"),
        )
        for name, text in secrets:
            path = CONFIG_DIR / name
            info = path.stat()
            assert stat.S_IMODE(info.st_mode) == 0o600, name
            assert (path.owner(), path.group()) == ("gpuwarden", "gpuwarden"), name
            assert path.read_text().startswith(text)
        for run in (deployed.first, deployed.second, deployed.refused, deployed.upgraded):
            assert BROKER_PASSWORD not in run.output
            assert "$2b$" not in run.output
            assert key_body not in run.output
        assert BROKER_PASSWORD not in deployed.config_text

    def test_the_file_sd_file_names_the_target_and_its_labels(self, deployed: Deployed) -> None:
        files = sorted(p.name for p in deployed.targets.iterdir())
        assert files == ["gpuwarden-node-a.json"]
        groups = json.loads((deployed.targets / files[0]).read_text())
        assert groups == [
            {
                "targets": [f"127.0.0.1:{deployed.listen_port}"],
                "labels": {"node": "node-a", "__scheme__": "https", "cluster": "a", "rack": "7"},
            }
        ]

    def test_prometheus_discovers_the_target_with_the_shipped_scrape_config(
        self, deployed: Deployed
    ) -> None:
        """configs/prometheus/prometheus.yml, unchanged, reads the directory the role wrote."""
        server = shipped_prometheus(deployed.targets.parent)
        try:

            def discovered() -> list[dict[str, Any]]:
                targets = server.api("targets")["activeTargets"]
                return [t for t in targets if t["labels"].get("job") == "gpuwarden"]

            wait_until(lambda: discovered() != [], timeout=30)
            assert [t["scrapeUrl"] for t in discovered()] == [
                f"https://127.0.0.1:{deployed.listen_port}/metrics"
            ]
            assert [t["labels"] for t in discovered()] == [
                {
                    "job": "gpuwarden",
                    "instance": f"127.0.0.1:{deployed.listen_port}",
                    "node": "node-a",
                    "cluster": "a",
                    "rack": "7",
                }
            ]
        finally:
            server.stop()

    def test_the_installed_agent_runs_as_its_user_with_both_secrets(
        self, deployed: Deployed
    ) -> None:
        """What the unit would run, as the unit's user: the broker takes the password file's
        password, the endpoint serves HTTPS with the copied key and wants the users file's
        password."""
        if deployed.manage_service:
            pytest.skip("systemd runs the agent here")
        agent = subprocess.Popen(
            [
                "setpriv",
                "--reuid=gpuwarden",
                "--regid=gpuwarden",
                "--init-groups",
                str(GPUWARDEN),
                "run",
                "--config",
                str(CONFIG_DIR / "gpuwarden.toml"),
            ],
            stdout=(deployed.work / "agent.log").open("ab"),
            stderr=subprocess.STDOUT,
        )
        url = f"https://127.0.0.1:{deployed.listen_port}/metrics"
        tls = ssl.create_default_context(cafile=Authority(deployed.work / "tls").cert)
        auth = b64encode(f"prometheus:{SCRAPE_PASSWORD}".encode()).decode()
        try:

            def metrics() -> str:
                request = urllib.request.Request(url, headers={"Authorization": f"Basic {auth}"})
                try:
                    with urllib.request.urlopen(request, timeout=5, context=tls) as response:
                        return str(response.read().decode())
                except OSError:
                    return ""

            wait_until(lambda: "gpuwarden_mqtt_connected 1.0" in metrics(), timeout=60)
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(url, timeout=5, context=tls)
            assert refused.value.code == 401
        finally:
            agent.terminate()
            agent.wait(15)


@pytest.mark.host
@pytest.mark.slow
class TestWatcherOnHost:
    def test_each_run_changes_the_host_once_and_then_nothing(self, watching: Watching) -> None:
        for first, second in (
            (watching.both, watching.both_again),
            (watching.alone, watching.alone_again),
        ):
            assert first.returncode == 0, first.output
            assert first.total("changed") >= 1, first.recap()
            assert second.returncode == 0, second.output
            assert second.total("changed") == 0, second.output
        restart = "RUNNING HANDLER [gpuwarden : Restart gpuwarden-watch]"
        assert restart in watching.both.output
        assert restart not in watching.both_again.output

    def test_the_units_enabled_are_those_the_host_runs(self, watching: Watching) -> None:
        """The package enables gpuwarden.service on its first install: a watcher's host
        disables it."""
        assert watching.both_units == dict.fromkeys(WATCH_UNITS, "enabled")
        assert watching.alone_units == {
            "gpuwarden.service": "disabled",
            "gpuwarden-watch.service": "enabled",
        }

    def test_the_watch_table_holds_the_variables_and_names_the_credentials(
        self, watching: Watching
    ) -> None:
        expected = {
            "url": watching.broker.url,
            "username": "watcher",
            "password_file": f"{WATCH_CREDENTIALS}/mqtt-password",
            "listen": f"127.0.0.1:{watching.watch_port}",
            "alertmanager_urls": [watching.alertmanager.url.rstrip("/")],
            "alertmanager_username": "watcher",
            "alertmanager_password_file": f"{WATCH_CREDENTIALS}/alertmanager-password",
        }
        both = tomllib.loads(watching.both_config)
        assert both["watch"] == expected
        assert both["mqtt"]["username"] == "gpuwarden"  # the agent's table, beside it
        alone = tomllib.loads(watching.alone_config)
        assert alone["watch"] == expected
        # No agent key on a host without the agent (gpuwarden_config's own keys stay).
        assert not {"node_id", "prometheus", "mqtt"} & set(alone), alone
        assert WATCH_DROP_IN.read_text().splitlines()[-1] == (
            "LoadCredential=alertmanager-password:/etc/gpuwarden/watch-alertmanager-password"
        )

    def test_a_watch_key_the_watcher_refuses_fails_the_run_and_keeps_the_old_file(
        self, watching: Watching
    ) -> None:
        assert watching.refused.returncode != 0
        assert watching.refused.recap()["node-a"]["failed"] == 1
        assert "no_such_key" in watching.refused.output
        assert watching.config_after_refusal == watching.alone_config

    def test_the_watchers_secrets_are_roots_alone_and_never_shown(self, watching: Watching) -> None:
        for name, text in (
            ("watch-mqtt-password", WATCH_PASSWORD),
            ("watch-alertmanager-password", ALERTMANAGER_PASSWORD),
        ):
            path = CONFIG_DIR / name
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, name
            assert (path.owner(), path.group()) == ("root", "root"), name
            assert path.read_text() == text + "\n"
        runs = (watching.both, watching.both_again, watching.alone, watching.alone_again)
        for run in (*runs, watching.refused):
            assert WATCH_PASSWORD not in run.output
            assert ALERTMANAGER_PASSWORD not in run.output
        assert WATCH_PASSWORD not in watching.alone_config

    def test_registration_follows_what_the_host_runs(self, watching: Watching) -> None:
        assert watching.both_targets == ["gpuwarden-node-a.json", "gpuwarden-watch/node-a.json"]
        assert watching.alone_targets == ["gpuwarden-watch/node-a.json"]

    def test_prometheus_scrapes_the_watcher_as_its_job_and_not_as_an_agent(
        self, deployed: Deployed, watching: Watching
    ) -> None:
        """configs/prometheus/prometheus.yml, unchanged, on the directory the role wrote; the
        watcher's file must not be read as an agent's target too."""
        groups = json.loads((deployed.targets / "gpuwarden-watch" / "node-a.json").read_text())
        assert groups == [
            {
                "targets": [f"127.0.0.1:{watching.watch_port}"],
                "labels": {"cluster": "a", "tier": "1"},
            }
        ]
        server = shipped_prometheus(deployed.targets.parent)
        try:

            def active() -> list[dict[str, Any]]:
                return list(server.api("targets")["activeTargets"])

            wait_until(
                lambda: any(t["labels"]["job"] == "gpuwarden-watch" for t in active()), timeout=30
            )
            assert [(t["labels"]["job"], t["scrapeUrl"]) for t in active()] == [
                ("gpuwarden-watch", f"http://127.0.0.1:{watching.watch_port}/metrics")
            ]
        finally:
            server.stop()

    def test_the_installed_watcher_runs_with_the_units_credentials(
        self, watching: Watching
    ) -> None:
        """What gpuwarden-watch.service runs, as it runs it: an unprivileged user with the two
        credentials systemd copies from /etc/gpuwarden into /run/credentials/<unit>/ (here in
        a mount namespace of its own, a tmpfs over /run). The broker takes the password, and
        the Alertmanager member gets the basic-auth password at the watcher's first post."""
        if systemd_runs():
            pytest.skip("systemd runs the watcher here")
        script = (
            "set -e; mount -t tmpfs -o mode=0755 tmpfs /run; "
            f"mkdir -p {WATCH_CREDENTIALS}; "
            f"cp {CONFIG_DIR}/watch-mqtt-password {WATCH_CREDENTIALS}/mqtt-password; "
            f"cp {CONFIG_DIR}/watch-alertmanager-password {WATCH_CREDENTIALS}/alertmanager-password; "
            f"chown -R nobody {WATCH_CREDENTIALS}; chmod 0400 {WATCH_CREDENTIALS}/*; "
            f"chmod 0500 {WATCH_CREDENTIALS}; "
            "exec setpriv --reuid=nobody --regid=nogroup --clear-groups "
            f"{GPUWARDEN} watch --config {CONFIG_DIR / 'gpuwarden.toml'}"
        )
        log = watching.broker.workdir / "watcher.log"
        watcher = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            stdout=log.open("ab"),
            stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{watching.watch_port}/metrics"
        basic = "Basic " + b64encode(f"watcher:{ALERTMANAGER_PASSWORD}".encode()).decode()
        try:

            def metrics() -> str:
                try:
                    with urllib.request.urlopen(url, timeout=5) as response:
                        return str(response.read().decode())
                except OSError:
                    return ""

            connected = re.compile(r"^gpuwarden_watch_broker_connected 1(\.0)?$", re.MULTILINE)
            wait_until(
                lambda: bool(connected.search(metrics())) or watcher.poll() is not None,
                timeout=60,
            )
            assert watcher.poll() is None, log.read_text()
            wait_until(lambda: watching.alertmanager.received() != [], timeout=30)
            assert {n.authorization for n in watching.alertmanager.received()} == {basic}
            assert {n.path for n in watching.alertmanager.received()} == {"/api/v2/alerts"}
        finally:
            watcher.terminate()
            watcher.wait(15)


@pytest.mark.host
@pytest.mark.slow
class TestRoleChange:
    """A host moved from one unit to the other keeps no secret, credential or drop-in of the
    one it no longer runs (its variables still set: the inventory's groups changed, not its
    values), nor one the configuration stopped naming; the one it runs keeps its own."""

    @pytest.mark.parametrize(
        ("left", "name"),
        [*(("watch", name) for name in AGENT_FILES), *(("agent", name) for name in WATCH_FILES)],
    )
    def test_the_files_of_the_unit_left_go_or_return_to_the_packages_state(
        self, watching: Watching, returned: Returned, left: str, name: str
    ) -> None:
        files = watching.alone_files if left == "watch" else returned.files
        expected = {**AGENT_FILES, **WATCH_FILES}[name]
        assert files[name] == expected, (left, name, files)

    def test_a_secret_the_configuration_no_longer_names_goes_and_the_others_come_back(
        self, deployed: Deployed, returned: Returned
    ) -> None:
        assert returned.back.returncode == 0, returned.back.output
        assert returned.files["tls.crt"] is None, returned.files
        assert returned.files["tls.key"] is None, returned.files
        for name in ("mqtt-password", "web-users"):
            state = returned.files[name]
            assert state is not None, name
            assert state[:3] == ("gpuwarden", "gpuwarden", 0o600), returned.files
            assert state[3] > 0, name
        assert (CONFIG_DIR / "mqtt-password").read_text() == BROKER_PASSWORD + "\n"
        assert tomllib.loads(returned.config)["prometheus"] == {
            "listen": f"127.0.0.1:{deployed.listen_port}",
            "basic_auth_users_file": "/etc/gpuwarden/web-users",
        }

    def test_the_move_back_changes_the_host_once_and_then_nothing(self, returned: Returned) -> None:
        assert returned.back.returncode == 0, returned.back.output
        assert returned.back.total("changed") >= 1, returned.back.recap()
        assert returned.back_again.returncode == 0, returned.back_again.output
        assert returned.back_again.total("changed") == 0, returned.back_again.output
        assert returned.units == {
            "gpuwarden.service": "enabled",
            "gpuwarden-watch.service": "disabled",
        }
        assert returned.targets == ["gpuwarden-node-a.json"]
        for run in (returned.back, returned.back_again):
            assert BROKER_PASSWORD not in run.output
            assert WATCH_PASSWORD not in run.output
            assert ALERTMANAGER_PASSWORD not in run.output


@pytest.mark.host
@pytest.mark.slow
class TestRemoval:
    def test_state_absent_unregisters_first_and_purges(self, removed: Removed) -> None:
        assert removed.run.returncode == 0, removed.run.output
        assert removed.status in {"", "un", "pn"}, removed.status
        assert removed.left == []
        # Both target files go before the package: nobody is paged for units it stops.
        tasks = re.findall(r"^TASK \[gpuwarden : (.+?)\]", removed.run.output, re.MULTILINE)
        unregister = tasks.index("Remove the host's file_sd target files")
        assert unregister < tasks.index("Remove the package"), tasks
