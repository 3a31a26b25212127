"""Does a checkpoint's structure read? Header and directory reads only, never tensor data.

Each reader raises `Unreadable` naming the file and what does not fit. The daemon never imports
torch (the layer rule in pyproject.toml), so a PyTorch file is judged as the zip it is: its
central directory (zipfile reads only that and, here, each member's 30-byte local header), the
storages its `data.pkl` names (found by walking the pickle's opcodes with `pickletools`, which
executes nothing) and each storage record's size against its element count. A distributed
checkpoint's `.metadata` is a pickle too: the shard files and byte ranges it names are read the
same way. A safetensors file is 8 bytes of header length, a JSON header, then the tensor bytes;
the header's offsets must cover the rest of the file exactly.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.contracts.errors import GpuwardenError
from agent.contracts.json_text import parse_json

# zipfile and pickletools are imported where a checkpoint file is read: only the checkpoints
# collector reads one, and only once it finds one, while a module the daemon imports stays
# resident for its life (issue 14; about 0.35 MB of traced memory between them).
if TYPE_CHECKING:
    import zipfile

SAFETENSORS_MAX_HEADER = 100 * 1024 * 1024
"""The safetensors reference implementation refuses larger headers too."""
PICKLE_MAX_BYTES = 256 * 1024 * 1024
"""A data.pkl or .metadata larger than this is not read (it holds structure, not tensors)."""

SAFETENSORS_DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}
TORCH_STORAGE_BYTES = {
    "FloatStorage": 4,
    "DoubleStorage": 8,
    "HalfStorage": 2,
    "BFloat16Storage": 2,
    "LongStorage": 8,
    "IntStorage": 4,
    "ShortStorage": 2,
    "CharStorage": 1,
    "ByteStorage": 1,
    "BoolStorage": 1,
    "ComplexFloatStorage": 8,
    "ComplexDoubleStorage": 16,
}
_ZIP_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_ZIP_LOCAL_MAGIC = b"PK\x03\x04"


class Unreadable(GpuwardenError):
    """The checkpoint's structure does not read; the message names the file and the fault."""


@dataclass(frozen=True, slots=True)
class Structure:
    """What a structure read found: the files it covers and their total size."""

    files: tuple[Path, ...]
    size_bytes: int
    step: int | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)


