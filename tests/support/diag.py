"""Fixture trees and configurations for the check and diag tests."""

from __future__ import annotations

import subprocess
from pathlib import Path

from agent.program import config_file as config_module
from tests.support.host import ProcTree
from tests.support.ports import free_port

GIB_KB = 1024 * 1024


def make_proc_tree(
    root: Path, total_kb: int = 64 * GIB_KB, available_kb: int = 48 * GIB_KB
) -> Path:
    """The files collectors/system.py reads, with the memory figures given."""
    (root / "sys/kernel/random").mkdir(parents=True, exist_ok=True)
    (root / "meminfo").write_text(
        f"MemTotal:       {total_kb} kB\nMemFree:        {available_kb // 2} kB\n"
        f"MemAvailable:   {available_kb} kB\nSwapTotal:             0 kB\nSwapFree:              0 kB\n"
    )
    (root / "loadavg").write_text("0.52 0.40 0.31 1/612 4242\n")
    (root / "uptime").write_text("5120.33 80000.10\n")
    (root / "sys/kernel/random/boot_id").write_text("3f1e0b7c-2b7a-4d51-9f5e-0b6c1d2e3f40\n")
    tree = ProcTree(root)
    tree.set_mountinfo("27 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw\n")
    tree.add_process(1, "systemd", "S", ppid=0)
    tree.add_process(4242, "python", "S", ppid=1)
    return root


def _empty_log(directory: Path) -> Path:
    path = directory / "kern.log"
    path.touch()
    return path


def write_config(
    directory: Path, proc_root: Path | None = None, extra: str = "", port: int | None = None
) -> Path:
    """A configuration with its own state dir and a free Prometheus port."""
    directory.mkdir(parents=True, exist_ok=True)
    lines = [
        'node_id = "test-node-1"',
        f'state_dir = "{directory / "state"}"',
        "[prometheus]",
        f'listen = "127.0.0.1:{port or free_port()}"',
    ]
    if proc_root is not None:
        # Host collectors on the fixture tree; the disk collector watches nothing (disk lines
        # are tested on scripted statvfs answers, not on this machine's disks).
        lines += [
            "[collectors.system]",
            f'proc_root = "{proc_root}"',
            "[collectors.processes]",
            f'proc_root = "{proc_root}"',
            "[collectors.disk]",
            f'proc_root = "{proc_root}"',
            'mountpoints_include = ["/no-such-mount-for-tests"]',
        ]
        if "[collectors.kernel_log]" not in extra:
            # Nor this machine's kernel log: what other tests made the kernel log say (a
            # real segfault) is no finding of the host under test.
            lines += ["[collectors.kernel_log]", f'path = "{_empty_log(directory)}"']
    path = directory / "gpuwarden.toml"
    path.write_text("\n".join(lines) + "\n" + extra)
    return path


def load(path: Path) -> config_module.Config:
    return config_module.load(path)


def make_tls_files(directory: Path) -> tuple[Path, Path, Path]:
    """A throw-away CA and a server certificate for 127.0.0.1 (openssl): (ca, cert, key)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca, key, csr, cert = (
        directory / n for n in ("ca.key", "ca.pem", "server.key", "server.csr", "server.pem")
    )
    ext = directory / "ext.cnf"
    ext.write_text("subjectAltName = IP:127.0.0.1\n")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        str(ca_key),
        "-out",
        str(ca),
        "-days",
        "2",
        "-subj",
        "/CN=gpuwarden test CA",
    )
    openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        str(key),
        "-out",
        str(csr),
        "-subj",
        "/CN=127.0.0.1",
    )
    openssl(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(ca),
        "-CAkey",
        str(ca_key),
        "-CAcreateserial",
        "-out",
        str(cert),
        "-days",
        "2",
        "-extfile",
        str(ext),
    )
    return ca, cert, key
