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


class ModelCounters:
    """One model's numbers. A request holds its model's (Call.counters), so an
    update on its way is an attribute addition: no call, no key built."""

    __slots__ = ("cached", "completion", "in_flight", "latency", "outcomes", "prompt",
                 "retries", "statuses", "ttft")  # fmt: skip

    def __init__(self) -> None:
        self.statuses: dict[int, int] = {}  # answers by HTTP status
        self.prompt = 0
        self.completion = 0
        self.cached = 0
        self.in_flight = 0
        self.outcomes: dict[str, int] = {}  # routing decisions (routing.HIT...)
        self.retries = 0
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.latency = Histogram(LATENCY_BUCKETS)


class GatewayMetrics:
    def __init__(
        self,
        waiting: Callable[[], dict[str, int]] | None = None,
        held: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        self.by_model: dict[str, ModelCounters] = {}
        self.overhead_hist = Histogram(OVERHEAD_BUCKETS)
        self.config_version = 0
        # (this worker's index, how many) when a --workers parent started it:
        # each worker counts only its own requests, and says which it is.
        self.worker: tuple[int, int] | None = None
        self._waiting = waiting or dict
        self.held = held or dict  # requests in saturated models' hold queues
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Exporter(self))

    # -- hot path --------------------------------------------------------------

    def model(self, model: str) -> ModelCounters:
        """``model``'s counters, made on first use."""
        counters = self.by_model.get(model)
        if counters is None:
            counters = self.by_model[model] = ModelCounters()
        return counters

    def finished(self, model: str, status: int, seconds: float) -> None:
        """A request answered (or refused) with ``status`` after ``seconds``."""
        counters = self.by_model.get(model) or self.model(model)
        statuses = counters.statuses
        statuses[status] = statuses.get(status, 0) + 1
        counters.latency.observe(seconds)

    def overhead(self, seconds: float) -> None:
        self.overhead_hist.observe(seconds)

    # The same, one number at a time (tests, rare paths).

    def request(self, model: str, status: int) -> None:
        statuses = self.model(model).statuses
        statuses[status] = statuses.get(status, 0) + 1

    def ttft(self, model: str, seconds: float) -> None:
        self.model(model).ttft.observe(seconds)

    def latency(self, model: str, seconds: float) -> None:
        self.model(model).latency.observe(seconds)

    def tokens(self, model: str, prompt: int, completion: int, cached: int) -> None:
        counters = self.model(model)
        counters.prompt += prompt
        counters.completion += completion
        counters.cached += cached

    def in_flight(self, model: str, delta: int) -> None:
        self.model(model).in_flight += delta

    def routed(self, model: str, outcome: str) -> None:
        outcomes = self.model(model).outcomes
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    def retried(self, model: str) -> None:
        self.model(model).retries += 1

    # -- scrape ----------------------------------------------------------------

    def waiting(self) -> dict[str, int]:
        return self._waiting()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Exporter(Collector):
    """Turns the plain numbers into Prometheus families at scrape time."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._m
        # A copy: requests may add models while a scrape renders them. A
        # sample appears once there is something to count, as it did with
        # one dict per family: a status once answered, a histogram once
        # observed, a kind of token once counted, the in-flight gauge once
        # the model was routed to (each request in flight was), a retry count
        # once retried.
        models = list(m.by_model.items())
        requests = CounterMetricFamily(
            "llmgw_gateway_requests", "Requests answered, by model and HTTP status.",
            labels=["model", "status"],
        )  # fmt: skip
        for model, counters in models:
            for status, count in list(counters.statuses.items()):
                requests.add_metric([model, str(status)], count)
        yield requests
        if m.worker is not None:
            worker = GaugeMetricFamily(
                "llmgw_gateway_worker",
                "This scrape's worker of a gateway served by several (llmgw gateway --workers):"
                " its counts are its own requests only.", labels=["worker", "workers"],
            )  # fmt: skip
            worker.add_metric([str(m.worker[0]), str(m.worker[1])], 1)
            yield worker
        yield from _latencies(models)
        yield m.overhead_hist.family(
            "llmgw_gateway_overhead_seconds",
            "Time the gateway itself added (excludes the engine and on-demand waiting).",
        )
        yield from _model_counts(models)
        yield filled(GaugeMetricFamily(
            "llmgw_gateway_waiting", "Requests waiting for an on-demand replica.", labels=["model"]
        ), m.waiting())  # fmt: skip
        yield filled(GaugeMetricFamily(
            "llmgw_gateway_held", "Requests held while the model's replicas are at capacity.",
            labels=["model"],
        ), m.held())  # fmt: skip
        yield GaugeMetricFamily(
            "llmgw_gateway_config_version", "Routing version in use.", value=m.config_version
        )


def _latencies(models: list[tuple[str, ModelCounters]]) -> Iterator[Metric]:
    """Each model's time to first token and request time, as histograms."""
    for name, doc, attribute in (
        ("llmgw_gateway_time_to_first_token_seconds",
         "From request arrival to the first body byte of a streamed answer.", "ttft"),
        ("llmgw_gateway_request_seconds",
         "From request arrival to the end of the answer.", "latency"),
    ):  # fmt: skip
        family = HistogramMetricFamily(name, doc, labels=["model"])
        for model, counters in models:
            histogram: Histogram = getattr(counters, attribute)
            if any(histogram.counts):
                points, total = histogram.family_points()
                family.add_metric([model], points, total)
        yield family


def _model_counts(models: list[tuple[str, ModelCounters]]) -> Iterator[Metric]:
    """Each model's tokens, requests in flight, routing outcomes and retries."""
    tokens = CounterMetricFamily(
        "llmgw_gateway_tokens", "Tokens by model and kind (prompt, completion, cached).",
        labels=["model", "kind"],
    )  # fmt: skip
    in_flight = GaugeMetricFamily(
        "llmgw_gateway_in_flight", "Requests in flight upstream, by model.", labels=["model"]
    )  # fmt: skip
    routing = CounterMetricFamily(
        "llmgw_gateway_prefix_routing",
        "Routing decisions by outcome: hit (cached prefix), miss (new prefix),"
        " overloaded (a holder too busy: another replica was estimated to answer"
        " sooner), none (prefixes not looked at: another policy, no prompt, one replica).",
        labels=["model", "outcome"],
    )  # fmt: skip
    retries = CounterMetricFamily(
        "llmgw_gateway_upstream_retries", "Requests retried on another replica.",
        labels=["model"],
    )  # fmt: skip
    for model, counters in models:
        for kind, count in (("prompt", counters.prompt),
                            ("completion", counters.completion),
                            ("cached", counters.cached)):  # fmt: skip
            if count:
                tokens.add_metric([model, kind], count)
        outcomes = list(counters.outcomes.items())
        if outcomes or counters.in_flight:
            in_flight.add_metric([model], counters.in_flight)
        for outcome, count in outcomes:
            routing.add_metric([model, outcome], count)
        if counters.retries:
            retries.add_metric([model], counters.retries)
    yield tokens
    yield in_flight
    yield routing
    yield retries
