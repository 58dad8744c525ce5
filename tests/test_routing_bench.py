"""The routing benchmark (bench/routing.py): how it judges, and one short real run.

Issue 16's first target -- prefix routing's TTFT p90 at or below
round-robin's and least-loaded's at every rate -- is read by the benchmark
itself; these tests hold that reading to the target (no tolerance), and
the control policy (round-robin a second time) to what it reports: the
spread between two runs of one policy, the run's own noise.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from tests import benchscripts

ROOT = Path(__file__).resolve().parent.parent


def _routing() -> ModuleType:
    return benchscripts.load("routing")


def _policy(p90s: dict[str, float | None]) -> dict[str, Any]:
    return {
        "rates": {rate: {"ttft_p90_s": p90} for rate, p90 in p90s.items()},
        "hit_rate_all": 0.5,
    }


def _simpler() -> dict[str, dict[str, Any]]:
    """The simpler policies' TTFT p90s at rates 4 and 8 that prefix routing is judged by."""
    return {
        "round_robin": _policy({"4": 0.3590, "8": 0.3760}),
        "least_loaded": _policy({"4": 0.3600, "8": 0.3750}),
    }


def test_prefix_above_the_lower_simpler_policy_at_one_rate_fails_with_its_margin() -> None:
    routing = _routing()
    results = {
        **_simpler(),
        "prefix": _policy({"4": 0.3593, "8": 0.3590}),
        "round_robin_again": _policy({"4": 0.3598, "8": 0.3755}),
    }
    verdict = routing.never_worse(results)
    assert verdict["prefix_at_or_below_simpler_every_rate"] is False
    # Against the lower of the two (round-robin at 4), to the hundredth of a ms.
    assert verdict["prefix_above_simpler_ms"] == {"4": 0.3}
    assert verdict["control_spread_ms"] == {"4": 0.8, "8": 0.5}


def test_prefix_equal_or_below_everywhere_passes_and_a_rate_without_answers_does_not() -> None:
    routing = _routing()
    results = {
        **_simpler(),
        "prefix": _policy({"4": 0.3590, "8": 0.3590}),
    }
    verdict = routing.never_worse(results)
    assert verdict == {
        "prefix_at_or_below_simpler_every_rate": True,
        "prefix_above_simpler_ms": {},
    }
    results["prefix"] = _policy({"4": None, "8": 0.3590})
    verdict = routing.never_worse(results)
    assert verdict["prefix_at_or_below_simpler_every_rate"] is False
    assert verdict["prefix_above_simpler_ms"] == {"4": None}
    # Without both simpler policies there is nothing to judge by.
    del results["least_loaded"]
    assert routing.never_worse(results) == {}


def test_paired_differences_are_per_request_and_per_stage() -> None:
    routing = _routing()
    # (stage, TTFT s) by request index; request 3 failed under round-robin.
    results = {
        "round_robin": {"ttfts": {0: (0, 0.3560), 1: (0, 0.3580), 2: (1, 0.3600)}},
        "least_loaded": {"ttfts": {0: (0, 0.3570), 1: (0, 0.3570), 2: (1, 0.3590), 3: (1, 0.36)}},
        "prefix": {"ttfts": {0: (0, 0.3565), 1: (0, 0.0700), 2: (1, 0.3610), 3: (1, 0.3600)}},
    }
    rows = routing.paired(results, (4.0, 8.0))
    # Stage 0: +0.5 ms and a hit 288 ms sooner; the median is their middle.
    assert rows["4"]["round_robin"] == {"median_ms": -143.75, "mean_ms": -143.75, "requests": 2}
    assert rows["4"]["least_loaded"]["requests"] == 2
    assert rows["4"]["least_loaded"]["mean_ms"] == -143.75  # -0.5 and -287
    assert rows["8"]["round_robin"] == {"median_ms": 1.0, "mean_ms": 1.0, "requests": 1}
    assert rows["8"]["least_loaded"] == {"median_ms": 1.0, "mean_ms": 1.0, "requests": 2}
    assert routing.paired({"round_robin": results["round_robin"]}, (4.0,)) == {}


def test_a_short_real_run_reports_every_policy_and_the_verdict() -> None:
    argv = [
        sys.executable, str(ROOT / "bench" / "routing.py"), "--quick", "--rates", "3,9",
        "--stage-s", "2", "--drain-s", "5",
        "--policies", "round_robin,least_loaded,prefix,round_robin_again",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for policy in ("round_robin", "least_loaded", "prefix", "round_robin_again"):
        for rate in ("3", "9"):
            row = result[policy][rate]
            assert row["requests"] > 0 and row["errors"] == 0, (policy, rate, row)
            assert row["ttft_p90_s"] is not None and row["ttft_p90_s"] > 0
    targets = result["targets"]
    assert isinstance(targets["prefix_at_or_below_simpler_every_rate"], bool)
    assert set(targets["control_spread_ms"]) == {"3", "9"}
    expected = {
        rate
        for rate in ("3", "9")
        if result["prefix"][rate]["ttft_p90_s"]
        > min(result[p][rate]["ttft_p90_s"] for p in ("round_robin", "least_loaded"))
    }
    assert set(targets["prefix_above_simpler_ms"]) == expected
    paired = result["prefix_minus_simpler_paired"]
    for rate in ("3", "9"):
        for other in ("round_robin", "least_loaded"):
            assert paired[rate][other]["requests"] == result["prefix"][rate]["requests"]
