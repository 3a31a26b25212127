"""`[collectors.checkpoints]`: the watched locations and how they are judged."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agent.contracts.collector import CollectorSettings
from agent.contracts.settings import setting
from collectors.checkpoints.detect import DEFAULT_TEMP_PATTERNS


@dataclass(frozen=True)
class LocationSettings:
    """One `[[collectors.checkpoints.locations]]` table."""

    path: Path = setting(help="the directory the job saves its checkpoints in (required)")
    name: str = setting("", help="the series' `location` label (default: the path)")
    pattern: str = setting("*", help="glob of the entry names in `path` that are checkpoints")
    max_age: float = setting(
        86400.0,
        exclusive_minimum=0.0,
        help="seconds of work you can afford to lose: the newest complete checkpoint is stale beyond",
    )
    copy_dir: Path | None = setting(
        None, help="the off-node copy in another directory (a mounted volume), same entry names"
    )
    s3_bucket: str = setting("", help="the off-node copy in an S3-compatible bucket")
    s3_prefix: str = setting("", help="key prefix of the copies in the bucket (`<prefix><name>`)")
    s3_endpoint_url: str = setting("", help="S3 endpoint (empty: AWS)")
    s3_region: str = setting("us-east-1", help="S3 region")
    s3_access_key_id_file: Path | None = setting(
        None, file="secret", help="file holding the access key id"
    )
    s3_secret_access_key_file: Path | None = setting(
        None, file="secret", help="file holding the secret access key"
    )
    offnode_max_lag: float = setting(
        7200.0,
        exclusive_minimum=0.0,
        help="seconds after which the newest complete checkpoint must be in the off-node copy",
    )

    def __post_init__(self) -> None:
        if not self.path.is_absolute():
            raise ValueError(f"path: expected an absolute directory, got {str(self.path)!r}")
        if self.copy_dir is not None and not self.copy_dir.is_absolute():
            raise ValueError(f"copy_dir: expected an absolute directory, got {self.copy_dir}")
        if self.copy_dir is not None and self.s3_bucket:
            raise ValueError("copy_dir and s3_bucket: choose one off-node copy per location")
        files = (self.s3_access_key_id_file, self.s3_secret_access_key_file)
        if (files[0] is None) != (files[1] is None):
            raise ValueError(
                "s3_access_key_id_file and s3_secret_access_key_file: give both or neither"
            )
        if not self.s3_bucket and any(f is not None for f in files):
            raise ValueError("s3_access_key_id_file needs s3_bucket")

    @property
    def label(self) -> str:
        return self.name or str(self.path)

    @property
    def target(self) -> str:
        """The off-node copy's `target` label; empty when there is none."""
        if self.copy_dir is not None:
            return str(self.copy_dir)
        return f"s3://{self.s3_bucket}/{self.s3_prefix}" if self.s3_bucket else ""


@dataclass(frozen=True)
class CheckpointSettings(CollectorSettings):
    locations: tuple[LocationSettings, ...] = setting(
        (),
        help="the watched locations: an array of tables (`[[collectors.checkpoints.locations]]`)",
    )
    settle_seconds: float = setting(
        60.0,
        minimum=0.0,
        help="a checkpoint unchanged between two rounds, or untouched this long, has stopped changing",
    )
    temp_patterns: tuple[str, ...] = setting(
        DEFAULT_TEMP_PATTERNS, help="globs of names that are saves or uploads in progress"
    )
    hash_newest: int = setting(
        2,
        minimum=0,
        maximum=1000,
        help="the newest checkpoints with a sidecar checksum that are hashed",
    )
    hash_bandwidth_mib_s: float = setting(
        50.0, exclusive_minimum=0.0, help="MiB/s hashing may read, so the job's I/O is not starved"
    )
    shrink_ratio: float = setting(
        0.5,
        minimum=0.0,
        maximum=1.0,
        help="a new newest checkpoint smaller than this fraction of the one before has shrunk",
    )
    max_checkpoints: int = setting(
        10000, minimum=1, help="candidates looked at per location (newest names first)"
    )

    def __post_init__(self) -> None:
        if self.enabled and not self.locations:
            raise ValueError(
                "locations: expected at least one [[collectors.checkpoints.locations]] table "
                "when enabled"
            )
        labels = [loc.label for loc in self.locations]
        doubled = sorted({label for label in labels if labels.count(label) > 1})
        if doubled:
            raise ValueError(f"locations: two locations share the name {doubled[0]!r}")
