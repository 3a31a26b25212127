"""The watcher's state machine, driven by a hand-held clock: no broker, no sleeping."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.contracts.model import Severity
from agent.program.watch.fleet import SETTLE_SECONDS, AlertChange, Fleet, State

P = "gpuwarden/v1"
T0 = 1_700_000_000.0


def status(
    fleet: Fleet,
    node: str,
    state: str,
    bdseq: int,
    now: float,
    *,
    retained: bool = False,
    reason: str | None = None,
    ts: float | None = None,
) -> bool:
    body: dict[str, object] = {"state": state, "bdseq": bdseq, "ts": ts or now, "version": "0.1"}
    if reason:
        body["reason"] = reason
    return fleet.ingest(f"{P}/{node}/status", json.dumps(body).encode(), retained, now)


def beat(
    fleet: Fleet,
    node: str,
    now: float,
    *,
    interval: float = 10.0,
    seq: int = 1,
    retained: bool = False,
    ts: float | None = None,
    health: object = "ok",
) -> bool:
    body = {"seq": seq, "ts": ts or now, "interval_s": interval, "health": health}
    return fleet.ingest(f"{P}/{node}/heartbeat", json.dumps(body).encode(), retained, now)


def connected_fleet(**kwargs: object) -> Fleet:
    fleet = Fleet(now=T0, **kwargs)  # type: ignore[arg-type]
    fleet.broker_connected(T0 - SETTLE_SECONDS)  # settled by T0
    return fleet


def raised(changes: list[AlertChange]) -> set[tuple[str, str]]:
    return {c.alert.key for c in changes if c.raised}


def cleared(changes: list[AlertChange]) -> set[tuple[str, str]]:
    return {c.alert.key for c in changes if not c.raised}


class TestStale:
    """Stale: online, heartbeat older than k × the node's own interval."""

    def test_fresh_then_stale_then_clears(self) -> None:
        fleet = connected_fleet()
        status(fleet, "a", "online", 1, T0)
        beat(fleet, "a", T0, interval=10.0)
        assert fleet.evaluate(T0 + 29.0) == []
        node = fleet.nodes["a"]
        assert fleet.state_of(node, T0 + 29.0) is State.ONLINE
        assert raised(fleet.evaluate(T0 + 31.0)) == {("node_stale", "a")}
        assert fleet.active[("node_stale", "a")].severity is Severity.CRITICAL
        assert fleet.evaluate(T0 + 32.0) == []  # raised once, not at every evaluation
        beat(fleet, "a", T0 + 33.0, interval=10.0, seq=2)
        assert cleared(fleet.evaluate(T0 + 33.0)) == {("node_stale", "a")}

    def test_uses_the_nodes_own_interval(self) -> None:
        fleet = connected_fleet(default_interval=1.0)
        status(fleet, "slow", "online", 1, T0)
        beat(fleet, "slow", T0, interval=60.0)
        assert fleet.evaluate(T0 + 170.0) == []
        assert raised(fleet.evaluate(T0 + 181.0)) == {("node_stale", "slow")}

    def test_online_without_heartbeat_uses_default_interval_from_birth(self) -> None:
        fleet = connected_fleet(default_interval=5.0)
        status(fleet, "a", "online", 1, T0)
        assert fleet.evaluate(T0 + 14.0) == []
        assert raised(fleet.evaluate(T0 + 16.0)) == {("node_stale", "a")}

    def test_retained_heartbeat_from_a_clock_behind_is_not_stale(self) -> None:
        fleet = Fleet(now=T0)  # the watcher restarts; the node's clock is an hour behind
        fleet.broker_connected(T0)
        status(fleet, "a", "online", 1, T0, retained=True, ts=T0 - 7200)
        beat(fleet, "a", T0, retained=True, ts=T0 - 3600, interval=10.0)
        assert fleet.evaluate(T0 + SETTLE_SECONDS) == []
        beat(fleet, "a", T0 + 9, ts=T0 - 3591, seq=2, interval=10.0)
        assert fleet.evaluate(T0 + 35) == []
        assert fleet.state_of(fleet.nodes["a"], T0 + 35) is State.ONLINE

    def test_retained_heartbeat_of_a_silent_node_goes_stale_on_our_clock(self) -> None:
        fleet = Fleet(now=T0)  # the node hung a day ago, while the watcher was down
        fleet.broker_connected(T0)
        status(fleet, "a", "online", 1, T0, retained=True, ts=T0 - 86400)
        beat(fleet, "a", T0, retained=True, ts=T0 - 86400, interval=10.0)
        assert fleet.evaluate(T0 + 29) == []
        assert raised(fleet.evaluate(T0 + 31)) == {("node_stale", "a")}

    def test_retained_copy_of_a_held_heartbeat_does_not_refresh_it(self) -> None:
        fleet = connected_fleet()
        status(fleet, "a", "online", 1, T0)
        beat(fleet, "a", T0, seq=5, interval=10.0)
        assert raised(fleet.evaluate(T0 + 31)) == {("node_stale", "a")}
        fleet.broker_disconnected(T0 + 40)
        fleet.broker_connected(T0 + 41)  # resubscribed: the broker sends the same beat again
        beat(fleet, "a", T0 + 41, retained=True, ts=T0, seq=5, interval=10.0)
        beat(fleet, "a", T0 + 42, retained=True, ts=T0 - 10, seq=4, interval=10.0)  # older
        assert fleet.evaluate(T0 + 41 + SETTLE_SECONDS) == []
        assert fleet.nodes["a"].seq == 5

    def test_live_heartbeat_is_as_young_as_its_arrival(self) -> None:
        fleet = connected_fleet()
        status(fleet, "a", "online", 1, T0 + 100, ts=T0)
        beat(fleet, "a", T0 + 100, ts=T0, interval=10.0)
        assert fleet.state_of(fleet.nodes["a"], T0 + 100) is State.ONLINE

    def test_retained_from_the_future_is_not_younger_than_now(self) -> None:
        fleet = connected_fleet()
        beat(fleet, "a", T0, retained=True, ts=T0 + 3600, interval=10.0)
        assert fleet.nodes["a"].heartbeat_at == T0


