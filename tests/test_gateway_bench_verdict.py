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
