"""The routing benchmark's pieces: its numbers (pure) and its load generator (real HTTP)."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tests.sim.helpers import StartEngine, engine_in_thread

from llmgw.sim import benchstats, loadgen
from llmgw.sim.benchstats import HITS, QUERIES, RequestResult
from llmgw.sim.workloads import RateStage, SharedPrefixSpec, shared_prefix


def test_percentile_interpolates_and_refuses_bad_q() -> None:
    assert benchstats.percentile([], 50) is None
    assert benchstats.percentile([3.0], 99) == 3.0
    values = [float(v) for v in range(1, 11)]  # 1..10
    assert benchstats.percentile(values, 50) == pytest.approx(5.5)
    assert benchstats.percentile(values, 90) == pytest.approx(9.1)
    assert benchstats.percentile(list(reversed(values)), 0) == 1.0
    with pytest.raises(ValueError, match=r"0\.\.100"):
        benchstats.percentile(values, 101)


def test_ttfts_censor_unanswered_requests_instead_of_dropping_them() -> None:
    results = [
        RequestResult(0, 0, sent_at=1.0, first_token_at=1.5, done_at=2.0),
        RequestResult(1, 0, sent_at=2.0, error="unfinished"),
        RequestResult(2, 0, sent_at=3.0),  # still waiting when the run ended
        RequestResult(3, 0, sent_at=4.0, done_at=4.1, error="HTTP 503: busy"),
    ]
    assert benchstats.ttfts(results, censor_at=10.0) == [0.5, 8.0, 7.0]


def test_output_rate_credits_tokens_to_the_window_they_were_made_in() -> None:
    results = [
        RequestResult(0, 0, 0.0, first_token_at=1.0, done_at=3.0, output_tokens=20),
        RequestResult(1, 0, 0.0, first_token_at=2.5, done_at=2.5, output_tokens=1),
        RequestResult(2, 0, 0.0, first_token_at=None, output_tokens=50),
    ]
    # [0, 2): half of request 0's span -> 10 tokens over 2 s.
    assert benchstats.output_rate(results, 0.0, 2.0) == pytest.approx(5.0)
    # [2, 4): the other 10 of request 0 and the single token of request 1.
    assert benchstats.output_rate(results, 2.0, 4.0) == pytest.approx(5.5)
    assert benchstats.output_rate(results, 4.0, 4.0) == 0.0


def test_counters_and_hit_rate_from_prometheus_text() -> None:
    text = (
        "# HELP vllm:prefix_cache_hits Prompt tokens found in the prefix cache.\n"
        "# TYPE vllm:prefix_cache_hits counter\n"
        'vllm:prefix_cache_hits_total{model_name="sim"} 300.0\n'
        'vllm:prefix_cache_hits_created{model_name="sim"} 1.7e9\n'
        'vllm:prefix_cache_queries_total{model_name="sim"} 1000.0\n'
        'vllm:prefix_cache_queries_total{model_name="other"} 1000.0\n'
        "garbage_total not-a-number\n"
    )
    counters = benchstats.parse_counters(text)
    assert counters == {HITS: 300.0, QUERIES: 2000.0}
    later = {HITS: 1300.0, QUERIES: 4000.0}
    assert benchstats.hit_rate(counters, later) == pytest.approx(0.5)
    assert benchstats.hit_rate(counters, counters) is None
    both = benchstats.add_counters([counters, later])
    assert both == {HITS: 1600.0, QUERIES: 6000.0}


def test_saturation_rate_is_the_first_rate_past_ten_times_the_lowest() -> None:
    assert benchstats.saturation_rate([]) is None
    ladder = [(4.0, 0.4), (8.0, 0.5), (12.0, 3.9), (16.0, 4.1), (20.0, 30.0)]
    assert benchstats.saturation_rate(ladder) == 16.0
    assert benchstats.saturation_rate([(4.0, 0.4), (8.0, 3.0)]) is None
    # A rate with no measurement is skipped, not taken as zero.
    assert benchstats.saturation_rate([(4.0, None), (8.0, 0.2), (12.0, 2.5)]) == 12.0


async def test_loadgen_streams_measures_ttft_and_alternates_urls(
    sim_engine: StartEngine,
) -> None:
    # Two engines stand in for two gateways: request k must go to urls[k % 2].
    slow = await sim_engine(prefill_tokens_per_s=2000.0)
    fast = await sim_engine(prefill_tokens_per_s=200_000.0)
    # Every prompt distinct (no cache hit can blur the two engines' speeds).
    spec = SharedPrefixSpec(
        groups=20,
        prompts_per_group=1,
        system_tokens=200,
        question_tokens=20,
        output_tokens=5,
        stages=(RateStage(20.0, 0.5),),
        seed=3,
    )
    requests = list(shared_prefix(spec))
    assert len(requests) >= 4
    fired: list[float] = []
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    probe = loadgen.Probe(at_s=0.2, action=lambda: fired.append(loop.time() - t0))
    run = await loadgen.run(
        requests, [f"{slow.url}/v1", f"{fast.url}/v1"], probes=[probe], drain_s=10.0
    )
    assert [r.index for r in run.results] == [r.index for r in requests]
    assert all(r.error is None for r in run.results), run.results
    assert all(r.output_tokens == 5 for r in run.results)
    assert fired and 0.15 < fired[0] < 0.5
    slow_ttft = [r.ttft for r in run.results if r.index % 2 == 0]
    fast_ttft = [r.ttft for r in run.results if r.index % 2 == 1]
    # ~230 prompt tokens at 2,000 tok/s is >= 0.1 s; at 200,000 tok/s ~1 ms.
    assert min(t for t in slow_ttft if t is not None) >= 0.09
    assert max(t for t in fast_ttft if t is not None) < 0.09
    assert slow.core.counters.finished + fast.core.counters.finished == len(requests)
    # Sent at their workload times (open loop), not one after another.
    for result, request in zip(run.results, requests, strict=True):
        assert result.sent_at == pytest.approx(request.at_s, abs=0.05)


def test_loadgen_times_requests_finer_than_uvloops_millisecond_clock() -> None:
    # bench/routing.py runs the load generator on uvloop, whose loop.time()
    # moves in whole milliseconds: TTFTs read from it all sat on a 1 ms grid,
    # coarser than the differences the benchmark's low-rate cells compare.
    import uvloop

    spec = SharedPrefixSpec(
        groups=4, prompts_per_group=3, system_tokens=40, question_tokens=10,
        output_tokens=2, stages=(RateStage(40.0, 0.3),), seed=5,
    )  # fmt: skip
    requests = list(shared_prefix(spec))
    assert len(requests) >= 6
    # Prefill ~0.37 ms per prompt, decode 0.3 ms a token: far below a millisecond.
    with engine_in_thread(prefill_tokens_per_s=150_000.0, decode_ms_per_token=0.3) as engine:
        run = uvloop.run(loadgen.run(requests, [f"{engine.url}/v1"], drain_s=10.0))
    ttfts = [r.ttft for r in run.results if r.ttft is not None]
    assert len(ttfts) == len(requests), run.results
    off_grid = [t for t in ttfts if abs(t * 1000 - round(t * 1000)) > 1e-6]
    assert len(off_grid) >= len(ttfts) // 2, ttfts


async def test_loadgen_counts_requests_cut_off_by_the_drain_limit(
    sim_engine: StartEngine,
) -> None:
    hang = await sim_engine(fault="hang")
    spec = SharedPrefixSpec(groups=1, prompts_per_group=1, stages=(RateStage(20.0, 0.5),))
    requests = list(shared_prefix(spec))
    assert requests
    run = await loadgen.run(requests, [f"{hang.url}/v1"], drain_s=0.3)
    assert run.results and all(r.error == "unfinished" for r in run.results)
    values = benchstats.ttfts(run.results, censor_at=run.ended_at)
    assert len(values) == len(requests) and min(values) > 0.0


async def test_loadgen_reports_http_errors(sim_engine: StartEngine) -> None:
    engine = await sim_engine(model="other")
    spec = SharedPrefixSpec(groups=1, prompts_per_group=1, stages=(RateStage(20.0, 0.5),))
    requests = list(shared_prefix(spec))
    assert requests
    run = await loadgen.run(requests, [f"{engine.url}/v1"], drain_s=5.0)
    assert run.results and all((r.error or "").startswith("HTTP 404") for r in run.results)
    with pytest.raises(ValueError, match="at least one URL"):
        await loadgen.run([], [])


# -- bench/routing.py as a whole ------------------------------------------------------


def test_routing_bench_setup_sizes_kv_from_the_working_set() -> None:
    from bench.routing import FULL, QUICK

    for setup in (FULL, QUICK):
        fleet_kv = setup.kv_blocks * 16 * setup.engines
        assert setup.working_set_tokens / fleet_kv == pytest.approx(setup.kv_fraction, rel=0.01)
    assert FULL.working_set_tokens == 150 * (600 + 5 * 120)
    # A cold prompt costs what the published setup's does: ~0.36 s of prefill.
    assert FULL.prompt_tokens / FULL.prefill_tps == pytest.approx(0.36, abs=0.01)


def test_routing_bench_targets_are_read_at_the_saturation_rate() -> None:
    from bench.routing import targets

    def policy(p90s: dict[str, float], hit: float) -> dict[str, object]:
        return {"rates": {r: {"ttft_p90_s": v} for r, v in p90s.items()}, "hit_rate_all": hit}

    results = {
        "round_robin": policy({"4": 0.4, "32": 4.2}, 0.16),
        "prefix": policy({"4": 0.4, "32": 0.2}, 0.86),
        "prefix_2gw": policy({"4": 0.4, "32": 0.3}, 0.80),
    }
    out = targets(results, 32.0)
    assert out["rr_over_prefix_ttft_p90_at_saturation"] == pytest.approx(21.0)
    assert out["prefix_10x_lower_at_saturation"] is True
    assert out["hit_rate_gap_2gw_points"] == pytest.approx(6.0)
    assert out["two_gateways_within_5_points"] is False
    assert "rr_over_prefix_ttft_p90_at_saturation" not in targets(results, None)


def routing_bench(*options: str, timeout_s: float) -> tuple[dict[str, Any], str]:
    """bench/routing.py on two engines and three prefix groups: its JSON line, its stderr."""
    script = Path(__file__).resolve().parents[2] / "bench" / "routing.py"
    argv = [sys.executable, str(script), "--engines", "2", "--groups", "3", *options]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1])), done.stderr


def test_routing_bench_runs_end_to_end_in_miniature() -> None:
    out, stderr = routing_bench("--rates", "3,6", "--stage-s", "1", "--drain-s", "10",
                                "--policies", "round_robin,prefix_2gw", timeout_s=120)  # fmt: skip
    assert set(out) >= {"round_robin", "prefix_2gw", "saturation_rate", "targets"}
    for policy in ("round_robin", "prefix_2gw"):
        assert list(out[policy]) == ["3", "6"]
        for row in out[policy].values():
            assert set(row) >= {"ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "hit_rate"}
            assert row["errors"] == 0
            assert row["ttft_p90_s"] is None or row["ttft_p90_s"] > 0
        assert out[f"{policy}_hit_rate_all"] is not None
    assert "gateway listening" not in stderr  # children's stdout is read, not leaked


def test_routing_bench_measures_sglang_router_it_starts_itself() -> None:
    out, stderr = routing_bench("--rates", "3", "--stage-s", "2", "--drain-s", "10",
                                "--policies", "sglang_ca", timeout_s=180)  # fmt: skip
    row = out["sglang_ca"]["3"]
    assert row["requests"] > 0 and row["errors"] == 0 and row["ttft_p90_s"] > 0
    assert out["sglang_ca_hit_rate_all"] is not None
    # The router it started is gone with it.
    found = re.search(r"sglang-router \(cache_aware\) on http://127.0.0.1:(\d+)/v1", stderr)
    assert found is not None, stderr[-3000:]
    with socket.socket() as sock, pytest.raises(OSError):
        sock.connect(("127.0.0.1", int(found.group(1))))


def test_routing_replay_is_deterministic_and_agrees_with_itself() -> None:
    script = Path(__file__).resolve().parents[2] / "bench" / "routing_replay.py"
    argv = [
        sys.executable, str(script), "--engines", "3", "--groups", "6", "--rates", "4,12",
        "--stage-s", "4", "--policies", "round_robin,prefix,prefix_2gw,sglang_ca",
    ]  # fmt: skip
    runs = [subprocess.run(argv, capture_output=True, text=True, timeout=120) for _ in range(2)]
    for done in runs:
        assert done.returncode == 0, done.stderr[-3000:]
    first, second = (json.loads(r.stdout.strip().splitlines()[-1]) for r in runs)
    assert first == second  # simulated time: the same seed gives the same figures
    for policy in ("round_robin", "prefix", "prefix_2gw", "sglang_ca"):
        assert list(first[policy]) == ["4", "12"]
        for row in first[policy].values():
            assert row["requests"] > 0 and row["ttft_p90_s"] > 0
    # 6 groups recurring on 3 engines: prefix routing finds far more cached,
    # and so does the stand-in for sglang-router's cache_aware.
    assert first["prefix_hit_rate_all"] > first["round_robin_hit_rate_all"] + 0.2
    assert first["sglang_ca_hit_rate_all"] > first["round_robin_hit_rate_all"] + 0.2


def routing_replay(*options: str) -> dict[str, Any]:
    """bench/routing_replay.py's round-robin rows on two engines: its JSON line."""
    script = Path(__file__).resolve().parents[2] / "bench" / "routing_replay.py"
    argv = [sys.executable, str(script), "--quick", "--engines", "2", "--groups", "40",
            "--seed", "3", "--policies", "round_robin", *options]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1])["round_robin"])


def test_routing_replay_counts_cold_prompts_prefilled_beside_a_decode() -> None:
    # Arrivals seconds apart: each prefill starts alone. Twenty a second on
    # two engines: most start while another answer decodes.
    quiet = routing_replay("--rates", "0.25", "--stage-s", "40")["0.25"]
    assert quiet["requests"] >= 5 and quiet["cold_beside_decode"] == 0
    busy = routing_replay("--rates", "20", "--stage-s", "4")["20"]
    assert busy["requests"] > 40 and busy["cold_beside_decode"] > busy["requests"] // 2