class TestDead:
    """Dead: a Will with the current birth number; old Wills are ignored."""

    def test_will_with_current_bdseq(self) -> None:
        fleet = connected_fleet()
        status(fleet, "a", "online", 4, T0)
        status(fleet, "a", "offline", 4, T0 + 5)
        changes = fleet.evaluate(T0 + 5)
        assert raised(changes) == {("node_dead", "a")}
        assert fleet.active[("node_dead", "a")].severity is Severity.CRITICAL
        status(fleet, "a", "online", 5, T0 + 9)
        beat(fleet, "a", T0 + 9)
        assert cleared(fleet.evaluate(T0 + 9)) == {("node_dead", "a")}

    def test_old_will_after_rebirth_is_ignored(self) -> None:
        fleet = connected_fleet()
        status(fleet, "a", "online", 5, T0)
        beat(fleet, "a", T0)
        assert not status(fleet, "a", "offline", 4, T0 + 1)
        assert fleet.state_of(fleet.nodes["a"], T0 + 1) is State.ONLINE
        assert fleet.evaluate(T0 + 1) == []
        assert fleet.counters.ignored_old_births == 1

    def test_offline_seen_first_counts(self) -> None:
        fleet = connected_fleet()
        status(fleet, "a", "offline", 2, T0, retained=True)
        assert raised(fleet.evaluate(T0)) == {("node_dead", "a")}

    def test_heartbeat_does_not_revive_a_dead_node(self) -> None:
        fleet = connected_fleet()
        status(fleet, "a", "online", 1, T0)
        status(fleet, "a", "offline", 1, T0 + 1)
        beat(fleet, "a", T0 + 2, retained=True, ts=T0)
        assert fleet.state_of(fleet.nodes["a"], T0 + 2) is State.DEAD


class TestStopped:
    """A clean stop (reason shutdown) is a warning, not a page."""

    def test_clean_stop_is_a_warning(self) -> None:
        fleet = connected_fleet()
        status(fleet, "a", "online", 1, T0)
        status(fleet, "a", "offline", 1, T0 + 1, reason="shutdown")
        assert raised(fleet.evaluate(T0 + 1)) == {("node_stopped", "a")}
        assert fleet.active[("node_stopped", "a")].severity is Severity.WARNING

    def test_retained_status_removed_forgets_the_node(self) -> None:
        fleet = connected_fleet()
        status(fleet, "a", "offline", 1, T0, reason="shutdown")
        fleet.evaluate(T0)
        fleet.ingest(f"{P}/a/status", b"", True, T0 + 1)
        assert "a" not in fleet.nodes
        assert cleared(fleet.evaluate(T0 + 1)) == {("node_stopped", "a")}


class TestMissing:
    """Missing: in the inventory and never seen."""

    def test_inventory_node_never_seen(self) -> None:
        fleet = connected_fleet(inventory=["a", "b"])
        status(fleet, "a", "online", 1, T0)
        beat(fleet, "a", T0)
        changes = fleet.evaluate(T0 + SETTLE_SECONDS)
        assert raised(changes) == {("node_missing", "b")}
        status(fleet, "b", "online", 1, T0 + 4)
        assert cleared(fleet.evaluate(T0 + 4)) == {("node_missing", "b")}

    def test_forgotten_inventory_node_is_missing_again(self) -> None:
        fleet = connected_fleet(inventory=["a"])
        status(fleet, "a", "online", 1, T0)
        fleet.ingest(f"{P}/a/status", b"", True, T0 + 1)
        assert fleet.state_of(fleet.nodes["a"], T0 + 4) is State.MISSING


class TestUnhealthy:
    """A heartbeat that reports problems is a warning naming them."""

    def test_problems_in_heartbeat(self) -> None:
        fleet = connected_fleet()
        status(fleet, "a", "online", 1, T0)
        beat(fleet, "a", T0, health=["collector gpu stale"])
        changes = fleet.evaluate(T0 + 4)
        assert raised(changes) == {("node_unhealthy", "a")}
        assert "collector gpu stale" in fleet.active[("node_unhealthy", "a")].message
        beat(fleet, "a", T0 + 5, seq=2, health="ok")
        assert cleared(fleet.evaluate(T0 + 5)) == {("node_unhealthy", "a")}


class TestBroker:
    """No broker: one broker alert after a grace, node alerts frozen, not multiplied."""

    def test_broker_alert_after_grace_and_node_alerts_frozen(self) -> None:
        fleet = connected_fleet(broker_grace=10.0)
        for name in ("a", "b", "c"):
            status(fleet, name, "online", 1, T0)
            beat(fleet, name, T0)
        assert fleet.evaluate(T0 + 5) == []
        fleet.broker_disconnected(T0 + 6)
        assert fleet.evaluate(T0 + 15) == []
        changes = fleet.evaluate(T0 + 100)  # every heartbeat is old now, yet no node alert
        assert raised(changes) == {("broker_unreachable", "")}
        fleet.broker_connected(T0 + 101)
        for name in ("a", "b", "c"):  # retained heartbeats, published while we were away
            beat(fleet, name, T0 + 101, retained=True, ts=T0 + 99, seq=9)
        # Back, and every node heard again: the outage is over once the watcher has settled.
        assert fleet.evaluate(T0 + 101) == []
        assert cleared(fleet.evaluate(T0 + 101 + SETTLE_SECONDS)) == {("broker_unreachable", "")}

    def test_never_connected(self) -> None:
        fleet = Fleet(now=T0, broker_grace=10.0)
        assert fleet.evaluate(T0 + 9) == []
        assert raised(fleet.evaluate(T0 + 11)) == {("broker_unreachable", "")}

    def test_short_blip_raises_nothing(self) -> None:
        fleet = connected_fleet(broker_grace=10.0)
        fleet.broker_disconnected(T0 + 1)
        fleet.broker_connected(T0 + 3)
        assert fleet.evaluate(T0 + 5) == []


