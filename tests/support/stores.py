"""A state store on a full disk, for the tests of every collector that writes state."""

from __future__ import annotations

from agent.contracts.collector import JSONValue, MemoryKeyValueStore
from agent.contracts.errors import StateStoreError

FULL_DISK = "state store write failed: database or disk is full"
"""What agent.state raises when SQLite reports SQLITE_FULL."""


class FullDiskStore(MemoryKeyValueStore):
    """Writes raise StateStoreError while `full` is set, and for the next `fail` writes.

    Reads answer from what is stored; `seed` stores without the refusal (what an earlier run
    saved before the disk filled up).
    """

    def __init__(self, *, full: bool = True) -> None:
        super().__init__()
        self.full = full
        self.fail = 0

    def _refuse(self) -> None:
        if self.fail > 0:
            self.fail -= 1
            raise StateStoreError(FULL_DISK)
        if self.full:
            raise StateStoreError(FULL_DISK)

    def seed(self, namespace: str, key: str, value: JSONValue) -> None:
        super().put(namespace, key, value)

    def put(self, namespace: str, key: str, value: JSONValue) -> None:
        self._refuse()
        super().put(namespace, key, value)

    def delete(self, namespace: str, key: str) -> None:
        self._refuse()
        super().delete(namespace, key)
