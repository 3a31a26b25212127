"""A throwaway certificate authority made with the openssl command line, for TLS tests."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@dataclass(frozen=True)
class Certificate:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Authority:
    """A CA; `issue()` signs a certificate for a host name (server) or a user (client)."""

    workdir: Path
    name: str = "ca"

    @property
    def cert(self) -> Path:
        return self.workdir / f"{self.name}.crt"

    @property
    def key(self) -> Path:
        return self.workdir / f"{self.name}.key"

    def create(self) -> Authority:
        self.workdir.mkdir(parents=True, exist_ok=True)
        _openssl(
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(self.key),
            "-out",
            str(self.cert),
            "-days",
            "2",
            "-subj",
            f"/CN=gpuwarden test {self.name}",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        )
        return self

    def issue(
        self,
        common_name: str,
        dns_names: tuple[str, ...] = (),
        ip_addresses: tuple[str, ...] = (),
        client: bool = False,
    ) -> Certificate:
        stem = self.workdir / f"{self.name}-{common_name}"
        key, csr, cert = (
            stem.with_suffix(".key"),
            stem.with_suffix(".csr"),
            stem.with_suffix(".crt"),
        )
        _openssl(
            "req",
            "-new",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(csr),
            "-subj",
            f"/CN={common_name}",
        )
        ext = stem.with_suffix(".ext")
        alt = [f"DNS:{d}" for d in dns_names] + [f"IP:{ip}" for ip in ip_addresses]
        lines = [
            "basicConstraints=CA:FALSE",
            f"extendedKeyUsage={'clientAuth' if client else 'serverAuth'}",
        ]
        if alt:
            lines.append("subjectAltName=" + ",".join(alt))
        ext.write_text("\n".join(lines) + "\n")
        _openssl(
            "x509",
            "-req",
            "-in",
            str(csr),
            "-CA",
            str(self.cert),
            "-CAkey",
            str(self.key),
            "-CAcreateserial",
            "-out",
            str(cert),
            "-days",
            "2",
            "-extfile",
            str(ext),
        )
        key.chmod(0o600)
        return Certificate(cert, key)
