"""One base error for gpuwarden, and the typed errors every layer may raise or catch.

They live at the bottom layer so that a collector or an exporter can name an error of the
runtime (a store that cannot write, a blocking call that hung) without importing the runtime.
Errors that belong to one component (an NVML failure, a malformed kernel-log line) are defined
beside it, as subclasses of `GpuwardenError`.
"""

from __future__ import annotations


class GpuwardenError(Exception):
    """Anything gpuwarden itself raises on purpose: catch this, not `Exception`.

    `action`: what a person should do about it, when the raiser knows (the runtime logs it
    beside the message, in one line, instead of a traceback)."""

    action: str = ""


class ConfigError(GpuwardenError):
    """A configuration value is wrong. `str()` gives `file: key: message`."""

    def __init__(self, key: str, message: str, file: str = "") -> None:
        self.key = key
        self.message = message
        self.file = file
        super().__init__(self.__str__())

    def with_file(self, file: str) -> ConfigError:
        return ConfigError(self.key, self.message, file)

    def __str__(self) -> str:
        where = f"{self.file}: " if self.file else ""
        key = f"{self.key}: " if self.key else ""
        return f"{where}{key}{self.message}"


class ModelError(GpuwardenError, ValueError):
    """A metric family, sample or event was built with values that break the model's rules."""


class StateStoreError(GpuwardenError):
    """The state store could not do what was asked; the caller degrades, never crashes."""


class CallTimedOut(GpuwardenError):
    """A blocking call did not return within its timeout. Its thread is now marked hung."""

    def __init__(self, key: str, timeout: float) -> None:
        super().__init__(f"{key}: no answer within {timeout:g} s")
        self.key = key
        self.timeout = timeout


class CallStillHung(GpuwardenError):
    """An earlier call with this key has not returned yet, so no new one was started."""

    def __init__(self, key: str, hung_for: float) -> None:
        super().__init__(f"{key}: an earlier call has hung for {hung_for:.0f} s; not retried")
        self.key = key
        self.hung_for = hung_for
