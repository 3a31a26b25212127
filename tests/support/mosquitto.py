"""A real mosquitto broker on a free loopback port, started and stopped by the tests."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.ports import free_port, wait_for_port

MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"


@dataclass
class Broker:
    """`extra_config` lines are appended to the generated mosquitto.conf (TLS, ACLs, auth)."""

    workdir: Path
    port: int = field(default_factory=free_port)
    extra_config: Sequence[str] = ()
    allow_anonymous: bool = True
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "mosquitto.log"

    def write_config(self) -> Path:
        self.workdir.mkdir(parents=True, exist_ok=True)
        conf = self.workdir / "mosquitto.conf"
        lines = [
            f"listener {self.port} 127.0.0.1",
            f"allow_anonymous {'true' if self.allow_anonymous else 'false'}",
            "persistence false",
            f"log_dest file {self.log_path}",
            "log_type all",
            *self.extra_config,
        ]
        conf.write_text("\n".join(lines) + "\n")
        return conf

    def start(self) -> Broker:
        conf = self.write_config()
        self.process = subprocess.Popen(
            [MOSQUITTO, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        try:
            wait_for_port(self.port)
        except TimeoutError:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()


def password_broker(workdir: Path, users: Mapping[str, str], acl: str = "") -> Broker:
    """A started broker that lets in only `users` (name -> password), made with
    mosquitto_passwd; `acl` is the text of an acl_file (empty: every user may do anything)."""
    workdir.mkdir(parents=True, exist_ok=True)
    passwords = workdir / "passwd"
    passwords.write_text("")
    for user, password in users.items():
        subprocess.run(["mosquitto_passwd", "-b", str(passwords), user, password], check=True)
    # Started as root, mosquitto switches to its own user and then cannot read the test's
    # private temporary folder: `user root` keeps it.
    lines = [f"password_file {passwords}", "user root"]
    if acl:
        (workdir / "acl").write_text(acl)
        lines.append(f"acl_file {workdir / 'acl'}")
    return Broker(workdir, allow_anonymous=False, extra_config=lines).start()


def secret_file(path: Path, text: str) -> Path:
    """A password file as the agent and the watcher accept it: the text, mode 600."""
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path
