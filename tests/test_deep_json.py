"""JSON nested deeper than the parser can follow is malformed input like any other.

`json.loads` raises RecursionError (not a ValueError) past about a thousand levels, so every
reader that reported bad JSON by catching the parser's errors let it escape instead: out of
the checkpoint reader (which says `Unreadable` of a bad checkpoint, and of nothing else), out
of the diagnostic bundle's redactor, and out of the control socket's handler, which dropped
the connection of a 4 KiB request of `[` without a reply. Each reader here is given arrays
and objects nested 100 000 deep."""

from __future__ import annotations

import asyncio
import json
import re
import struct
from pathlib import Path

import pytest

from agent.contracts.json_text import JsonTooDeep, decode_json_at, parse_json
from agent.program.control_client import socket_path
from agent.program.diagnose.redact import Redactor
from collectors.checkpoints.detect import Candidate, verify_structure
from collectors.checkpoints.formats import Unreadable
from tests.support.control import controlled_runtime

DEPTH = 100_000


def deep_array() -> str:
    return "[" * DEPTH + "]" * DEPTH


def deep_object(inner: str = '"the prompt text"') -> str:
    return '{"messages": ' + '{"a": ' * DEPTH + inner + "}" * DEPTH + "}"


SHAPES = {"array": deep_array, "object": deep_object}


@pytest.fixture(params=sorted(SHAPES))
def deep(request: pytest.FixtureRequest) -> str:
    return SHAPES[request.param]()


def test_the_parser_says_malformed(deep: str) -> None:
    with pytest.raises(JsonTooDeep) as raised:
        parse_json(deep)
    assert isinstance(raised.value, json.JSONDecodeError)  # what readers catch already
    with pytest.raises(JsonTooDeep):
        parse_json(deep.encode())
    with pytest.raises(JsonTooDeep):
        decode_json_at("x " + deep, 2)
    assert parse_json('{"a": [1, 2]}') == {"a": [1, 2]}
    assert decode_json_at('x {"a": 1} y', 2) == ({"a": 1}, 10)


def test_a_checkpoint_with_such_a_header_is_unreadable(tmp_path: Path, deep: str) -> None:
    body = deep.encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(body)) + body)
    with pytest.raises(Unreadable, match=re.escape("model.safetensors: the header is not JSON")):
        verify_structure(Candidate(path, "safetensors", False))


@pytest.mark.parametrize("name", ["model.safetensors.index.json", "trainer_state.json"])
def test_a_checkpoint_directory_with_such_a_json_file_is_unreadable(
    tmp_path: Path, deep: str, name: str
) -> None:
    directory = tmp_path / "checkpoint-100"
    directory.mkdir()
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (directory / "model.safetensors").write_bytes(
        struct.pack("<Q", len(header)) + header + b"\0" * 4
    )
    (directory / name).write_text(deep)
    with pytest.raises(Unreadable, match=re.escape(f"{name}: not valid JSON")):
        verify_structure(Candidate(directory, "hf", False))


def test_redaction_leaves_out_what_it_cannot_read_into() -> None:
    """A whole file of such JSON, and one such line among log lines: no exception, and the
    text the redactor could not look into is not passed on."""
    text, counts = Redactor().redact(deep_object() + "\n")
    assert "the prompt text" not in text
    assert text.startswith("[REDACTED:deep_json:") and text.endswith("]\n")
    assert counts["deep_json"] == 1
    log = f"step 10 loss 1.25\nrequest {deep_object()} done\nstep 11 loss 1.24\n"
    text, counts = Redactor().redact(log)
    assert "the prompt text" not in text
    lines = text.splitlines()
    assert lines[0] == "step 10 loss 1.25" and lines[2] == "step 11 loss 1.24"
    assert lines[1].startswith("request [REDACTED:deep_json:")
    assert counts["deep_json"] == 1
    again, more = Redactor().redact(text)  # the marker is stable: a second pass keeps it
    assert again == text and more["deep_json"] == 0


async def test_a_control_request_of_it_is_answered(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    async with controlled_runtime(state_dir):
        reader, writer = await asyncio.open_unix_connection(str(socket_path(state_dir)))
        writer.write(b"[" * 3000 + b"\n")  # within the 4 KiB a request may be
        await writer.drain()
        reply = json.loads(await asyncio.wait_for(reader.readline(), 10))
        writer.close()
        assert reply.get("ok") is not True
        assert "JSON" in json.dumps(reply)
