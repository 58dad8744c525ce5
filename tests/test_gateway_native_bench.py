"""bench/gateway_native.py: wrk's report read right, verdicts that can fail, and a real run.

The run drives the real gateway (bench/gateway.py's) with wrk in front of
nginx, as the benchmark does; wrk and nginx come from `make setup`.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.benchscripts import BENCH, load

native = load("gateway_native")

# wrk 4.1's own reports, captured here: one served, one refused (a wrong key).
SERVED = """Running 6s test @ http://127.0.0.1:36909/v1/chat/completions
  1 threads and 32 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     1.32ms  252.57us   5.47ms   81.47%
    Req/Sec    24.42k     1.00k   25.99k    60.00%
  Latency Distribution
     50%    1.28ms
     75%    1.40ms
     90%    1.58ms
     99%    2.10ms
  97185 requests in 4.00s, 45.41MB read
Requests/sec:  24283.72
Transfer/sec:     11.35MB
"""
REFUSED = """Running 1s test @ http://127.0.0.1:58267/v1/chat/completions
  1 threads and 2 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   133.86us  137.36us   1.99ms   95.62%
    Req/Sec    14.01k   681.85    14.63k    81.82%
  Latency Distribution
     50%  101.00us
     75%  113.00us
     90%  146.00us
     99%  930.00us
  15308 requests in 1.10s, 5.39MB read
  Socket errors: connect 0, read 2, write 0, timeout 3
  Non-2xx or 3xx responses: 15308
Requests/sec:  13922.07
Transfer/sec:      4.90MB
"""


def test_wrk_s_report_is_read() -> None:
    assert native.parse_wrk(SERVED) == (97185, 24283.72, 2.10, 0)
    requests, rps, p99, failed = native.parse_wrk(REFUSED)
    assert (requests, rps, failed) == (15308, 13922.07, 15308 + 5)
    assert abs(p99 - 0.93) < 1e-9


def point(connections: int, rps: float, router: float, p99: float = 1.0, failed: int = 0) -> object:
    return native.Point(connections, rps, p99, failed,
                        {"router": router, "upstream": 10.0, "load": 10.0})  # fmt: skip


def test_a_count_that_failed_or_went_past_50_ms_holds_nothing() -> None:
    points = [point(1, 7000, 90), point(32, 25000, 40, failed=3), point(128, 30000, 40, p99=60)]
    assert native.best(points).rps == 7000
    out = native.summary({"llmgw-1": points}, [1], [], 2)
    assert out["max_rps_p99_under_50ms"] == {"llmgw-1": 7000}


def test_scaling_and_its_ceiling() -> None:
    results = {"llmgw-1": [point(32, 24000, 40)], "llmgw-2": [point(32, 28000, 45)]}
    out = native.summary(results, [1, 2], [], 2)
    assert out["scaling"] == round(28000 / 24000, 3)
    # Two cores over a request's whole cost (40 + 10 + 10 us), the router's 40 of it.
    assert out["scaling_ceiling"] == round(2 * 40 / 60, 3)


def test_the_ratio_to_the_best_peer_is_above_one_when_llmgw_spends_more() -> None:
    results = {
        "llmgw-1": [point(1, 7000, 90), point(32, 24000, 40)],
        "vllm-router": [point(1, 7500, 72), point(32, 26000, 38, failed=1)],
        "sglang-router": [point(1, 6200, 88), point(32, 22000, 45)],
    }
    out = native.summary(results, [1], ["vllm-router", "sglang-router"], 2)
    # At 32 the vLLM router failed a request: only sglang-router's figure counts.
    assert out["cpu_ratio_to_best_peer"] == {"1": round(90 / 72, 3), "32": round(40 / 45, 3)}


def test_a_real_run_through_the_gateway() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH / "gateway_native.py"), "--quick", "--connections", "1,8",
         "--seconds", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for row in out["systems"]["llmgw-1"].values():
        assert row["failed"] == 0 and row["rps"] > 100
        assert row["cpu_us_per_request"]["router"] > 0
        assert row["cpu_us_per_request"]["upstream"] > 0 and row["cpu_us_per_request"]["load"] > 0
    assert out["max_rps_p99_under_50ms"]["llmgw-1"] > 100
