"""Releasing the GPUs on request: the pause every GPU user of the agent honours.

An operator who resets a GPU (`nvidia-smi -r`) or changes its MIG mode needs every process off
the device files. `gpuwarden pause` asks the running agent to let go: the runtime asks each
`PausableCollector` to release what it holds (the gpu collector shuts NVML down and joins its
event thread; the benchmark starts no child), and until the pause ends those collectors' rounds
make no driver call and give no GPU series. A pause always has a deadline: a forgotten one
must not blind the node for good (agent/runtime/pause.py ends it and says so).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from agent.contracts.collector import Collector
from agent.contracts.errors import ConfigError
from agent.contracts.settings import setting


@dataclass(frozen=True)
class PauseState:
    """A pause in force: when it began, when it ends by itself, who asked and why."""

    since: float
    until: float
    reason: str = ""
    by: str = ""
    """Who asked: the peer's user name as the control socket saw it."""

    def to_dict(self) -> dict[str, str | float]:
        return {
            "since_ts": round(self.since, 3),
            "until_ts": round(self.until, 3),
            "reason": self.reason,
            "by": self.by,
        }


@dataclass(frozen=True)
class Released:
    """What one collector did when asked to pause."""

    component: str
    released: bool
    """True when the collector holds nothing of the GPUs any more."""
    detail: str
    """One line for the operator: what was let go, or what could not be and why."""


@runtime_checkable
class PausableCollector(Collector, Protocol):
    """A collector that uses the GPUs and can let go of them.

    `pause` returns once the collector holds nothing of the GPU driver (no thread in it, no
    library initialised, no child process on a GPU), or says what it could not release. From
    then until `resume`, its rounds make no driver call; they return no GPU series (the
    runtime's `gpuwarden_gpu_paused` says why). `resume` only lifts the gate: the next round
    starts afresh (initialises the library, re-reads everything, restarts its threads) and
    reports a GPU that did not come back. Both may be called while a round runs: the
    collector orders them with its own rounds."""

    async def pause(self) -> Released: ...

    async def resume(self) -> None: ...


@dataclass(frozen=True)
class PauseSettings:
    """`[pause]`: how long `gpuwarden pause` lets go of the GPUs."""

    default_duration: float = setting(
        1800.0,
        minimum=1.0,
        maximum=86400.0,
        help="seconds a pause lasts when `gpuwarden pause` names no --for; then the agent "
        "resumes by itself",
    )
    max_duration: float = setting(
        14400.0,
        minimum=1.0,
        maximum=604800.0,
        help="the longest pause the agent accepts (a longer --for is refused)",
    )

    def __post_init__(self) -> None:
        if self.default_duration > self.max_duration:
            raise ConfigError(
                "pause.default_duration",
                f"expected at most max_duration ({self.max_duration:g} s), "
                f"got {self.default_duration:g} s",
            )
