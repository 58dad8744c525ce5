"""Prometheus metrics of one gateway, in a registry of its own.

A registry per Gateway (not the global default) lets several gateways live in
one process (tests, `llmgw up`) without "duplicated timeseries" errors.
Labelled children are cached in plain dicts: prometheus_client's ``labels()``
takes a lock and validates on every call, which is measurable on the hot path.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._requests = Counter(
            "llmgw_gateway_requests",
            "Requests answered, by model and HTTP status.",
            ["model", "status"],
            registry=r,
        )
        self._ttft = Histogram(
            "llmgw_gateway_time_to_first_token_seconds",
            "From request arrival to the first byte of the upstream answer.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self._latency = Histogram(
            "llmgw_gateway_request_seconds",
            "From request arrival to the end of the answer.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self._overhead = Histogram(
            "llmgw_gateway_overhead_seconds",
            "Time the gateway itself added (excludes upstream and on-demand waiting).",
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        self._tokens = Counter(
            "llmgw_gateway_tokens",
            "Tokens by model and kind (prompt, completion, cached).",
            ["model", "kind"],
            registry=r,
        )
        self._in_flight = Gauge(
            "llmgw_gateway_in_flight",
            "Requests in flight upstream, by model.",
            ["model"],
            registry=r,
        )
        self._routing = Counter(
            "llmgw_gateway_prefix_routing",
            "Routing decisions by outcome: hit (cached prefix), miss (new prefix),"
            " overloaded (holder too loaded), none (policy ignores prefixes).",
            ["model", "outcome"],
            registry=r,
        )
        self._retries = Counter(
            "llmgw_gateway_upstream_retries",
            "Requests retried on another replica.",
            ["model"],
            registry=r,
        )
        self.waiting = Gauge(
            "llmgw_gateway_waiting",
            "Requests waiting for an on-demand replica.",
            ["model"],
            registry=r,
        )
        self.config_version = Gauge(
            "llmgw_gateway_config_version", "Routing version in use.", registry=r
        )
        self._children: dict[tuple[str, ...], Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (metric._name, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def request(self, model: str, status: int) -> None:
        self._child(self._requests, model, str(status)).inc()

    def ttft(self, model: str, seconds: float) -> None:
        self._child(self._ttft, model).observe(seconds)

    def latency(self, model: str, seconds: float) -> None:
        self._child(self._latency, model).observe(seconds)

    def overhead(self, seconds: float) -> None:
        self._overhead.observe(seconds)

    def tokens(self, model: str, prompt: int, completion: int, cached: int) -> None:
        if prompt:
            self._child(self._tokens, model, "prompt").inc(prompt)
        if completion:
            self._child(self._tokens, model, "completion").inc(completion)
        if cached:
            self._child(self._tokens, model, "cached").inc(cached)

    def in_flight(self, model: str, delta: int) -> None:
        self._child(self._in_flight, model).inc(delta)

    def routed(self, model: str, outcome: str) -> None:
        self._child(self._routing, model, outcome).inc()

    def retried(self, model: str) -> None:
        self._child(self._retries, model).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
