"""Small pieces the parts share for metrics: a cheap histogram, the token check, a page read.

prometheus_client's own metric objects take a lock and check labels on every
update; the parts of llmgw count from one event loop, so an observation here
is a bisect and two additions, and the cost of building families is paid by
the scraper, not by the code being measured (see gateway/metrics.py for the
same choice on the gateway's hot path).
"""

from __future__ import annotations

import hmac
from bisect import bisect_left
from collections.abc import Iterable, Mapping
from typing import TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from llmgw import secrets

# The classic text format, which generate_latest writes (prometheus_client's
# CONTENT_TYPE_LATEST names version 1.0.0 from 0.22 on, which it does not write).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Histogram:
    __slots__ = ("buckets", "counts", "total")

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.total += value

    def family_points(self) -> tuple[list[tuple[str, float]], float]:
        """Cumulative (upper bound, count) pairs ending with +Inf, and the sum."""
        points: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip(self.buckets, self.counts, strict=False):
            running += count
            points.append((repr(float(bound)), running))
        running += self.counts[-1]
        points.append(("+Inf", running))
        return points, self.total

    def family(self, name: str, documentation: str) -> HistogramMetricFamily:
        """This histogram as a family of one unlabelled sample."""
        family = HistogramMetricFamily(name, documentation)
        points, total = self.family_points()
        family.add_metric([], points, total)
        return family


_Family = TypeVar("_Family", CounterMetricFamily, GaugeMetricFamily)


def filled(family: _Family, values: Mapping[str, int] | Mapping[tuple[str, str], int]) -> _Family:
    """``family`` with one sample per entry; a key is the label value (a tuple: the values)."""
    # A copy of the items: the counters may change while a scrape renders them.
    for key, value in list(values.items()):
        family.add_metric([key] if isinstance(key, str) else list(key), value)
    return family


def scrape_allowed(authorization: str | None, expected: str | None) -> bool:
    """Whether a scrape may read /metrics: always without a metrics token, else its bearer.

    Metrics name every model, node and device and show the traffic; on a
    shared network they are for the monitoring system, not for anyone.
    """
    if expected is None:
        return True
    given = secrets.bearer(authorization)
    return given is not None and hmac.compare_digest(given, expected)


def sum_samples(text: str, names: Iterable[str]) -> dict[str, float]:
    """Each named sample's value summed over its label sets, from a page in the text format.

    Only the lines that begin with a wanted name go to prometheus_client's
    parser: an engine's page is mostly histograms nobody here reads, so this
    keeps a scrape cheap (the agent reads every engine's page at each liveness
    interval), and a line of another series cannot make the page unreadable.
    A name with no sample is absent from the result; a wanted line the parser
    cannot read raises ValueError.
    """
    wanted = set(names)
    prefixes = tuple(wanted)
    lines = [line for line in text.splitlines() if line.startswith(prefixes)]
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families("\n".join(lines)):
        for sample in family.samples:
            if sample.name in wanted:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals
