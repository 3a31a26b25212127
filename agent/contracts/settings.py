"""Typed, frozen configuration objects built from TOML tables, with errors a person can act on.

Each component (collector, exporter, the watcher) declares its own settings as a frozen
dataclass. `build(cls, table, key_path)` validates a TOML table against it: wrong types, values
out of range, unknown keys (a typo must not be silently ignored) all raise `ConfigError` naming
the key and what was expected. The loader in agent/program/config_file.py adds the file name.

Supported field types: bool, int, float (an int is accepted), str, pathlib.Path, Literal[...],
tuple[str, ...] / tuple[int, ...] / tuple[float, ...], a nested settings dataclass, and
`X | None`. Ranges and help text come from `setting(...)`.

Paths: a NUL byte (or a character the OS cannot take) in a pathlib.Path value, or in a str
declared `setting(path=True)`, is a ConfigError while building. A key that names a file a
command will read declares what it must be, `setting(file=...)`; `check_files` (called by the
loader, agent/program/config_loader.py, for every command alike) then checks each such file: that it exists
and is a regular file (stat'ed first: a FIFO or a device is never opened), can be read, is
private where it holds a secret, and that its content loads (`content=`, a parser of the
component that reads it, raising ValueError), so that `config check` refuses what `run` would.
"""

from __future__ import annotations

import dataclasses
import errno
import math
import os
import ssl
import stat
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

from agent.contracts.errors import ConfigError

T = TypeVar("T")

FileKind = Literal["secret", "private_key", "certificate", "readable"]
"""What a file key must name. secret, private_key: a regular file no one but its owner may
access (mode & 0o077 == 0); certificate: PEM certificates (a CA bundle, a certificate chain);
readable: any regular file the process can read."""

EXPECTED_FILE: dict[str, str] = {
    "secret": "a regular file only its owner can access (chmod 600)",
    "private_key": "an unencrypted PEM private key only its owner can access (chmod 600)",
    "certificate": "a regular file of PEM certificates",
    "readable": "a readable regular file",
}
PRIVATE_KINDS = frozenset({"secret", "private_key"})
CREDENTIALS_DIR = Path("/run/credentials")


def setting(
    default: Any = dataclasses.MISSING,
    *,
    factory: Any = dataclasses.MISSING,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: float | None = None,
    help: str = "",
    secret: bool = False,
    path: bool = False,
    file: FileKind | None = None,
    certificate: str | None = None,
    content: Callable[[Path], object] | None = None,
) -> Any:
    """A dataclass field with validation bounds and a help text for the configuration reference (docs/configuration.md).

    `path`: a str (or tuple of str) that is a path, so its characters are checked like a
    Path's. `file`: the value names a file of this kind, checked by `check_files`.
    `certificate` (on a private_key field): the sibling field holding its certificate; the
    pair must load together. `content`: a function of the component that reads the file,
    raising ValueError (with a message naming the file, and the line) where it would refuse.
    """
    if (certificate is not None and file != "private_key") or (
        content is not None and file is None
    ):
        raise TypeError("certificate= needs file='private_key'; content= needs a file kind")
    metadata = {
        "minimum": minimum,
        "maximum": maximum,
        "exclusive_minimum": exclusive_minimum,
        "help": help,
        "secret": secret,
        "path": path,
        "file": file,
        "certificate": certificate,
        "content": content,
    }
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple or a factory for collection defaults")
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _type_name(value: Any) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        dict: "a table",
        list: "an array",
    }.get(type(value), type(value).__name__)


