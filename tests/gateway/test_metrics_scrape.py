"""The gateway's scrape after a mix of requests: every family, label set and value."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from llmgw.gateway.metrics import LATENCY_BUCKETS, OVERHEAD_BUCKETS, GatewayMetrics

Sample = tuple[str, tuple[tuple[str, str], ...]]


def scraped(metrics: GatewayMetrics) -> tuple[dict[str, str], dict[Sample, float]]:
    """(family name -> type, sample -> value) of one scrape."""
    types: dict[str, str] = {}
    values: dict[Sample, float] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        types[family.name] = family.type
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            assert key not in values, key
            values[key] = sample.value
    return types, values


def histogram(
    name: str, buckets: tuple[float, ...], observed: list[float], model: str | None
) -> dict[Sample, float]:
    labels = () if model is None else (("model", model),)
    out: dict[Sample, float] = {}
    for bound in buckets:
        count = sum(1 for value in observed if value <= bound)
        out[(f"{name}_bucket", tuple(sorted((*labels, ("le", repr(bound))))))] = count
    out[(f"{name}_bucket", tuple(sorted((*labels, ("le", "+Inf")))))] = len(observed)
    out[(f"{name}_count", labels)] = len(observed)
    out[(f"{name}_sum", labels)] = sum(observed)
    return out


def test_a_scrape_after_a_mix_of_requests() -> None:
    metrics = GatewayMetrics(waiting=lambda: {"sleepy": 2}, held=lambda: {"a": 3})
    metrics.config_version = 9
    # Model a: two answered (one streamed, one retried first), one refused
    # by its engine; model b: one answered without usage; an unknown model.
    for model, status, seconds in (("a", 200, 0.3), ("a", 200, 1.5), ("a", 502, 0.02),
                                   ("b", 200, 7.0), ("-", 404, 0.001)):  # fmt: skip
        if model != "-":
            metrics.routed(model, "hit" if status == 200 and model == "a" else "none")
            metrics.in_flight(model, 1)
            metrics.in_flight(model, -1)
        metrics.request(model, status)
        metrics.latency(model, seconds)
    metrics.in_flight("a", 1)  # one still in flight
    metrics.retried("a")
    metrics.ttft("a", 0.04)
    metrics.tokens("a", 100, 20, 64)
    metrics.tokens("a", 50, 5, 0)
    metrics.tokens("b", 0, 0, 0)  # nothing counted: no sample
    for seconds in (0.00005, 0.0003, 0.02):
        metrics.overhead(seconds)

    types, values = scraped(metrics)
    assert types == {
        "llmgw_gateway_requests": "counter",
        "llmgw_gateway_time_to_first_token_seconds": "histogram",
        "llmgw_gateway_request_seconds": "histogram",
        "llmgw_gateway_overhead_seconds": "histogram",
        "llmgw_gateway_tokens": "counter",
        "llmgw_gateway_in_flight": "gauge",
        "llmgw_gateway_prefix_routing": "counter",
        "llmgw_gateway_upstream_retries": "counter",
        "llmgw_gateway_waiting": "gauge",
        "llmgw_gateway_held": "gauge",
        "llmgw_gateway_config_version": "gauge",
    }
    expected: dict[Sample, float] = {
        ("llmgw_gateway_requests_total", (("model", "a"), ("status", "200"))): 2,
        ("llmgw_gateway_requests_total", (("model", "a"), ("status", "502"))): 1,
        ("llmgw_gateway_requests_total", (("model", "b"), ("status", "200"))): 1,
        ("llmgw_gateway_requests_total", (("model", "-"), ("status", "404"))): 1,
        ("llmgw_gateway_tokens_total", (("kind", "prompt"), ("model", "a"))): 150,
        ("llmgw_gateway_tokens_total", (("kind", "completion"), ("model", "a"))): 25,
        ("llmgw_gateway_tokens_total", (("kind", "cached"), ("model", "a"))): 64,
        ("llmgw_gateway_in_flight", (("model", "a"),)): 1,
        ("llmgw_gateway_in_flight", (("model", "b"),)): 0,
        ("llmgw_gateway_prefix_routing_total", (("model", "a"), ("outcome", "hit"))): 2,
        ("llmgw_gateway_prefix_routing_total", (("model", "a"), ("outcome", "none"))): 1,
        ("llmgw_gateway_prefix_routing_total", (("model", "b"), ("outcome", "none"))): 1,
        ("llmgw_gateway_upstream_retries_total", (("model", "a"),)): 1,
        ("llmgw_gateway_waiting", (("model", "sleepy"),)): 2,
        ("llmgw_gateway_held", (("model", "a"),)): 3,
        ("llmgw_gateway_config_version", ()): 9,
    }
    name = "llmgw_gateway_request_seconds"
    expected |= histogram(name, LATENCY_BUCKETS, [0.3, 1.5, 0.02], "a")
    expected |= histogram(name, LATENCY_BUCKETS, [7.0], "b")
    expected |= histogram(name, LATENCY_BUCKETS, [0.001], "-")
    name = "llmgw_gateway_time_to_first_token_seconds"
    expected |= histogram(name, LATENCY_BUCKETS, [0.04], "a")
    name = "llmgw_gateway_overhead_seconds"
    expected |= histogram(name, OVERHEAD_BUCKETS, [0.00005, 0.0003, 0.02], None)
    assert values.keys() == expected.keys()
    for key, value in expected.items():
        assert values[key] == value or abs(values[key] - value) < 1e-9, key
