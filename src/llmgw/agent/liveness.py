"""When a serving engine counts as hung: the settings and the run of failed probes.

An engine that deadlocks, or whose CUDA context is wedged, keeps its process:
watching the process alone leaves the replica READY forever, the gateway
keeps routing to it, and every request sent there hangs. So the agent probes
the engine over HTTP while it serves (``agent.replicas``), and this module
decides when the failures add up to a hung engine.

One failed probe never does. Real engines answer slowly while busy (vLLM's
API server under a burst, llama.cpp while a long prompt is prefilled), and
killing a busy engine turns load into an outage. An engine is hung only after
``failures`` probes in a row have failed *and* ``window_s`` seconds have
passed since the first of them; a single probe that passes ends the run.
An engine that answers but computes nothing is :mod:`llmgw.agent.progress`'s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from llmgw.errors import ConfigError


@dataclass(frozen=True)
class Liveness:
    """How often a serving engine is probed and how long it may fail to answer."""

    # Between the end of one probe and the start of the next.
    interval_s: float = 5.0
    # One probe; a probe still unanswered after this counts as failed.
    timeout_s: float = 5.0
    # Consecutive failed probes, and seconds since the first of them, before
    # the engine is declared hung: both must be reached.
    failures: int = 3
    window_s: float = 30.0
    # Seconds an engine may have requests running while its token counters
    # stand still before it is declared stalled (agent.progress); scraped at
    # the same interval as the probe.
    stall_window_s: float = 120.0

    def __post_init__(self) -> None:
        for name in ("interval_s", "timeout_s", "stall_window_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"liveness {name} must be > 0, got {getattr(self, name)}")
        if self.failures < 1:
            raise ConfigError(f"liveness failures must be >= 1, got {self.failures}")
        if not self.window_s >= 0:
            raise ConfigError(f"liveness window_s must be >= 0, got {self.window_s}")


class FailedProbes:
    """The current run of consecutive failed probes of one engine (empty while it answers)."""

    def __init__(self, liveness: Liveness) -> None:
        self.liveness = liveness
        self.count = 0
        self.last_error = ""
        self._first = 0.0  # monotonic: the window is measured on it
        self._first_wall = 0.0  # the same moment for people, in reasons

    @property
    def failing(self) -> bool:
        return self.count > 0

    def failed(self, error: str, now: float, wall: float | None = None) -> None:
        """Count a failed probe; ``now`` is monotonic, ``wall`` the same moment as time.time()."""
        if self.count == 0:
            self._first = now
            self._first_wall = time.time() if wall is None else wall
        self.count += 1
        self.last_error = error

    def passed(self) -> bool:
        """A probe passed: the run ends. True when there was one to end."""
        ended = self.count > 0
        self.count = 0
        self.last_error = ""
        return ended

    def failing_for(self, now: float) -> float:
        return now - self._first if self.count else 0.0

    def hung(self, now: float) -> bool:
        lv = self.liveness
        return self.count >= lv.failures and self.failing_for(now) >= lv.window_s

    def failing_reason(self, path: str) -> str:
        """What a replica still routed to says while its probes fail."""
        since = time.strftime("%H:%M:%S", time.gmtime(self._first_wall))
        return f"health probe {path} failing since {since} UTC ({self._tally()})"

    def hung_reason(self, path: str, now: float) -> str:
        """Why a hung engine was killed."""
        seconds = self.failing_for(now)
        return f"engine stopped answering {path} for {seconds:.0f} s ({self._tally()}); killed"

    def _tally(self) -> str:
        probes = "probe" if self.count == 1 else "probes"
        return f"{self.count} {probes} failed in a row, last: {self.last_error}"
