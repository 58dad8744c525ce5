"""Numbers of a routing benchmark, as pure functions of what was measured.

Kept apart from the load generator so each rule (which percentile, what
counts as saturated, how throughput is windowed, how a hit rate is read off
engine counters) is tested on its own, without sockets or clocks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from llmgw.promkit import sum_samples

# The engines' counters (prometheus-client adds _total to counter names).
HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
# Round-robin is saturated once its TTFT p90 exceeds this multiple of its p90
# at the lowest rate: queues then grow for as long as the rate lasts.
SATURATION_FACTOR = 10.0


@dataclass(frozen=True)
class RequestResult:
    """One request as the client saw it; times are seconds since the run began."""

    index: int
    stage: int
    sent_at: float
    first_token_at: float | None = None
    done_at: float | None = None
    output_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.sent_at


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation; None for no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within 0..100, got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def ttfts(results: Iterable[RequestResult], censor_at: float) -> list[float]:
    """TTFT of every request; one that never got a token counts as waiting until
    ``censor_at`` (dropping it would make an overloaded router look fast)."""
    out = []
    for r in results:
        if r.first_token_at is not None:
            out.append(r.first_token_at - r.sent_at)
        elif r.error is None or r.error == "unfinished":
            out.append(max(0.0, censor_at - r.sent_at))
    return out


def output_rate(results: Iterable[RequestResult], start: float, end: float) -> float:
    """Output tokens/s produced within [start, end).

    Each request's tokens are spread evenly between its first token and its
    end, so a stage is credited with what was generated during it, not with
    what was asked for during it (an overloaded router finishes its work later).
    """
    if end <= start:
        return 0.0
    produced = 0.0
    for r in results:
        if r.first_token_at is None or r.output_tokens <= 0:
            continue
        first = r.first_token_at
        last = r.done_at if r.done_at is not None else first
        if last <= first:
            if start <= first < end:
                produced += r.output_tokens
            continue
        overlap = min(end, last) - max(start, first)
        if overlap > 0:
            produced += r.output_tokens * overlap / (last - first)
    return produced / (end - start)


def parse_counters(text: str, names: Iterable[str] = (HITS, QUERIES)) -> dict[str, float]:
    """Sum of each named metric over its label sets, from Prometheus text format (0 if absent)."""
    wanted = tuple(names)
    return {**dict.fromkeys(wanted, 0.0), **sum_samples(text, wanted)}


def hit_rate(before: Mapping[str, float], after: Mapping[str, float]) -> float | None:
    """Prompt tokens found cached / prompt tokens looked up, between two scrapes."""
    queries = after.get(QUERIES, 0.0) - before.get(QUERIES, 0.0)
    if queries <= 0:
        return None
    return (after.get(HITS, 0.0) - before.get(HITS, 0.0)) / queries


def add_counters(parts: Iterable[Mapping[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for part in parts:
        for name, value in part.items():
            total[name] = total.get(name, 0.0) + value
    return total


def saturation_rate(by_rate: Sequence[tuple[float, float | None]]) -> float | None:
    """The first rate whose TTFT p90 exceeds SATURATION_FACTOR x the lowest rate's.

    ``by_rate`` is (rate, p90) in ladder order; None when it never saturates.
    """
    measured = [(rate, p90) for rate, p90 in by_rate if p90 is not None]
    if not measured:
        return None
    base = min(measured, key=lambda item: item[0])[1]
    for rate, p90 in measured:
        if p90 > SATURATION_FACTOR * base:
            return rate
    return None