def _convert(value: Any, annotation: Any, key: str) -> Any:  # noqa: PLR0912
    origin = get_origin(annotation)
    if origin in (types.UnionType, typing.Union):
        options = [a for a in get_args(annotation) if a is not type(None)]
        if value is None and len(options) < len(get_args(annotation)):
            return None  # only embedded defaults can say None: TOML has no null
        if len(options) != 1:
            raise TypeError(f"{key}: unsupported union {annotation}")
        return _convert(value, options[0], key)
    if origin is Literal:
        allowed = get_args(annotation)
        if value not in allowed:
            shown = ", ".join(repr(a) for a in allowed)
            raise ConfigError(key, f"expected one of {shown}, got {value!r}")
        return value
    if origin is tuple:
        item_type = get_args(annotation)[0]
        if not isinstance(value, list):
            raise ConfigError(key, f"expected an array, got {_type_name(value)}")
        return tuple(_convert(v, item_type, f"{key}[{i}]") for i, v in enumerate(value))
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"expected true or false, got {_type_name(value)} {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"expected an integer, got {_type_name(value)} {value!r}")
        if abs(value) >= 2**63:  # TOML allows 64-bit integers; a larger one fails later
            raise ConfigError(key, "expected an integer that fits in 64 bits")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"expected a number, got {_type_name(value)} {value!r}")
        try:
            number = float(value)
        except OverflowError:
            raise ConfigError(key, "expected a number, got one too large to represent") from None
        if not math.isfinite(number):
            raise ConfigError(key, f"expected a finite number, got {value!r}")
        return number
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"expected a string, got {_type_name(value)} {value!r}")
        return value
    if annotation is Path:
        if not isinstance(value, str) or not value:
            raise ConfigError(key, f"expected a path (a non-empty string), got {value!r}")
        check_path_text(value, key)
        return Path(value)
    if dataclasses.is_dataclass(annotation) and isinstance(annotation, type):
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a table, got {_type_name(value)}")
        return build(annotation, value, key)
    raise TypeError(f"{key}: unsupported settings type {annotation!r}")


def check_path_text(value: str, key: str) -> None:
    """Refuse what no system call takes: open() and stat() raise ValueError, not OSError, on a
    NUL byte, and that would surface as a traceback far from the configuration."""
    if "\x00" in value:
        raise ConfigError(key, f"expected a path without NUL bytes, got {value!r}")
    try:
        os.fsencode(value)
    except UnicodeEncodeError as exc:
        raise ConfigError(
            key, f"expected a path the file system can encode, got {value!r} ({exc.reason})"
        ) from None


def _check_path_strings(value: Any, key: str) -> None:
    if isinstance(value, str):
        check_path_text(value, key)
    elif isinstance(value, tuple):
        for i, item in enumerate(value):
            if isinstance(item, str):
                check_path_text(item, f"{key}[{i}]")