class TestFleetQuiet:
    """Every node silent at once: one fleet alert instead of N node alerts."""

    def test_all_silent_together(self) -> None:
        fleet = connected_fleet(quiet_window=30.0)
        names = [f"n{i}" for i in range(20)]
        for i, name in enumerate(names):
            status(fleet, name, "online", 1, T0)
            beat(fleet, name, T0 + i * 0.5)  # staggered within one interval
        changes = fleet.evaluate(T0 + 31)
        assert raised(changes) == {("fleet_quiet", "")}
        assert not any(k[0] == "node_stale" for k in fleet.active)
        for i, name in enumerate(names):
            beat(fleet, name, T0 + 40 + i * 0.01, seq=2)
        assert cleared(fleet.evaluate(T0 + 41)) == {("fleet_quiet", "")}

    def test_recovery_one_by_one_raises_no_node_alerts(self) -> None:
        fleet = connected_fleet(quiet_window=30.0)
        for name in ("a", "b", "c"):
            status(fleet, name, "online", 1, T0)
            beat(fleet, name, T0, interval=10.0)
        assert raised(fleet.evaluate(T0 + 31)) == {("fleet_quiet", "")}
        beat(fleet, "a", T0 + 40, seq=2, interval=10.0)  # the first one back
        changes = fleet.evaluate(T0 + 40)
        assert cleared(changes) == {("fleet_quiet", "")}
        assert raised(changes) == set()
        beat(fleet, "b", T0 + 45, seq=2, interval=10.0)
        assert fleet.evaluate(T0 + 45) == []
        for t in (50, 60, 69):
            beat(fleet, "a", T0 + t, seq=t, interval=10.0)
            beat(fleet, "b", T0 + t, seq=t, interval=10.0)
            assert fleet.evaluate(T0 + t) == []
        # c never comes back: after one more stale period it is hung on its own
        assert raised(fleet.evaluate(T0 + 71)) == {("node_stale", "c")}

    def test_wills_for_everyone_at_once(self) -> None:
        fleet = connected_fleet()
        for name in ("a", "b", "c"):
            status(fleet, name, "online", 1, T0)
            beat(fleet, name, T0)
        for name in ("a", "b", "c"):
            status(fleet, name, "offline", 1, T0 + 20)
        assert raised(fleet.evaluate(T0 + 20)) == {("fleet_quiet", "")}

    def test_one_hung_node_among_talking_ones(self) -> None:
        fleet = connected_fleet()
        for name in ("a", "b", "c"):
            status(fleet, name, "online", 1, T0)
            beat(fleet, name, T0)
        for t in range(10, 41, 10):
            beat(fleet, "b", T0 + t, seq=t)
            beat(fleet, "c", T0 + t, seq=t)
        assert raised(fleet.evaluate(T0 + 41)) == {("node_stale", "a")}

    def test_long_dead_node_keeps_its_own_alert(self) -> None:
        fleet = connected_fleet(quiet_window=30.0)
        status(fleet, "old", "offline", 1, T0 - 86400, retained=True, ts=T0 - 86400)
        for name in ("a", "b"):
            status(fleet, name, "online", 1, T0)
            beat(fleet, name, T0)
        assert raised(fleet.evaluate(T0 + 31)) == {("fleet_quiet", ""), ("node_dead", "old")}

    def test_one_node_is_not_a_fleet(self) -> None:
        fleet = connected_fleet()
        status(fleet, "a", "online", 1, T0)
        beat(fleet, "a", T0)
        assert raised(fleet.evaluate(T0 + 31)) == {("node_stale", "a")}


class TestHostileInput:
    """Malformed messages are counted by reason and change nothing."""

    def test_counted_and_skipped(self) -> None:
        fleet = connected_fleet()
        assert not fleet.ingest(f"{P}/a/status", b"{", False, T0)
        assert not fleet.ingest(f"{P}/a b/status", b"{}", False, T0)
        assert not fleet.ingest(f"{P}/a/heartbeat", b'{"seq":1,"ts":NaN,"interval_s":1}', False, T0)
        assert not fleet.ingest(f"{P}/a/heartbeat", b"x" * 70000, False, T0)
        assert fleet.counters.malformed == {
            "not_json": 1,
            "bad_node_id": 1,
            "bad_field": 1,
            "too_large": 1,
        }
        assert fleet.nodes == {}

    def test_node_cap(self) -> None:
        fleet = connected_fleet(max_nodes=2)
        for name in ("a", "b", "c"):
            beat(fleet, name, T0)
        assert sorted(fleet.nodes) == ["a", "b"]
        assert fleet.counters.ignored == {"node_limit": 1}

    @settings(max_examples=200)
    @given(
        st.lists(
            st.tuples(
                st.sampled_from(["status", "heartbeat", "x"]),
                st.sampled_from(["a", "b", "_w", "a/b"]),
                st.binary(max_size=80)
                | st.sampled_from(
                    [
                        b'{"state":"online","bdseq":1}',
                        b'{"state":"offline","bdseq":0}',
                        b'{"seq":1,"ts":1700000000,"interval_s":0.5}',
                    ]
                ),
                st.booleans(),
                st.floats(0, 1000),
            ),
            max_size=30,
        )
    )
    def test_any_sequence_never_crashes(
        self, msgs: list[tuple[str, str, bytes, bool, float]]
    ) -> None:
        fleet = connected_fleet()
        now = T0
        for kind, node, payload, retained, step in msgs:
            now += step
            fleet.ingest(f"{P}/{node}/{kind}", payload, retained, now)
            fleet.evaluate(now)
        assert set(fleet.nodes) <= {"a", "b"}
        assert all(v.state in State for v in fleet.views(now))


