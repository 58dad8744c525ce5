"""Prometheus metrics of one gateway: plain counters on the hot path, rendered on scrape.

prometheus_client's metric objects take a lock and validate labels on every
update; with ~10 updates per request that was several percent of the
gateway's CPU. Here an update is a dict lookup and an addition (the event
loop is single-threaded, so no lock is needed), and a custom collector turns
the numbers into Prometheus families only when /metrics is scraped. A
registry per Gateway lets several gateways share a process (tests, `llmgw up`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from llmgw import promkit
from llmgw.promkit import Histogram, filled

CONTENT_TYPE = promkit.CONTENT_TYPE.encode()

LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05)


class GatewayMetrics:
    def __init__(self, waiting: Callable[[], dict[str, int]] | None = None) -> None:
        self.requests: dict[tuple[str, str], int] = {}
        self.tokens_by: dict[tuple[str, str], int] = {}
        self.routing: dict[tuple[str, str], int] = {}
        self.retries: dict[str, int] = {}
        self.in_flight_by: dict[str, int] = {}
        self.ttft_by: dict[str, Histogram] = {}
        self.latency_by: dict[str, Histogram] = {}
        self.overhead_hist = Histogram(OVERHEAD_BUCKETS)
        self.config_version = 0
        self._waiting = waiting or dict
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Exporter(self))

    # -- hot path --------------------------------------------------------------

    def request(self, model: str, status: int) -> None:
        key = (model, str(status))
        self.requests[key] = self.requests.get(key, 0) + 1

    def ttft(self, model: str, seconds: float) -> None:
        _observe(self.ttft_by, model, seconds)

    def latency(self, model: str, seconds: float) -> None:
        _observe(self.latency_by, model, seconds)

    def overhead(self, seconds: float) -> None:
        self.overhead_hist.observe(seconds)

    def tokens(self, model: str, prompt: int, completion: int, cached: int) -> None:
        # Unrolled: once per answer, and a loop over three tuples cost more than the counting.
        tokens = self.tokens_by
        if prompt:
            key = (model, "prompt")
            tokens[key] = tokens.get(key, 0) + prompt
        if completion:
            key = (model, "completion")
            tokens[key] = tokens.get(key, 0) + completion
        if cached:
            key = (model, "cached")
            tokens[key] = tokens.get(key, 0) + cached

    def in_flight(self, model: str, delta: int) -> None:
        self.in_flight_by[model] = self.in_flight_by.get(model, 0) + delta

    def routed(self, model: str, outcome: str) -> None:
        key = (model, outcome)
        self.routing[key] = self.routing.get(key, 0) + 1

    def retried(self, model: str) -> None:
        self.retries[model] = self.retries.get(model, 0) + 1

    # -- scrape ----------------------------------------------------------------

    def waiting(self) -> dict[str, int]:
        return self._waiting()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _observe(by_model: dict[str, Histogram], model: str, seconds: float) -> None:
    histogram = by_model.get(model)
    if histogram is None:
        histogram = by_model[model] = Histogram(LATENCY_BUCKETS)
    histogram.observe(seconds)


class _Exporter(Collector):
    """Turns the plain numbers into Prometheus families at scrape time."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._m
        yield filled(CounterMetricFamily(
            "llmgw_gateway_requests", "Requests answered, by model and HTTP status.",
            labels=["model", "status"],
        ), m.requests)  # fmt: skip
        for name, doc, source in (
            ("llmgw_gateway_time_to_first_token_seconds",
             "From request arrival to the first body byte of a streamed answer.", m.ttft_by),
            ("llmgw_gateway_request_seconds",
             "From request arrival to the end of the answer.", m.latency_by),
        ):  # fmt: skip
            family = HistogramMetricFamily(name, doc, labels=["model"])
            for model, histogram in list(source.items()):
                points, total = histogram.family_points()
                family.add_metric([model], points, total)
            yield family
        yield m.overhead_hist.family(
            "llmgw_gateway_overhead_seconds",
            "Time the gateway itself added (excludes the engine and on-demand waiting).",
        )
        yield filled(CounterMetricFamily(
            "llmgw_gateway_tokens", "Tokens by model and kind (prompt, completion, cached).",
            labels=["model", "kind"],
        ), m.tokens_by)  # fmt: skip
        yield filled(GaugeMetricFamily(
            "llmgw_gateway_in_flight", "Requests in flight upstream, by model.", labels=["model"]
        ), m.in_flight_by)  # fmt: skip
        yield filled(CounterMetricFamily(
            "llmgw_gateway_prefix_routing",
            "Routing decisions by outcome: hit (cached prefix), miss (new prefix),"
            " overloaded (a holder too busy: another replica was estimated to answer"
            " sooner), none (prefixes not looked at: another policy, no prompt, one replica).",
            labels=["model", "outcome"],
        ), m.routing)  # fmt: skip
        yield filled(CounterMetricFamily(
            "llmgw_gateway_upstream_retries", "Requests retried on another replica.",
            labels=["model"],
        ), m.retries)  # fmt: skip
        yield filled(GaugeMetricFamily(
            "llmgw_gateway_waiting", "Requests waiting for an on-demand replica.", labels=["model"]
        ), m.waiting())  # fmt: skip
        yield GaugeMetricFamily(
            "llmgw_gateway_config_version", "Routing version in use.", value=m.config_version
        )
