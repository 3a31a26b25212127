"""Read the agent's state store without changing it (for `diag` and `check`).

With no `-wal` file beside the database (the agent is stopped) it is opened `immutable=1`: no
lock, no journal, nothing created. While the agent runs it is opened `mode=ro`, which reads the
WAL; SQLite then only takes read marks in the agent's `-shm` index, never a data change.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.contracts.errors import StateStoreError
from agent.runtime.state import DB_NAME, StateStore


@dataclass
class StateSnapshot:
    path: Path
    available: bool
    reason: str = ""
    schema_version: int | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    outbox_depth: dict[str, int] = field(default_factory=dict)
    outbox_oldest_age_seconds: float | None = None
    kv: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "available": self.available,
            "reason": self.reason,
            "schema_version": self.schema_version,
            "outbox": {
                "depth_by_kind": self.outbox_depth,
                "depth": sum(self.outbox_depth.values()),
                "oldest_age_seconds": self.outbox_oldest_age_seconds,
            },
            "kv": self.kv,
        }


def open_read_only(path: Path) -> sqlite3.Connection:
    wal = Path(f"{path}-wal")
    mode = "mode=ro" if wal.exists() else "immutable=1"
    return sqlite3.connect(
        f"{path.resolve().as_uri()}?{mode}", uri=True, timeout=2.0, check_same_thread=False
    )


def read_state(state_dir: Path, event_limit: int = 500, now: float | None = None) -> StateSnapshot:
    path = state_dir / DB_NAME
    if not path.is_file():
        return StateSnapshot(
            path, False, f"no state database at {path} (the agent has not run here)"
        )
    try:
        conn = open_read_only(path)
    except sqlite3.Error as exc:
        return StateSnapshot(path, False, f"cannot open {path} read-only: {exc}")
    try:
        # StateStore only for its queries: a read-only connection, never a write.
        store = StateStore(conn, None, ())
        snapshot = StateSnapshot(path, True, schema_version=store.schema_version())
        snapshot.events = [e.to_dict() for e in store.recent_events(limit=event_limit)]
        snapshot.outbox_depth = store.outbox_depth()
        oldest = store.outbox_peek(limit=1)
        if oldest:
            snapshot.outbox_oldest_age_seconds = round((now or time.time()) - oldest[0].created, 1)
        rows = conn.execute("SELECT DISTINCT namespace FROM kv ORDER BY namespace").fetchall()
        snapshot.kv = {str(ns): store.items(str(ns)) for (ns,) in rows}
        return snapshot
    except (sqlite3.Error, StateStoreError, ValueError) as exc:
        return StateSnapshot(path, False, f"cannot read {path}: {exc}")
    finally:
        conn.close()
