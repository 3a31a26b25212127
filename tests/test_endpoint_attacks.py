"""The agent's /metrics under attack from the network: the scraper is still answered.

A real agent process, real sockets on loopback; the attacks (tests/support/endpoint_attack.py)
run in their own process from other loopback addresses, as other hosts would. On main before
this change each of them silenced the scraper (bench/endpoint_attack.py prints the table).
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.agent_proc import AgentProcess, http_get
from tests.support.endpoint_attack import (
    FirstScrapes,
    Scrapes,
    finish_attack,
    first_scrapes,
    scrape,
    start_attack,
)
from tests.support.prometheus_server import PrometheusServer
from tests.support.waiting import wait_until

SECONDS = 4.0
CONFIG = (
    "[collectors.gpu]\nenabled = false\n[collectors.benchmark]\nenabled = false\n"
    "[collectors.kernel_log]\nenabled = false\n"
)


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    process = AgentProcess(tmp_path_factory.mktemp("endpoint"), config_text=CONFIG).start()
    try:
        yield process
    finally:
        process.stop()


@pytest.mark.parametrize(
    ("kind", "count", "sources"),
    [
        ("idle", 40, 1),
        ("slowloris", 200, 1),
        ("slowloris", 200, 50),
        ("flood", 1000, 4),
        ("pipeline", 16, 2),
        ("oversize", 16, 4),
        ("reset", 16, 4),
    ],
    ids=[
        "40-idle",
        "200-slowloris",
        "200-slowloris-50-hosts",
        "1000-concurrent-gets",
        "16-pipelines-unread",
        "16-oversize",
        "16-resetting",
    ],
)
def test_scraper_keeps_its_answers(
    agent: AgentProcess, kind: str, count: int, sources: int
) -> None:
    """A scraper polling every 0.25 s keeps >= 95% of its answers (the bench asks 99% at
    0.5 s; the margin is for a loaded test machine) while the attack runs on the same port."""
    attacker = start_attack(kind, agent.port, SECONDS + 1.5, count, sources)
    result: list[Scrapes] = []
    # The attack takes the port for a second before the scraper starts counting.
    timer = threading.Timer(1.0, lambda: result.append(scrape(agent.port, SECONDS, 0.25)))
    timer.start()
    timer.join()
    tally = finish_attack(attacker)
    assert tally.connections >= count  # the attack ran, at full strength
    scrapes = result[0]
    assert scrapes.ratio >= 0.95, (scrapes, tally)
    assert scrapes.ok + scrapes.failed >= 12  # few of them waited out their timeout
    assert agent.process is not None and agent.process.poll() is None


# The agent's command line, run under a lower limit of open files (the soft limit systemd
# gives a service is 1024; the unit raises it, a drop-in may not): exec'd, so that the pid is
# the agent's.
UNDER_LIMIT = (
    "import os, resource, sys; n = int(sys.argv[1]); "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); os.execv(sys.argv[2], sys.argv[2:])"
)


@pytest.mark.parametrize(
    ("nofile", "kind", "count", "sources"),
    [(256, "flood", 1000, 4), (48, "idle", 100, 10)],
    ids=["burst-over-256-files", "idle-over-48-files"],
)
def test_out_of_files_the_scraper_is_answered_and_the_log_is_quiet(
    tmp_path: Path, nofile: int, kind: str, count: int, sources: int
) -> None:
    """At the limit of open files (EMFILE on accept) the listener neither stops nor spins:
    the scraper keeps its answers, the agent says it once, and it serves after the attack.

    A flood's connects arrive faster than they are served: accepted all at once, they can
    take every file the agent may open, far over the 64 it keeps; and under a limit lower
    than the budget, the connections it keeps take the files themselves."""
    agent = AgentProcess(
        tmp_path,
        config_text=CONFIG,
        prefix=[sys.executable, "-c", UNDER_LIMIT, str(nofile)],
    ).start()
    try:
        attacker = start_attack(kind, agent.port, SECONDS + 1.5, count, sources)
        result: list[Scrapes] = []
        timer = threading.Timer(1.0, lambda: result.append(scrape(agent.port, SECONDS, 0.25)))
        timer.start()
        timer.join()
        tally = finish_attack(attacker)
        assert tally.connections >= count
        scrapes = result[0]
        assert scrapes.ratio >= 0.95, (scrapes, tally)
        # Few waited long (a scrape that waits out its 2 s is two of the 0.25 s polls); the
        # agent under a limit is given the margin of a loaded machine.
        assert scrapes.ok + scrapes.failed >= 8
        status, body = http_get(agent.metrics_url)
        assert status == 200
        assert agent.process is not None and agent.process.poll() is None
    finally:
        agent.stop()
    # Said once a minute at most (each failure is counted): not a line per accept tried.
    told = [line for line in agent.log().splitlines() if "Too many open files" in line]
    assert len(told) <= 3, (len(told), told[:3])
    assert 'gpuwarden_http_accept_failed_total{reason="out_of_files"}' in body


# More clients than the budget (64), each with a connection or a few that never finish a
# request: idle, or sending a header line now and then (slowloris).
CROWDS = {
    "200-idle-hosts": [("idle", 200, 200)],
    "300-slowloris-from-150-hosts": [("slowloris", 300, 150)],
    "idle-and-slowloris-from-250-hosts": [("idle", 100, 100), ("slowloris", 300, 150)],
}


@pytest.mark.parametrize("crowd", list(CROWDS))
@pytest.mark.parametrize("keeps", [False, True], ids=["reconnecting", "keeping-its-connection"])
def test_a_scraper_among_more_hosts_than_the_budget_gets_every_scrape(
    agent: AgentProcess, crowd: str, keeps: bool
) -> None:
    """Each connection of the crowd comes from a host of its own, so none is "the client
    holding the most"; the scraper's new connection, the newest waiting one, became the oldest
    after 64 more connects, before its request was read, and was evicted. Every scrape now
    gets its answer: the scraper has been answered before, and a client that has been is
    given up after every one that has not."""
    assert scrape(agent.port, 0.1).ok == 1  # the scraper is known before the crowd comes
    attackers = [
        start_attack(kind, agent.port, SECONDS + 1.5, count, sources)
        for kind, count, sources in CROWDS[crowd]
    ]
    result: list[Scrapes] = []
    timer = threading.Timer(
        1.0, lambda: result.append(scrape(agent.port, SECONDS, 0.25, timeout=5.0, keep=keeps))
    )
    timer.start()
    timer.join()
    tallies = [finish_attack(attacker) for attacker in attackers]
    assert all(
        t.connections >= count for t, (_, count, _) in zip(tallies, CROWDS[crowd], strict=True)
    )
    scrapes = result[0]
    assert scrapes.failed == 0, (scrapes, tallies)
    assert scrapes.ok >= 4
    assert agent.process is not None and agent.process.poll() is None


# Crowds of one-connection clients, from loopback addresses 127.0.0.2 and up (Prometheus is
# 127.0.0.1). The floods and the odd clients are left to the scraper of the tests above:
# here, with Prometheus and more attack processes on this machine's two shared cores, a
# scrape late by CPU time would say nothing of the server.
ALL_AT_ONCE = [("idle", 200, 200), ("slowloris", 300, 150)]
WINDOW = 12


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus (Debian) missing")
def test_a_real_prometheus_misses_no_scrape_while_attacked(
    agent: AgentProcess, tmp_path: Path
) -> None:
    """Prometheus itself (its kept connection, its Accept and Accept-Encoding headers, its
    1 s timeout) scrapes the agent every second while the attacks run: every scrape in the
    window is `up`, and has the agent's series. Its kept connection, idle between scrapes,
    used to be the oldest waiting one among a crowd of one-connection clients, and evicted,
    its next scrape reset (10 of 12 up)."""
    prometheus = PrometheusServer(
        tmp_path / "prometheus",
        "global: {scrape_interval: 1s, scrape_timeout: 1s}\nscrape_configs:\n"
        f"  - job_name: agent\n    static_configs: [{{targets: ['127.0.0.1:{agent.port}']}}]\n",
    ).start()
    try:
        wait_until(lambda: bool(prometheus.query('up{job="agent"} == 1')), 30, "a first scrape")
        attackers = [
            start_attack(kind, agent.port, WINDOW, count, sources)
            for kind, count, sources in ALL_AT_ONCE
        ]
        errors = set()  # what Prometheus says of the scrapes that failed, for the report
        deadline = time.monotonic() + WINDOW
        while time.monotonic() < deadline:
            errors |= {t["lastError"] for t in prometheus.api("targets")["activeTargets"]}
            time.sleep(0.3)
        tallies = [finish_attack(attacker, WINDOW + 30) for attacker in attackers]
        window = f"[{WINDOW}s]"
        (count,) = prometheus.query(f'count_over_time(up{{job="agent"}}{window})')
        (up,) = prometheus.query(f'sum_over_time(up{{job="agent"}}{window})')
        (series,) = prometheus.query(
            f'min_over_time(scrape_samples_scraped{{job="agent"}}{window})'
        )
    finally:
        prometheus.stop()
    scrapes, answered = float(count["value"][1]), float(up["value"][1])
    assert scrapes >= WINDOW - 3, (count, tallies)  # Prometheus scraped all along
    assert answered == scrapes, (answered, scrapes, errors - {""}, tallies)
    assert float(series["value"][1]) > 50
    assert all(t.connections > 0 for t in tallies), tallies
    assert agent.process is not None and agent.process.poll() is None


# Crowds that fill the budget before a scraper the agent has never answered comes: strangers
# from more hosts than the budget, or clients that scraped once (so are "served") and then
# hold idle connections, up to PER_CLIENT each.
NEW_SCRAPER_CROWDS = {
    "200-idle-hosts": [("idle", 200, 200)],
    "300-slowloris-from-150-hosts": [("slowloris", 300, 150)],
    "200-idle-from-25-hosts-that-scraped-once": [("trusted-idle", 200, 25)],
    "trusted-and-strangers": [("trusted-idle", 100, 20), ("slowloris", 200, 100)],
}
FIRST_SCRAPES = 20


@pytest.mark.parametrize("crowd", list(NEW_SCRAPER_CROWDS))
def test_a_new_scraper_gets_its_first_scrape_through_a_crowd(
    agent: AgentProcess, crowd: str
) -> None:
    """Each of FIRST_SCRAPES clients never answered before (a Prometheus starting during the
    attack, the second of an HA pair) gets its first scrape answered within 2 s. The
    preference for clients already answered does not help these; and a client answered once
    does not get to keep hundreds of idle connections over them."""
    third = 10 + list(NEW_SCRAPER_CROWDS).index(crowd)  # addresses no other test used
    sources = [f"127.0.{third}.{i}" for i in range(1, FIRST_SCRAPES + 1)]
    attackers = [
        start_attack(kind, agent.port, SECONDS + 1.5, count, hosts)
        for kind, count, hosts in NEW_SCRAPER_CROWDS[crowd]
    ]
    result: list[FirstScrapes] = []
    timer = threading.Timer(1.0, lambda: result.append(first_scrapes(agent.port, sources)))
    timer.start()
    timer.join()
    tallies = [finish_attack(attacker) for attacker in attackers]
    assert all(
        t.connections >= count
        for t, (_, count, _) in zip(tallies, NEW_SCRAPER_CROWDS[crowd], strict=True)
    )
    firsts = result[0]
    assert firsts.failed == 0, (firsts, tallies)
    assert agent.process is not None and agent.process.poll() is None