def _check_bounds(value: Any, meta: Mapping[str, Any], key: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    minimum, maximum = meta.get("minimum"), meta.get("maximum")
    exclusive_minimum = meta.get("exclusive_minimum")
    if minimum is not None and value < minimum:
        raise ConfigError(key, f"expected a value >= {minimum}, got {value}")
    if exclusive_minimum is not None and value <= exclusive_minimum:
        raise ConfigError(key, f"expected a value > {exclusive_minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ConfigError(key, f"expected a value <= {maximum}, got {value}")


def build(cls: type[T], table: Mapping[str, Any], path: str = "") -> T:
    """Validate `table` against the settings dataclass `cls` and return a frozen instance.

    Missing keys take the dataclass defaults; unknown keys are an error that lists the valid
    ones. A `ValueError` raised by the dataclass's own `__post_init__` becomes a ConfigError
    on the table's key path.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(table) - set(fields))
    if unknown:
        valid = ", ".join(sorted(fields)) or "(none)"
        raise ConfigError(
            _join(path, unknown[0]), f"unknown key (a typo?); valid keys here: {valid}"
        )
    values: dict[str, Any] = {}
    for name, spec in fields.items():
        key = _join(path, name)
        if name not in table:
            has_default = (
                spec.default is not dataclasses.MISSING
                or spec.default_factory is not dataclasses.MISSING
            )
            if not has_default:
                raise ConfigError(key, "required key is missing")
            continue
        value = _convert(table[name], hints[name], key)
        _check_bounds(value, spec.metadata, key)
        if spec.metadata.get("path"):
            _check_path_strings(value, key)
        values[name] = value
    try:
        return cls(**values)
    except ConfigError as exc:
        if exc.key and path and not exc.key.startswith(path):
            raise ConfigError(_join(path, exc.key), exc.message) from None
        raise
    except ValueError as exc:
        raise ConfigError(path, str(exc)) from None


def to_table(obj: Any, *, mask_secrets: bool = True) -> dict[str, Any]:
    """A settings object back to plain TOML-like data, secret values masked unless asked."""
    out: dict[str, Any] = {}
    for spec in dataclasses.fields(obj):
        value = getattr(obj, spec.name)
        if mask_secrets and spec.metadata.get("secret") and value:
            out[spec.name] = "<redacted>"
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            out[spec.name] = to_table(value, mask_secrets=mask_secrets)
        elif isinstance(value, Path):
            out[spec.name] = str(value)
        elif isinstance(value, tuple):
            out[spec.name] = [_plain(v, mask_secrets) for v in value]
        else:
            out[spec.name] = value
    return out


def _plain(item: Any, mask_secrets: bool) -> Any:
    """One item of a tuple setting: an array of tables (a tuple of settings) stays tables."""
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        return to_table(item, mask_secrets=mask_secrets)
    return str(item) if isinstance(item, Path) else item


# -- files named by keys ----------------------------------------------------------------------


class FileProblem(ValueError):
    """A file is missing, not a regular file, or cannot be read; the message names it."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.errno = code


def describe_file_type(mode: int) -> str:
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def stat_regular(path: Path) -> os.stat_result:
    """stat() a file that must be regular, without opening it. Raises FileProblem."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise FileProblem(f"{path}: {exc.strerror}", exc.errno) from None
    except ValueError:  # a NUL byte: only from code, the loader refuses it in a value
        raise FileProblem(f"{str(path)!r}: a path with a NUL byte") from None
    if not stat.S_ISREG(info.st_mode):
        raise FileProblem(f"{path} is {describe_file_type(info.st_mode)}")
    return info


def read_regular(path: Path) -> bytes:
    """The bytes of a regular file. It is stat'ed before it is opened, and opened without
    blocking: a FIFO would block the reader until a writer came, a device may never end."""
    stat_regular(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise FileProblem(f"{path}: {exc.strerror}", exc.errno) from None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):  # replaced between stat and open
            raise FileProblem(f"{path} is {describe_file_type(info.st_mode)}")
        try:
            return handle.read()
        except OSError as exc:
            raise FileProblem(f"{path}: {exc.strerror}", exc.errno) from None


def read_file(path: Path, kind: FileKind, key: str) -> bytes:
    """Check that `path` is what a `kind` key must name and return its bytes (ConfigError on
    `key` otherwise: what is wrong, what was expected, and the fix where there is one)."""
    expected = EXPECTED_FILE[kind]
    try:
        info = stat_regular(path)
        if kind in PRIVATE_KINDS and info.st_mode & 0o077:
            raise ConfigError(
                key,
                f"{path} is accessible to other users (mode {stat.filemode(info.st_mode)}); "
                f"expected {expected}; run: chmod 600 {path}",
            )
        data = read_regular(path)
    except FileProblem as exc:
        hint = ""
        if exc.errno == errno.ENOENT and path.is_relative_to(CREDENTIALS_DIR):
            hint = " (a systemd credential exists only while its unit runs)"
        raise ConfigError(key, f"{exc}{hint}; expected {expected}") from None
    if kind == "secret":
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(
                key, f"{path} is not UTF-8 text ({exc}); expected {expected}"
            ) from None
    return data


class _Passphrase(Exception):
    """Raised by the passphrase callback: an encrypted key cannot be used unattended."""


def _no_passphrase() -> bytes:
    raise _Passphrase


def _check_certificates(path: Path, key: str) -> None:
    # As the TLS context that reads it later does (a CA bundle: create_default_context).
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(cafile=path)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(
            key,
            f"{path}: no PEM certificate could be loaded ({exc}); "
            f"expected {EXPECTED_FILE['certificate']}",
        ) from None


def _check_key_pair(key_path: Path, cert: Path, key: str, cert_key: str) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key_path, password=_no_passphrase)
    except _Passphrase:
        reason = "it is encrypted with a passphrase, which nobody is there to type"
    except (ssl.SSLError, OSError) as exc:
        reason = str(exc)
    else:
        return
    raise ConfigError(
        key,
        f"{key_path} did not load as the private key of {cert_key} ({cert}): {reason}; "
        f"expected {EXPECTED_FILE['private_key']}",
    )


def check_files(obj: Any, path: str = "") -> None:
    """Check every file the fields of the settings object `obj` (and of settings nested in
    it) name, in field order, stopping at the first problem: ConfigError on its key."""
    for spec in dataclasses.fields(obj):
        value = getattr(obj, spec.name)
        key = _join(path, spec.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_files(value, key)
            continue
        if isinstance(value, tuple):  # an array of tables: each is checked like a table
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item) and not isinstance(item, type):
                    check_files(item, f"{key}[{i}]")
        kind = spec.metadata.get("file")
        if kind is None or value is None:
            continue
        read_file(value, kind, key)
        if kind == "certificate":
            _check_certificates(value, key)
        cert_field = spec.metadata.get("certificate")
        if cert_field is not None and getattr(obj, cert_field) is not None:
            _check_key_pair(value, getattr(obj, cert_field), key, _join(path, cert_field))
        content = spec.metadata.get("content")
        if content is not None:
            try:
                content(value)
            except ValueError as exc:
                raise ConfigError(key, str(exc)) from None
