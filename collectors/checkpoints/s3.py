"""The off-node copy in an S3-compatible bucket, through boto3.

boto3 is imported only here, and only when a location names a bucket (the `s3` extra):
a host that copies to a volume does not need it. Credentials come from files (never from the
configuration itself); without them boto3's own chain applies (environment, instance role).
Listing is the only call: sizes and ETags come with it, no object is downloaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent.contracts.errors import CallStillHung, CallTimedOut, GpuwardenError
from collectors.checkpoints.judge import Caller, Judge, RoundOutcome
from collectors.checkpoints.offnode import Comparison, group_objects, judge_copy
from collectors.checkpoints.settings import CheckpointSettings, LocationSettings

MAX_OBJECTS = 100_000
"""A prefix with more objects than this is listed no further: name a narrower prefix."""


class S3Error(GpuwardenError):
    """Listing the bucket failed; the message says what boto3 said."""


def _secret(path: Path) -> str:
    return path.read_text().strip()


class S3Copy:
    def __init__(self, loc: LocationSettings, settings: CheckpointSettings) -> None:
        self.loc = loc
        self.settings = settings
        self._client: Any = None

    def _make_client(self) -> Any:
        import boto3  # noqa: PLC0415 (optional: the s3 extra)
        from botocore.config import Config  # noqa: PLC0415

        loc = self.loc
        key_id = secret = None  # None: boto3's own chain (environment, instance role)
        if loc.s3_access_key_id_file is not None and loc.s3_secret_access_key_file is not None:
            key_id = _secret(loc.s3_access_key_id_file)
            secret = _secret(loc.s3_secret_access_key_file)
        timeout = max(self.settings.timeout / 2, 1.0)
        return boto3.client(
            "s3",
            endpoint_url=loc.s3_endpoint_url or None,
            region_name=loc.s3_region,
            config=Config(
                connect_timeout=timeout, read_timeout=timeout, retries={"max_attempts": 2}
            ),
            aws_access_key_id=key_id,
            aws_secret_access_key=secret,
        )

    def list_objects(self) -> list[dict[str, Any]]:
        """Blocking: every object under the prefix (Key, Size, ETag)."""
        try:
            if self._client is None:
                self._client = self._make_client()
            out: list[dict[str, Any]] = []
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.loc.s3_bucket, Prefix=self.loc.s3_prefix
            )
            for page in pages:
                out.extend(page.get("Contents", []))
                if len(out) >= MAX_OBJECTS:
                    break
            return out
        except OSError as exc:
            raise S3Error(
                f"s3://{self.loc.s3_bucket}: cannot read the credentials: {exc}"
            ) from None
        except Exception as exc:  # botocore's errors: all that matters is what it said
            raise S3Error(f"s3://{self.loc.s3_bucket}/{self.loc.s3_prefix}: {exc}") from None

    async def compare(
        self, caller: Caller, outcome: RoundOutcome, local: Judge, now: float
    ) -> Comparison:
        try:
            objects: Sequence[dict[str, Any]] = await caller.call(
                f"s3:list:{self.loc.label}", self.list_objects
            )
        except (S3Error, CallTimedOut, CallStillHung) as exc:
            return Comparison(ok=False, error=str(exc))
        entries = group_objects(objects, self.loc.s3_prefix, self.settings.temp_patterns)
        complete = [v for v in outcome.verdicts if v.status == "complete"]
        return judge_copy(self.loc, complete, local, entries, now)