class TestBirthOrder:
    """A birth that goes back (replay, forgery) is ignored and counted; the node lives on."""

    @given(st.integers(0, 9), st.integers(1, 10))
    def test_older_births_change_nothing(self, low: int, gap: int) -> None:
        fleet = connected_fleet()
        status(fleet, "a", "online", low + gap, T0)
        beat(fleet, "a", T0)
        assert not status(fleet, "a", "online", low, T0 + 1)
        assert not status(fleet, "a", "offline", low, T0 + 1)
        assert fleet.nodes["a"].bdseq == low + gap
        assert fleet.state_of(fleet.nodes["a"], T0 + 1) is State.ONLINE
        assert fleet.counters.ignored == {"old_birth": 1}
        assert fleet.counters.ignored_old_births == 1

    def test_a_birth_repeated_after_its_will_is_not_a_revival(self) -> None:
        fleet = connected_fleet()
        status(fleet, "a", "online", 3, T0)
        status(fleet, "a", "offline", 3, T0 + 1)
        assert not status(fleet, "a", "online", 3, T0 + 2)
        assert fleet.state_of(fleet.nodes["a"], T0 + 2) is State.DEAD
        assert status(fleet, "a", "online", 4, T0 + 3)  # the next connection is believed


class TestForgetting:
    """Nodes nothing says exist any more are forgotten, not paged for."""

    def test_heartbeat_only_nodes_never_alert_and_expire(self) -> None:
        fleet = connected_fleet(default_interval=10.0)
        beat(fleet, "ghost", T0, retained=True, interval=86400.0, health=["disk full"])
        assert fleet.evaluate(T0 + 29) == []
        assert "ghost" in fleet.nodes
        assert fleet.evaluate(T0 + 31) == []  # k x min(its interval, the default): gone
        assert "ghost" not in fleet.nodes
        assert fleet.counters.forgotten == {"heartbeat_only": 1}

    def test_a_status_makes_a_heartbeat_only_node_real(self) -> None:
        fleet = connected_fleet(default_interval=10.0)
        beat(fleet, "a", T0)
        status(fleet, "a", "online", 1, T0 + 1)
        assert raised(fleet.evaluate(T0 + 35)) == {("node_stale", "a")}

    def test_offline_and_silent_for_the_limit(self) -> None:
        for inventory in ([], ["a"]):
            fleet = connected_fleet(forget_offline_after=100.0, inventory=inventory)
            status(fleet, "a", "online", 1, T0)
            status(fleet, "a", "offline", 1, T0 + 1)
            assert raised(fleet.evaluate(T0 + 2)) == {("node_dead", "a")}
            assert fleet.evaluate(T0 + 100) == []
            if inventory:  # the inventory's nodes are never forgotten
                assert fleet.evaluate(T0 + 101) == []
            else:
                assert cleared(fleet.evaluate(T0 + 101)) == {("node_dead", "a")}
                assert fleet.nodes == {}


