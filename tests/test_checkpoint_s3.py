"""The S3 off-node copy against a real S3-compatible server (moto's server mode, a child
process on a free loopback port): single-part uploads are checked by MD5, multipart by size."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from boto3.s3.transfer import TransferConfig

from collectors.checkpoints.settings import CheckpointSettings
from tests.support.checkpoints import HOUR, Harness, age, kinds, location, values, write_torch
from tests.support.ports import free_port, wait_for_port

BUCKET = "ckpt"
PREFIX = "run42/"
MIB = 2**20


@pytest.fixture(scope="module")
def s3_url() -> Iterator[str]:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port, timeout=30)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.fixture
def credentials(tmp_path: Path) -> tuple[Path, Path]:
    files = (tmp_path / "key-id", tmp_path / "secret")
    for path, text in zip(files, ("testing-id", "testing-secret"), strict=True):
        path.write_text(text + "\n")
        path.chmod(0o600)
    return files


def client(url: str) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=url,
        region_name="us-east-1",
        aws_access_key_id="testing-id",
        aws_secret_access_key="testing-secret",
    )


@pytest.fixture
def bucket(s3_url: str) -> Iterator[Any]:
    s3 = client(s3_url)
    s3.create_bucket(Bucket=BUCKET)
    yield s3
    for obj in s3.list_objects_v2(Bucket=BUCKET).get("Contents", []):
        s3.delete_object(Bucket=BUCKET, Key=obj["Key"])
    s3.delete_bucket(Bucket=BUCKET)


def harness(directory: Path, url: str, credentials: tuple[Path, Path], **changes: Any) -> Harness:
    loc = location(
        directory,
        s3_bucket=BUCKET,
        s3_prefix=PREFIX,
        s3_endpoint_url=url,
        s3_access_key_id_file=credentials[0],
        s3_secret_access_key_file=credentials[1],
        offnode_max_lag=HOUR,
        **changes,
    )
    return Harness(CheckpointSettings(enabled=True, locations=(loc,), timeout=10.0))


MULTIPART = TransferConfig(multipart_threshold=5 * MIB, multipart_chunksize=5 * MIB)
SINGLE = TransferConfig(multipart_threshold=1024 * MIB)


def corrupt_copy(path: Path, tmp_path: Path) -> Path:
    """Same size, one byte different: only a checksum can tell."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    out = tmp_path / f"bad-{path.name}"
    out.write_bytes(bytes(data))
    return out


class TestS3Copy:
    async def test_single_part_copy_is_checked_by_md5(
        self, tmp_path: Path, s3_url: str, bucket: Any, credentials: tuple[Path, Path]
    ) -> None:
        directory = tmp_path / "ckpt"
        directory.mkdir()
        path = write_torch(directory / "step_100.pt", step=100)
        age(path, 2 * HOUR)
        bucket.upload_file(str(path), BUCKET, f"{PREFIX}step_100.pt", Config=SINGLE)
        h = harness(directory, s3_url, credentials)
        try:
            labels = ("train", f"s3://{BUCKET}/{PREFIX}")
            result = await h.round()
            assert values(result, "gpuwarden_checkpoint_offnode_ok") == {labels: 1}
            assert values(result, "gpuwarden_checkpoint_offnode_newest_step") == {labels: 100}
            assert "MD5 = single-part ETag" in h.collector.comparisons["train"].checksum_check
            bad = corrupt_copy(path, tmp_path)
            bucket.upload_file(str(bad), BUCKET, f"{PREFIX}step_100.pt", Config=SINGLE)
            result = await h.round()
            assert values(result, "gpuwarden_checkpoint_offnode_ok") == {labels: 0}
            mismatch = [e for e in result.events if e.kind == "checkpoint_offnode_mismatch"]
            assert len(mismatch) == 1 and "ETag" in mismatch[0].message
            assert "MD5" in str(mismatch[0].attributes["checksum_check"])
        finally:
            h.close()

    async def test_multipart_copy_is_checked_by_size_and_says_so(
        self, tmp_path: Path, s3_url: str, bucket: Any, credentials: tuple[Path, Path]
    ) -> None:
        directory = tmp_path / "ckpt"
        directory.mkdir()
        path = write_torch(directory / "step_200.pt", rows=48_000, step=200)  # ~6 MiB
        assert path.stat().st_size > 5 * MIB
        age(path, 2 * HOUR)
        bad = corrupt_copy(path, tmp_path)
        bucket.upload_file(str(bad), BUCKET, f"{PREFIX}step_200.pt", Config=MULTIPART)
        etag = bucket.head_object(Bucket=BUCKET, Key=f"{PREFIX}step_200.pt")["ETag"]
        assert "-" in etag, "the upload must really be multipart"
        h = harness(directory, s3_url, credentials)
        try:
            result = await h.round()
            comparison = h.collector.comparisons["train"]
            # A multipart ETag is no MD5: a same-size corruption cannot be seen, and it says so.
            assert comparison.ok
            assert "size only for multipart" in comparison.checksum_check
            short = tmp_path / "short.pt"
            short.write_bytes(path.read_bytes()[: 5 * MIB + 10])
            bucket.upload_file(str(short), BUCKET, f"{PREFIX}step_200.pt", Config=MULTIPART)
            result = await h.round()
            assert "checkpoint_offnode_mismatch" in kinds(result), "a size difference is seen"
        finally:
            h.close()

    async def test_missing_copy_behind_and_an_unreachable_endpoint(
        self, tmp_path: Path, s3_url: str, bucket: Any, credentials: tuple[Path, Path]
    ) -> None:
        directory = tmp_path / "ckpt"
        directory.mkdir()
        path = write_torch(directory / "step_1.pt")
        age(path, 2 * HOUR)
        uploading = f"{PREFIX}step_1.pt.uploading"
        bucket.upload_file(str(path), BUCKET, uploading, Config=SINGLE)  # a temp name is no copy
        h = harness(directory, s3_url, credentials)
        try:
            result = await h.round()
            assert "checkpoint_offnode_behind" in kinds(result)
        finally:
            h.close()
        dead = f"http://127.0.0.1:{free_port()}"
        h = harness(directory, dead, credentials)
        try:
            started = time.monotonic()
            result = await h.round()
            assert "checkpoint_offnode_error" in kinds(result)
            assert values(result, "gpuwarden_checkpoint_offnode_error") == {
                ("train", f"s3://{BUCKET}/{PREFIX}"): 1
            }
            assert time.monotonic() - started < 60
        finally:
            h.close()
        assert os.stat(credentials[1]).st_mode & 0o077 == 0
