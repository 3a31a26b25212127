"""Logging: structlog, JSON lines when stdout is not a terminal (journald), console otherwise."""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any, TextIO

import structlog

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def drop_none(
    _logger: object, _method: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """Leave out every field whose value is None, nested ones too: a reader sees `node=None`
    as a node called None, and an absent value is simply not there."""
    return {key: _without_none(value) for key, value in event_dict.items() if value is not None}


def _without_none(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return type(value)(_without_none(v) for v in value if v is not None)
    return value


def configure(level: str = "info", stream: TextIO | None = None, json: bool | None = None) -> None:
    """Configure structlog once per process. `json=None`: JSON unless `stream` is a terminal."""
    stream = sys.stdout if stream is None else stream
    if json is None:
        json = not stream.isatty()
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        drop_none,
    ]
    if json:
        processors += [
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(sort_keys=False),
        ]
    else:
        processors.append(structlog.dev.ConsoleRenderer(colors=stream.isatty()))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS.get(level, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )


def set_level(level: str) -> None:
    """Change the level at run time (a reload). Loggers are not cached on first use, so
    every logger, those made before included, filters at the new level from now on."""
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS.get(level, logging.INFO))
    )
