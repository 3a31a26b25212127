"""A real Prometheus server on a free loopback port, for end-to-end tests of the alert rules."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.ports import free_port, wait_for_port

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


@dataclass
class PrometheusServer:
    workdir: Path
    config_text: str
    """prometheus.yml; rule files named in it are resolved against `workdir`."""
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> PrometheusServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "prometheus.yml").write_text(self.config_text)
        self.process = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={self.workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            cwd=self.workdir,
            stdout=subprocess.DEVNULL,
            stderr=(self.workdir / "prometheus.log").open("ab"),
        )
        wait_for_port(self.port, timeout=30)
        self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        """The port opens before the storage is loaded; /-/ready says 200 once queries work."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                url = f"http://127.0.0.1:{self.port}/-/ready"
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"Prometheus not ready after {timeout} s")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self.process = None

    def api(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}{query}"
        with urllib.request.urlopen(url, timeout=5) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.api("query", query=expr)["result"]
        return result

    def alerts(self) -> list[dict[str, Any]]:
        alerts: list[dict[str, Any]] = self.api("alerts")["alerts"]
        return alerts

    def alert_states(self, name: str) -> set[str]:
        return {a["state"] for a in self.alerts() if a["labels"].get("alertname") == name}
