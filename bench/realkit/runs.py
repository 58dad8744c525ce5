"""Repeated runs of one router on real engines: pooled figures and their spread.

A real engine run moves from one run to the next by more than a router's
edge on a tie, so the real-engine benchmarks repeat each router and judge
the means, with each figure's range as the control spread.
"""

from __future__ import annotations

import statistics
from typing import Any

FIGURES = ("hit_rate", "ttft_p50_s", "ttft_mean_s", "ttft_p90_s")


def pooled(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs of one router: the mean of each figure, its range, and the runs."""
    out: dict[str, Any] = {}
    for name in FIGURES:
        values = [row[name] for row in rows if row[name] is not None]
        out[name] = round(statistics.fmean(values), 4) if values else None
        out[f"{name}_range"] = [min(values), max(values)] if values else None
    out["errors"] = sum(row["errors"] for row in rows)
    out["runs"] = rows
    return out


def spread(bounds: list[float] | None) -> float:
    """The width of a pooled figure's range (0 for a single run)."""
    return round(bounds[1] - bounds[0], 4) if bounds else 0.0
