"""Parsing of status and heartbeat payloads and topics: hostile input is a reason, not a crash."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.contracts.config import NODE_ID
from agent.program.watch import payloads
from agent.program.watch.payloads import Heartbeat, Malformed, Status, Topic

PREFIX = "gpuwarden/v1"

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


class TestTopic:
    """Topics name a node and a kind under the prefix; odd node ids are refused."""

    def test_status_and_heartbeat(self) -> None:
        assert payloads.parse_topic(f"{PREFIX}/gpu-17/status", PREFIX) == Topic("gpu-17", "status")
        assert payloads.parse_topic(f"{PREFIX}/a.b_c:1/heartbeat", PREFIX) == Topic(
            "a.b_c:1", "heartbeat"
        )

    def test_refusals(self) -> None:
        cases = {
            "other/v1/n/status": "bad_topic",
            f"{PREFIX}/n/events": "bad_topic",
            f"{PREFIX}/n/status/extra": "bad_topic",
            f"{PREFIX}/n\u00e9/status": "bad_node_id",
            f"{PREFIX}/{'x' * 129}/status": "bad_node_id",
            f"{PREFIX}/a b/status": "bad_node_id",
        }
        for topic, reason in cases.items():
            result = payloads.parse_topic(topic, PREFIX)
            assert isinstance(result, Malformed), topic
            assert result.reason == reason, topic

    def test_reserved_levels_are_not_nodes(self) -> None:
        assert payloads.parse_topic(f"{PREFIX}/_watch/status", PREFIX) is None

    @given(st.text(max_size=200))
    def test_any_topic_is_parsed_or_refused(self, text: str) -> None:
        result = payloads.parse_topic(text, PREFIX)
        assert result is None or isinstance(result, (Topic, Malformed))
        if isinstance(result, Topic):
            assert NODE_ID.fullmatch(result.node)


class TestStatus:
    """Status: online/offline with a birth number; a clean stop is told apart by `reason`."""

    def test_online(self) -> None:
        got = payloads.parse_status(
            b'{"state":"online","bdseq":3,"ts":1700000000.5,"version":"0.1"}'
        )
        assert got == Status(True, 3, 1700000000.5, "0.1", False)

    def test_will_and_clean_stop(self) -> None:
        will = payloads.parse_status(b'{"state":"offline","bdseq":3,"ts":1.0}')
        clean = payloads.parse_status(b'{"state":"offline","bdseq":3,"reason":"shutdown"}')
        assert isinstance(will, Status)
        assert not will.clean_stop
        assert isinstance(clean, Status)
        assert clean.clean_stop

    def test_hostile(self) -> None:
        cases = {
            b"not json": "not_json",
            b"\xff\xfe": "not_utf8",
            b"[1,2]": "not_object",
            b'{"state":"online","bdseq":true}': "bad_field",
            b'{"state":"online","bdseq":-1}': "bad_field",
            b'{"state":"online","bdseq":1e400}': "bad_field",
            b'{"state":"online","bdseq":' + b"9" * 30 + b"}": "bad_field",
            b'{"state":"online","bdseq":' + b"9" * 5000 + b"}": "not_json",
            b'{"state":"online","bdseq":1,"ts":NaN}': "bad_field",
            b'{"state":"online","bdseq":1,"ts":Infinity}': "bad_field",
            b'{"state":"sleeping","bdseq":1}': "bad_field",
            b"[" * 60_000: "not_json",
            b'{"state":"online","bdseq":1,"version":"' + b"x" * 1_000_000 + b'"}': "too_large",
        }
        for payload, reason in cases.items():
            result = payloads.parse_status(payload)
            assert isinstance(result, Malformed), payload[:40]
            assert result.reason == reason, payload[:40]

    def test_deep_nesting_within_the_limit(self) -> None:
        deep = b'{"state":"online","bdseq":1,"x":' + b"[" * 60000 + b"]" * 60000 + b"}"
        result = payloads.parse_status(deep, limit=1 << 20)
        assert isinstance(result, Malformed)
        assert result.reason == "not_json"

    @settings(max_examples=300)
    @given(
        st.dictionaries(st.sampled_from(["state", "bdseq", "ts", "version", "reason"]), json_values)
    )
    def test_any_object_is_parsed_or_refused(self, data: dict[str, object]) -> None:
        result = payloads.parse_status(json.dumps(data).encode())
        assert isinstance(result, (Status, Malformed))
        if isinstance(result, Status):
            assert isinstance(result.bdseq, int)
            assert 0 <= result.bdseq <= payloads.MAX_SEQ

    @given(st.binary(max_size=300))
    def test_any_bytes(self, raw: bytes) -> None:
        assert isinstance(payloads.parse_status(raw), (Status, Malformed))


VALID_STATUS = '{"state":"offline","bdseq":7,"ts":1700000000}'
VALID_BEAT = '{"seq":1,"ts":1700000000,"interval_s":15,"health":"ok"}'
OTHER_SPELLINGS = ("utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le")


class TestStrictJson:
    """One spelling of a payload: UTF-8 JSON objects, no BOM, no key given twice. Each
    case is a valid document in a spelling json.loads(bytes) would also have accepted."""

    def test_utf8_is_accepted(self) -> None:
        assert isinstance(payloads.parse_status(VALID_STATUS.encode()), Status)
        assert isinstance(payloads.parse_heartbeat(VALID_BEAT.encode()), Heartbeat)

    def test_other_encodings_and_a_bom_are_refused(self) -> None:
        for encoding in OTHER_SPELLINGS:
            for parse, text in (
                (payloads.parse_status, VALID_STATUS),
                (payloads.parse_heartbeat, VALID_BEAT),
            ):
                raw = text.encode(encoding)
                assert isinstance(json.loads(raw), dict), encoding  # lenient json took it
                result = parse(raw)
                assert isinstance(result, Malformed), encoding
                assert result.reason == "not_utf8", encoding

    @given(st.sampled_from(["state", "bdseq", "ts", "version", "reason"]), json_values)
    def test_a_key_given_twice_is_refused(self, key: str, value: object) -> None:
        doc = VALID_STATUS[:-1] + f',"{key}":{json.dumps(value)}}}'
        if key not in json.loads(VALID_STATUS):
            doc = doc[:-1] + f',"{key}":{json.dumps(value)}}}'
        result = payloads.parse_status(doc.encode())
        assert isinstance(result, Malformed)
        assert result.reason == "duplicate_key"

    def test_a_nested_key_given_twice_is_refused(self) -> None:
        doc = b'{"seq":1,"ts":1.0,"interval_s":1,"health":{"ok":true,"ok":false}}'
        result = payloads.parse_heartbeat(doc)
        assert isinstance(result, Malformed)
        assert result.reason == "duplicate_key"


class TestHeartbeat:
    """Heartbeat: seq, ts and the node's own interval; health in several spellings."""

    def test_fields(self) -> None:
        got = payloads.parse_heartbeat(b'{"seq":5,"ts":1700000000,"interval_s":15,"health":"ok"}')
        assert got == Heartbeat(5, 1700000000.0, 15.0, True, ())

    def test_health_problems(self) -> None:
        got = payloads.parse_heartbeat(
            b'{"seq":5,"ts":1.5,"interval_s":1,"health":["collector gpu stale","sink mqtt"]}'
        )
        assert isinstance(got, Heartbeat)
        assert got.health_ok is False
        assert got.problems == ("collector gpu stale", "sink mqtt")
        nested = payloads.parse_heartbeat(
            b'{"seq":5,"ts":1.5,"interval_s":1,"health":{"ok":false,"problems":["x"]}}'
        )
        assert isinstance(nested, Heartbeat)
        assert nested.health_ok is False

    def test_bad_interval(self) -> None:
        for value in (b"0", b"-1", b"1e9", b'"15"', b"NaN", b"true"):
            result = payloads.parse_heartbeat(b'{"seq":1,"ts":1.0,"interval_s":' + value + b"}")
            assert isinstance(result, Malformed), value
            assert result.reason == "bad_field", value

    @settings(max_examples=300)
    @given(st.dictionaries(st.sampled_from(["seq", "ts", "interval_s", "health"]), json_values))
    def test_any_object_is_parsed_or_refused(self, data: dict[str, object]) -> None:
        result = payloads.parse_heartbeat(json.dumps(data).encode())
        assert isinstance(result, (Heartbeat, Malformed))
        if isinstance(result, Heartbeat):
            assert 0 < result.interval_s <= payloads.MAX_INTERVAL
