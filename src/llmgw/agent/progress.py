"""When a serving engine counts as stalled: answering, but making no progress.

A health probe proves the HTTP server answers, not that the model computes.
vLLM's API server runs apart from its engine core: with the core stuck inside
a CUDA call, ``/health`` keeps answering 200, the replica stays READY, and
every request routed there waits forever. The engine's Prometheus metrics
show it: requests are running, yet the token counters stand still.

So for an engine whose adapter names its metrics (:class:`ProgressMetrics`),
the agent scrapes them at the liveness interval (``agent.replicas``) and this
module decides. An engine is stalled once requests have been running for
``Liveness.stall_window_s`` while none of its token counters moved. An idle
engine (nothing running) never is, and one token in the window is progress: a
slow engine is not a stuck one.

Which counters depends on when each engine counts (read in their sources):

* vLLM (0.34, ``v1/metrics``) adds to ``vllm:generation_tokens_total`` at
  every engine step and to ``vllm:prompt_tokens_total`` when a prompt's
  prefill ends. A single very long prefill counts nothing until it ends, so
  the window must outlast the longest one: minutes, not seconds, by default.
* SGLang (0.5.23) adds to ``sglang:prompt_tokens_total`` and
  ``sglang:generation_tokens_total`` only when a request *finishes*: one long
  request with nothing else finishing would read as a stall. Its
  ``sglang:realtime_tokens_total`` (labelled by ``mode``: prefill_compute,
  prefill_cache, decode) moves at every prefill batch and every decode step,
  so it is the one watched.
* The simulator exports vLLM's names with vLLM's semantics.

``tests/fixtures/metrics/`` holds a scraped series of each engine's page for
the cases that matter; the tests run the check over them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmgw.agent.liveness import Liveness
from llmgw.promkit import sum_samples

# vLLM's /metrics is a few hundred lines of histograms; one scrape reads only
# the lines of the three series it needs, so a cap on the body is enough.
MAX_METRICS_BYTES = 4 * 1024 * 1024


class ProgressMetrics(BaseModel):
    """Where an engine exports its load and its work, and under which names.

    Persisted with the engine's record, so an adopted engine is checked too.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str = "/metrics"
    running: str = Field(min_length=1)  # gauge: requests being computed now
    # Counters that move while the engine computes; any one moving is progress.
    counters: tuple[str, ...] = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _from_older_records(cls, data: Any) -> Any:
        """Records written before ``counters`` named ``generation`` and ``prompt``.

        An SGLang engine adopted from such a record gets today's counter: its
        old ones are exactly those that only move when a request finishes.
        """
        if not isinstance(data, dict) or "counters" in data:
            return data
        data = dict(data)
        legacy = tuple(data.pop(key) for key in ("generation", "prompt") if key in data)
        if data.get("running") == SGLANG_RUNNING:
            legacy = (SGLANG_REALTIME,)
        return {**data, "counters": legacy}


SGLANG_RUNNING = "sglang:num_running_reqs"
SGLANG_REALTIME = "sglang:realtime_tokens_total"

VLLM_METRICS = ProgressMetrics(
    running="vllm:num_requests_running",
    counters=("vllm:generation_tokens_total", "vllm:prompt_tokens_total"),
)
SGLANG_METRICS = ProgressMetrics(running=SGLANG_RUNNING, counters=(SGLANG_REALTIME,))
# With --metrics (tools/server/server-task.cpp): llama_decode() calls, one per
# batch of prompt or generated tokens, so it moves while a request computes,
# not only when one ends as tokens_predicted_total does.
LLAMA_SERVER_METRICS = ProgressMetrics(
    running="llamacpp:requests_processing", counters=("llamacpp:n_decode_total",)
)


class MetricsError(ValueError):
    """A metrics page that lacks a needed series or holds an unreadable value."""


def read_samples(text: str, names: Iterable[str]) -> dict[str, float]:
    """Each named series' value, summed over its label sets (e.g. one per data-parallel rank).

    A name with no sample is an error: a page that lacks the running gauge
    must not read as idle.
    """
    wanted = set(names)
    totals = _sum_series(text, wanted)
    missing = sorted(wanted - totals.keys())
    if missing:
        raise MetricsError(f"no {', '.join(missing)} in the metrics")
    return totals


def read_progress(text: str, metrics: ProgressMetrics) -> tuple[float, tuple[float, ...]]:
    """The running gauge and the counters' values that one scrape shows.

    A labelled Prometheus counter has no sample until it first counts (SGLang's
    realtime counter is absent until the first batch), so a missing counter
    reads as 0 while another one is there. With none of them there the scrape
    is an error and counts for nothing: a renamed counter must never read as
    one that stands still, which would kill every busy engine.
    """
    totals = _sum_series(text, {metrics.running, *metrics.counters})
    if metrics.running not in totals:
        raise MetricsError(f"no {metrics.running} in the metrics")
    if not any(name in totals for name in metrics.counters):
        raise MetricsError(f"none of {', '.join(metrics.counters)} in the metrics yet")
    return totals[metrics.running], tuple(totals.get(name, 0.0) for name in metrics.counters)


def _sum_series(text: str, wanted: set[str]) -> dict[str, float]:
    try:
        totals = sum_samples(text, wanted)
    except ValueError as exc:
        raise MetricsError(f"metric line with a bad value or labels: {exc}") from None
    for name, value in totals.items():
        if math.isnan(value):
            raise MetricsError(f"metric {name} is NaN")
    return totals


class StallWatch:
    """Whether one engine's token counters moved while it had requests running."""

    def __init__(self, liveness: Liveness) -> None:
        self.liveness = liveness
        self.running = 0.0
        self._counters: tuple[float, ...] | None = None
        self._since: float | None = None  # monotonic: first scrape of the still run
        self._since_wall = 0.0
        self._confirmed = False  # a later scrape saw the same counters, work still running

    def observe(
        self, running: float, counters: Sequence[float], now: float, wall: float | None = None
    ) -> None:
        """One scrape's values; ``now`` is monotonic, ``wall`` the same moment as time.time()."""
        self.running = running
        values = tuple(counters)
        if running <= 0 or values != self._counters:
            # Idle, or it counted tokens since the last scrape: no stall. A
            # still run starts at the first scrape that saw these counters
            # with work running, not earlier: the work may have just arrived.
            self._counters = values
            self._since = None
            self._confirmed = False
            if running > 0:
                self._start(now, wall)
        elif self._since is None:
            self._start(now, wall)
        else:
            self._confirmed = True

    def _start(self, now: float, wall: float | None) -> None:
        self._since = now
        self._since_wall = time.time() if wall is None else wall
        self._confirmed = False

    @property
    def stalling(self) -> bool:
        """Work running and the same counters on two scrapes or more."""
        return self._confirmed

    def still_for(self, now: float) -> float:
        return now - self._since if self._since is not None and self._confirmed else 0.0

    def stalled(self, now: float) -> bool:
        return self._confirmed and self.still_for(now) >= self.liveness.stall_window_s

    def stalling_reason(self) -> str:
        """What a replica still routed to says while its counters stand still."""
        since = time.strftime("%H:%M:%S", time.gmtime(self._since_wall))
        return f"no progress since {since} UTC: {self._tally()}"

    def stalled_reason(self, now: float) -> str:
        """Why a stalled engine was killed."""
        seconds = self.still_for(now)
        return f"engine made no progress for {seconds:.0f} s with {self._tally()}; killed"

    def _tally(self) -> str:
        requests = "request" if self.running == 1 else "requests"
        return f"{self.running:g} {requests} running (token counters unchanged)"
