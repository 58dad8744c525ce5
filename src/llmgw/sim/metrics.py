"""Prometheus metrics of a simulated engine, under vLLM's names.

Routers and dashboards built for vLLM read these names (queue sizes, KV
usage, prefix-cache hits), so the simulator speaks them exactly; a router
tested against other names would be tested against nothing real.

The values live in the engine core as plain ints; a collector reads them at
scrape time. That costs nothing per request, where prometheus_client's own
Counter objects would take a lock on every token.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from llmgw.sim.core import TTFT_BUCKETS, EngineCore

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _CoreCollector(Collector):
    def __init__(self, model: str, core: EngineCore) -> None:
        self._model = model
        self._core = core

    def collect(self) -> Iterator[Metric]:
        core, labels, model = self._core, ["model_name"], [self._model]
        c = core.counters

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(model, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            m = CounterMetricFamily(name, doc, labels=labels)
            m.add_metric(model, value)
            return m

        yield gauge("vllm:num_requests_running", "Requests in prefill or decode.", core.running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be admitted.", core.waiting)
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "Fraction of KV blocks pinned by running requests (1 = full).",
            core.kv.usage,
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            c.prefix_queries,
        )
        yield counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", c.prefix_hits
        )
        yield counter("vllm:prompt_tokens", "Prompt tokens admitted.", c.prompt_tokens)
        yield counter("vllm:generation_tokens", "Output tokens produced.", c.generation_tokens)
        yield counter("vllm:request_success", "Requests finished.", c.finished)
        yield counter("vllm:num_preemptions", "Requests preempted (never, here).", 0)
        h = HistogramMetricFamily(
            "vllm:time_to_first_token_seconds", "Time to first token.", labels=labels
        )
        cumulative, buckets = 0, []
        for bound, n in zip((*TTFT_BUCKETS, float("inf")), c.ttft_buckets, strict=True):
            cumulative += n
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        h.add_metric(model, buckets, c.ttft_sum)
        yield h


def make_registry(model: str, core: EngineCore) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_CoreCollector(model, core))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