class TestJunk:
    """Invented ids cannot page, and cannot keep a real node out of a full table."""

    def test_inventory_outsiders_are_counted_only(self) -> None:
        fleet = connected_fleet(inventory=["a"])
        for i in range(50):
            status(fleet, f"junk{i}", "offline", 1, T0)
            beat(fleet, f"junk{i}", T0)
        assert set(fleet.nodes) == {"a"}
        assert fleet.counters.ignored == {"outside_inventory": 100}

    def test_a_birth_pushes_out_the_least_believable(self) -> None:
        fleet = connected_fleet(max_nodes=4)
        status(fleet, "real", "online", 1, T0)
        beat(fleet, "real", T0)
        status(fleet, "unbeaten", "online", 1, T0)
        status(fleet, "gone", "offline", 1, T0)
        beat(fleet, "ghost", T0)
        for name, evicted in (("n1", "ghost"), ("n2", "gone"), ("n3", "unbeaten")):
            assert status(fleet, name, "online", 1, T0 + 1)
            beat(fleet, name, T0 + 1)
            assert evicted not in fleet.nodes
        assert not status(fleet, "n4", "online", 1, T0 + 2)  # all born and beating: full
        assert set(fleet.nodes) == {"real", "n1", "n2", "n3"}
        assert fleet.counters.ignored == {"node_limit": 1}
        assert fleet.counters.forgotten == {"evicted": 3}


class TestOutageAftermath:
    """A broker outage and its aftermath are one alert."""

    def fleet_of_three(self) -> Fleet:
        fleet = connected_fleet(broker_grace=1.0, reconnect_grace=60.0)
        for name in ("a", "b", "c"):
            status(fleet, name, "online", 1, T0)
            beat(fleet, name, T0, interval=1.0)
        return fleet

    def test_nodes_slower_than_the_watcher_are_not_stale(self) -> None:
        fleet = self.fleet_of_three()
        fleet.broker_disconnected(T0 + 1)
        assert raised(fleet.evaluate(T0 + 3)) == {("broker_unreachable", "")}
        fleet.broker_connected(T0 + 30)
        for t in (31, 35, 40):
            assert fleet.evaluate(T0 + t) == []  # no fleet_quiet, no node_stale
        beat(fleet, "a", T0 + 41, seq=2, interval=1.0)
        beat(fleet, "b", T0 + 42, seq=2, interval=1.0)
        assert fleet.evaluate(T0 + 42) == []  # c is not back yet: the outage goes on
        beat(fleet, "c", T0 + 43, seq=2, interval=1.0)
        assert cleared(fleet.evaluate(T0 + 43)) == {("broker_unreachable", "")}

    def test_a_node_that_never_comes_back_is_alerted_after_the_grace(self) -> None:
        fleet = self.fleet_of_three()
        fleet.broker_disconnected(T0 + 1)
        fleet.evaluate(T0 + 3)
        fleet.broker_connected(T0 + 30)
        for t in range(31, 90):
            beat(fleet, "a", T0 + t, seq=t, interval=1.0)
            beat(fleet, "b", T0 + t, seq=t, interval=1.0)
            fleet.evaluate(T0 + t)
        changes = fleet.evaluate(T0 + 90.5)
        assert ("node_stale", "c") in raised(changes)

    def test_wills_sent_as_the_broker_goes_away_wait_for_the_reconnection(self) -> None:
        fleet = self.fleet_of_three()
        for name in ("a", "b", "c"):  # mosquitto publishes every Will as it shuts down
            status(fleet, name, "offline", 1, T0 + 1)
        fleet.broker_disconnected(T0 + 1.01)
        fleet.evaluate(T0 + 3)
        fleet.broker_connected(T0 + 30)
        assert fleet.evaluate(T0 + 35) == []
        for name in ("a", "b", "c"):
            status(fleet, name, "online", 2, T0 + 36)
            beat(fleet, name, T0 + 36, seq=2, interval=1.0)
        assert cleared(fleet.evaluate(T0 + 36)) == {("broker_unreachable", "")}
        assert not any(c.raised for c in fleet.evaluate(T0 + 37))

    def test_delivery_problems_disproved_by_the_heartbeat_itself(self) -> None:
        fleet = connected_fleet()
        status(fleet, "a", "online", 1, T0)
        stale_sink = "sink mqtt has not delivered for 40 s (connection_lost)"
        beat(fleet, "a", T0, health=[stale_sink])
        assert fleet.evaluate(T0 + 1) == []
        beat(fleet, "a", T0 + 2, seq=2, health=[stale_sink, "collector gpu stale for 60 s"])
        changes = fleet.evaluate(T0 + 2)
        assert raised(changes) == {("node_unhealthy", "a")}
        assert "mqtt" not in fleet.active[("node_unhealthy", "a")].message
