"""The YAML reader of web configs, apart so that yaml loads only when a web config is read
(resident memory: tests/test_daemon_imports.py)."""

from __future__ import annotations

from typing import Any

import yaml
from yaml import MarkedYAMLError, YAMLError

__all__ = ["MarkedYAMLError", "YAMLError", "load"]


class _StrictLoader(yaml.SafeLoader):
    """YAML without duplicate keys (the last would win silently) and without aliases (an
    alias bomb; a web config needs none)."""

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()  # type: ignore[no-untyped-call]
            raise yaml.constructor.ConstructorError(
                None, None, "aliases (*name) are not accepted here", event.start_mark
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, str | int | float | bool):
                continue  # unhashable: the constructor below refuses it, with its line
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load(text: str) -> Any:
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
