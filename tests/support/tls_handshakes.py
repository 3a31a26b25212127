"""HTTPS requests against a TLS ScrapeServer, all in the interpreter that runs this module.

`python -m tests.support.tls_handshakes CERT KEY CA COUNT` serves on a free loopback port,
makes COUNT requests, one connection each, and prints {"ok": n, "failures": [...]} as JSON.
It imports exporters.http and the standard library only, so any Python 3.11+ can run it with
the repository on its path: the package's interpreter (/usr/bin/python3), not only the venv's.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import sys
import threading
import urllib.request

from exporters.http import ScrapeServer


async def _ok(_head: bytes, _client: str) -> tuple[int, dict[str, str], bytes]:
    return 200, {}, b"ok\n"


def main(cert: str, key: str, ca: str, count: int) -> dict[str, object]:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    started = threading.Event()
    port: list[int] = []

    def serve() -> None:
        async def run() -> None:
            server = await ScrapeServer(_ok, tls=context).listen("127.0.0.1", 0)
            port.append(server.sockets[0].getsockname()[1])
            started.set()
            await asyncio.sleep(3600)

        asyncio.run(run())

    threading.Thread(target=serve, daemon=True).start()
    if not started.wait(10):
        raise TimeoutError("the server did not start")
    client = ssl.create_default_context(cafile=ca)
    ok, failures = 0, []
    for _ in range(count):
        try:
            url = f"https://127.0.0.1:{port[0]}/metrics"
            with urllib.request.urlopen(url, timeout=10, context=client) as answer:
                ok += answer.status == 200
        except OSError as exc:
            failures.append(str(exc))
    return {"python": sys.version.split()[0], "ok": ok, "failures": failures}


if __name__ == "__main__":
    cert, key, ca, count = sys.argv[1:5]
    print(json.dumps(main(cert, key, ca, int(count))))
