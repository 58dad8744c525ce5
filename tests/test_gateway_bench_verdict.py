"""bench/gateway.py's max_rps_p99_under_50ms on made-up rows: a failed lower rate caps it."""

from __future__ import annotations

from typing import Any

from tests import benchscripts


def _row(rate: int, *, p99: float = 2.0, errors: int = 0, achieved: float | None = None
         ) -> dict[str, Any]:
    return {"rate": rate, "added_p99_ms": p99, "errors": errors,
            "achieved_rps": rate if achieved is None else achieved}


def test_every_rate_held() -> None:
    bench = benchscripts.load("gateway")
    rows = [_row(r) for r in (100, 500, 1000, 2000, 2500)]
    assert bench.max_rate_held(rows) == (2500, "not reached")


def test_a_failed_fixed_rate_caps_the_figure_whatever_a_higher_rate_did() -> None:
    bench = benchscripts.load("gateway")
    rows = [_row(100), _row(500), _row(1000, p99=61.0), _row(2000), _row(2500)]
    assert bench.max_rate_held(rows) == (500, "p99 added >= 50 ms")
    rows = [_row(100), _row(500, errors=3), _row(1000)]
    assert bench.max_rate_held(rows) == (100, "errors")
    rows = [_row(100, achieved=80.0), _row(500)]
    assert bench.max_rate_held(rows) == (0, "rate not reached")


def test_rows_are_judged_in_rate_order() -> None:
    bench = benchscripts.load("gateway")
    rows = [_row(2500), _row(100), _row(2000, p99=70.0), _row(1000)]
    assert bench.max_rate_held(rows) == (1000, "p99 added >= 50 ms")


def _result(*rows: tuple[int, float]) -> dict[str, Any]:
    return {"rows": [{"rate": rate, "cpu_ms_per_request": cpu, "added_p50_ms": 0.2,
                      "added_p99_ms": 1.0, "errors": 0, "achieved_rps": rate}
                     for rate, cpu in rows]}


def test_peer_comparison_takes_the_lowest_peer_and_reports_a_skipped_one() -> None:
    bench = benchscripts.load("gateway")
    mine = _result((1000, 0.15), (2000, 0.12))
    peers = {"vllm-router": _result((1000, 0.14), (2000, 0.08)),
             "sglang-router": _result((1000, 0.10), (2000, 0.10)),
             "other": {"skipped": "not installed"}}
    out = bench.compare(mine, peers)
    assert out["cpu_ratio_to_best_peer_at_1000"] == 1.5
    assert out["cpu_ratio_to_best_peer_at_2000"] == 1.5
    assert out["systems"]["llmgw"]["1000"]["cpu_ms_per_request"] == 0.15
    assert out["systems"]["sglang-router"]["2000"]["added_p99_ms"] == 1.0
    assert out["systems"]["other"] == {"skipped": "not installed"}


def test_no_ratio_without_a_measured_peer() -> None:
    bench = benchscripts.load("gateway")
    out = bench.compare(_result((1000, 0.15)), {"vllm-router": {"skipped": "no"}})
    assert out["cpu_ratio_to_best_peer_at_1000"] is None
    assert out["cpu_ratio_to_best_peer_at_2000"] is None