def read_safetensors(path: Path) -> Structure:
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise Unreadable(f"{path}: {size} bytes, shorter than the 8-byte header length")
        (length,) = struct.unpack("<Q", head)
        if length > SAFETENSORS_MAX_HEADER or 8 + length > size:
            raise Unreadable(
                f"{path}: header length {length} does not fit the file's {size} bytes "
                "(truncated, or not a safetensors file)"
            )
        raw = handle.read(length)
    try:
        header = parse_json(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise Unreadable(f"{path}: the header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise Unreadable(f"{path}: the header is not a JSON object")
    _check_safetensors_tensors(path, header, size - 8 - length)
    return Structure((path,), size, notes=(f"{len(header) - ('__metadata__' in header)} tensors",))


def _check_safetensors_tensors(path: Path, header: dict[str, Any], data_bytes: int) -> None:
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, stop = info["data_offsets"]
            count = math.prod(int(d) for d in info["shape"])
            width = SAFETENSORS_DTYPE_BYTES.get(info["dtype"])
        except (KeyError, TypeError, ValueError):
            raise Unreadable(f"{path}: tensor {name!r} has no valid dtype/shape/offsets") from None
        if not (isinstance(begin, int) and isinstance(stop, int) and 0 <= begin <= stop):
            raise Unreadable(f"{path}: tensor {name!r} has offsets {info['data_offsets']}")
        if width is not None and (stop - begin) != count * width:
            raise Unreadable(
                f"{path}: tensor {name!r} spans {stop - begin} bytes, "
                f"its dtype and shape need {count * width}"
            )
        if stop > data_bytes:
            raise Unreadable(
                f"{path}: tensor {name!r} ends at byte {stop} of the data, which has "
                f"{data_bytes} (truncated)"
            )
        end = max(end, stop)
    if end != data_bytes:
        raise Unreadable(
            f"{path}: the tensors cover {end} bytes of data, the file holds {data_bytes}"
        )


def _pickle_leaves(data: bytes, where: Path) -> Iterator[tuple[str, Any]]:
    """(opcode name, value) for each string, integer, global and persistent-id load of a
    pickle, memo references resolved; MARK too. Nothing is executed."""
    import pickletools  # noqa: PLC0415 - at the point of use: see the imports above

    memo: dict[int, Any] = {}
    last: Any = None
    try:
        for op, arg, _ in pickletools.genops(data):
            name = op.name
            if name in ("BINPUT", "LONG_BINPUT", "PUT"):
                memo[int(str(arg))] = last
                continue
            if name == "MEMOIZE":
                memo[len(memo)] = last
                continue
            if name in ("BINGET", "LONG_BINGET", "GET"):
                last = memo.get(int(str(arg)))
                yield ("leaf", last)
                continue
            if isinstance(arg, (str, int)) and not isinstance(arg, bool) and name != "PROTO":
                last = arg
                yield ("global" if "GLOBAL" in name else "leaf", arg)
                continue
            last = None
            if name in ("MARK", "BINPERSID"):
                yield (name, None)
    except (ValueError, EOFError) as exc:
        raise Unreadable(f"{where}: the pickle does not read ({exc})") from None


@dataclass(frozen=True, slots=True)
class _StorageRef:
    key: str
    type_name: str
    numel: int


def _torch_storages(data: bytes, where: Path) -> list[_StorageRef]:
    """The storages a torch zip's data.pkl names: its persistent ids are the tuples
    ('storage', <storage type>, key, location, numel), each its own MARK ... TUPLE."""
    refs: list[_StorageRef] = []
    since_mark: list[tuple[str, Any]] = []
    for kind, value in _pickle_leaves(data, where):
        if kind == "MARK":
            since_mark = []
        elif kind == "BINPERSID":
            leaves = [v for k, v in since_mark if k in ("leaf", "global")]
            if len(leaves) >= 5 and leaves[0] == "storage" and isinstance(leaves[2], str):
                type_name = str(leaves[1]).split(" ")[-1].split(".")[-1]
                numel = leaves[4] if isinstance(leaves[4], int) else -1
                refs.append(_StorageRef(leaves[2], type_name, numel))
            since_mark = []
        else:
            since_mark.append((kind, value))
    return refs


def read_torch_zip(path: Path) -> Structure:
    import zipfile  # noqa: PLC0415 - at the point of use: see the imports above

    size = os.path.getsize(path)
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as exc:
        raise Unreadable(
            f"{path}: no readable zip central directory ({exc}): truncated, or a legacy "
            "(pre-1.6) torch.save file"
        ) from None
    with archive, open(path, "rb") as raw:
        members = {info.filename: info for info in archive.infolist()}
        pickles = [name for name in members if name.endswith("/data.pkl") or name == "data.pkl"]
        if not pickles:
            raise Unreadable(f"{path}: a zip without data.pkl is not a torch.save file")
        prefix = pickles[0][: -len("data.pkl")]
        for info in members.values():
            _check_member(path, raw, info, size)
        pkl = members[pickles[0]]
        if pkl.file_size > PICKLE_MAX_BYTES:
            raise Unreadable(f"{path}: data.pkl is {pkl.file_size} bytes, more than is read")
        refs = _torch_storages(archive.read(pkl), path)
    for ref in refs:
        record = members.get(f"{prefix}data/{ref.key}")
        if record is None:
            raise Unreadable(f"{path}: storage {ref.key} is named in data.pkl but has no record")
        width = TORCH_STORAGE_BYTES.get(ref.type_name)
        if width is not None and ref.numel >= 0 and record.file_size < ref.numel * width:
            raise Unreadable(
                f"{path}: record data/{ref.key} holds {record.file_size} bytes, its "
                f"{ref.numel} {ref.type_name} elements need {ref.numel * width}"
            )
    return Structure((path,), size, notes=(f"{len(refs)} storages",))


def _check_member(path: Path, raw: Any, info: zipfile.ZipInfo, size: int) -> None:
    """The member's local header is where the central directory says, and its data fits."""
    raw.seek(info.header_offset)
    header = raw.read(_ZIP_LOCAL_HEADER.size)
    if len(header) < _ZIP_LOCAL_HEADER.size or header[:4] != _ZIP_LOCAL_MAGIC:
        raise Unreadable(f"{path}: member {info.filename} has no local header at its offset")
    fields = _ZIP_LOCAL_HEADER.unpack(header)
    data_start = info.header_offset + _ZIP_LOCAL_HEADER.size + fields[9] + fields[10]
    if data_start + info.compress_size > size:
        raise Unreadable(f"{path}: member {info.filename} runs past the end of the file")


def read_dcp_metadata(metadata: Path) -> list[tuple[str, int, int]]:
    """(shard file, offset, length) for every byte range a `.metadata` pickle names: each
    `_StorageInfo` is a dict of relative_path, offset, length in its BUILD state."""
    data = metadata.read_bytes()
    if len(data) > PICKLE_MAX_BYTES:
        raise Unreadable(f"{metadata}: {len(data)} bytes, more than is read")
    leaves = [v for k, v in _pickle_leaves(data, metadata) if k == "leaf"]
    if not leaves or "Metadata" not in leaves[:4]:
        raise Unreadable(f"{metadata}: not a torch.distributed.checkpoint Metadata pickle")
    ranges = []
    for i, value in enumerate(leaves):
        if value != "relative_path" or i + 5 >= len(leaves):
            continue
        shard, k_offset, offset, k_length, length = leaves[i + 1 : i + 6]
        if (
            isinstance(shard, str)
            and (k_offset, k_length) == ("offset", "length")
            and isinstance(offset, int)
            and isinstance(length, int)
        ):
            ranges.append((shard, offset, length))
    return ranges


def read_dcp_dir(directory: Path) -> Structure:
    metadata = directory / ".metadata"
    if not metadata.is_file():
        raise Unreadable(f"{directory}: no .metadata (the coordinator writes it last)")
    ranges = read_dcp_metadata(metadata)
    ends: dict[str, int] = {}
    for shard, offset, length in ranges:
        ends[shard] = max(ends.get(shard, 0), offset + length)
    files = [metadata]
    total = metadata.stat().st_size
    for shard, end in sorted(ends.items()):
        shard_path = directory / shard
        try:
            shard_size = shard_path.stat().st_size
        except FileNotFoundError:
            raise Unreadable(f"{directory}: shard {shard} named in .metadata is missing") from None
        if shard_size < end:
            raise Unreadable(
                f"{shard_path}: {shard_size} bytes, .metadata names data up to byte {end} "
                "(truncated)"
            )
        files.append(shard_path)
        total += shard_size
    return Structure(tuple(files), total, notes=(f"{len(ends)} shards",))
