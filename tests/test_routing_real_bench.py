"""bench/routing_real.py: how it reads the engines' logs, its verdict, and a tiny real run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tests.benchscripts import BENCH, load

from llmgw.sim.benchstats import RequestResult
from llmgw.sim.loadgen import RunResult

real = load("routing_real")

# What llama_cpp.server (verbose) prints for a cold prompt, the same tenant's
# next question (its context found cached), and llmgw's one-token copy of
# that stream (sent to count its prompt), in that order.
LOG = """\
Llama._create_completion: cache miss
llama_perf_context_print: prompt eval time =   15163.69 ms /   640 tokens (   23.69 ms per token)
llama_perf_context_print:        eval time =    2000.77 ms /     7 runs   (  285.82 ms per token)
INFO:     127.0.0.1:40824 - "POST /v1/chat/completions HTTP/1.1" 200 OK
Llama._create_completion: cache hit
Llama.generate: 623 prefix-match hit, remaining 17 prompt tokens to eval
llama_perf_context_print: prompt eval time =     967.53 ms /    17 tokens (   56.91 ms per token)
llama_perf_context_print:        eval time =    1761.73 ms /     7 runs   (  251.68 ms per token)
Llama.generate: 639 prefix-match hit, remaining 1 prompt tokens to eval
llama_perf_context_print: prompt eval time =      31.00 ms /     1 tokens (   31.00 ms per token)
llama_perf_context_print:        eval time =       0.00 ms /     1 runs   (    0.00 ms per token)
"""


def test_each_generation_is_read_from_the_engine_log() -> None:
    generations = real.parse_generations(LOG)
    assert [(g.found, g.evaluated, g.decoded) for g in generations] == [
        (0, 640, 7), (623, 17, 7), (639, 1, 1),
    ]  # fmt: skip
    results = [RequestResult(i, 0, 0.0, 0.5 + i, 2.0 + i) for i in range(2)]
    row = real.summarize(RunResult(results, 10.0), generations, [3], 10.0)
    # Two requests, one found its context cached; the copy is counted apart.
    assert (row["hit_rate"], row["hits"], row["generations"], row["metering_copies"]) == (
        0.5, 1, 2, 1,
    )  # fmt: skip
    assert row["ttft_p50_s"] == 1.0 and row["ttft_mean_s"] == 1.0


def test_the_verdict_fails_when_prefix_routing_is_behind() -> None:
    sglang = {"hit_rate": 0.75, "ttft_p50_s": 0.27, "ttft_mean_s": 1.18, "ttft_p90_s": 3.0}
    level = {"prefix": dict(sglang), real.SGLANG: sglang}
    assert real.verdict(level)["ok"] is True
    behind = dict(sglang, hit_rate=0.56, ttft_p50_s=2.81)
    out = real.verdict({"prefix": behind, real.SGLANG: sglang})
    assert out["ok"] is False and not out["hit_rate_at_or_above"]
    assert not out["ttft_p50_at_or_below"] and out["ttft_mean_at_or_below"]
    assert real.verdict({"prefix": sglang}) is None  # nothing to compare with


@pytest.mark.slow
def test_a_tiny_run_on_real_engines() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH / "routing_real.py"), "--routers", "prefix", "--tenants", "2",
         "--requests", "3", "--rate", "1", "--context-tokens", "60", "--output-tokens", "3",
         "--drain-s", "60", "--port", "26500", "--repeat", "2"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # Two runs: the figures are their means, with their ranges and the runs themselves.
    pooled = out["prefix"]
    assert len(pooled["runs"]) == 2 and pooled["errors"] == 0
    low, high = pooled["ttft_p50_s_range"]
    assert low <= pooled["ttft_p50_s"] <= high
    row = pooled["runs"][1]
    assert row["requests"] == 3 and row["errors"] == 0 and row["generations"] == 3
    # The gateway counts each stream's prompt by rendering the template the
    # engines declare and tokenizing it: nothing generates for a count.
    assert row["metering_copies"] == 0
    assert row["ttft_p50_s"] is not None and out["verdict"] is None
    assert out["verdict_per_run"] == [None, None]  # no sglang-router to compare with


replay = load("routing_real_replay")


def test_the_replays_engine_keeps_prompt_states_as_llama_cpp_python_does() -> None:
    # llama_cache.py: the lookup marks the longest-prefix state used (any
    # shared first token counts), a save drops the oldest past the budget;
    # llama.py: a cached state is loaded only when longer than the context's.
    engine = replay.LlamaCppServer(cache_states=2, timing=replay.Timing())

    def run(tenant: int, index: int) -> int:
        tokens = (("h", 0), *(("c", tenant, i) for i in range(10)), ("q", index, 0))
        flight = replay.Flight(index, tenant, 0.0, 0, None, None, 0.0, len(tokens), 2)
        generation = replay.Generation(flight, tokens)
        engine.begin(generation)
        engine.end(generation)
        return generation.found

    assert run(0, 0) == 0  # cold
    assert run(0, 1) == 11  # the context holds it: head and context
    assert run(1, 2) == 1  # only the template's head in common
    # Tenant 0's state, loaded from the cache; its save drops tenant 1's, the
    # oldest once tenant 1's miss had marked tenant 0's first state used.
    assert run(0, 3) == 11
    assert run(2, 4) == 1
    assert run(1, 5) == 1


def test_the_replay_runs_every_router_on_a_seed() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH / "routing_real_replay.py"), "--seeds", "0", "--quick"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    result = json.loads(out.stdout.splitlines()[-1])
    for router in ("prefix", "round_robin", "sglang_ca"):
        row = result[router]["seeds"]["0"]
        assert 0.0 <= row["hit_rate"] <= 1.0 and row["ttft_p50_s"] > 0
        assert sum(row["generations_per_engine"]) == 24
    # Six tenants, cached contexts: prefix routing finds far more than round-robin.
    hits = {name: result[name]["seeds"]["0"]["hit_rate"] for name in ("prefix", "round_robin")}
    assert hits["prefix"] > hits["round_robin"]


def _vllm_row(hit: float, p90: float) -> dict[str, object]:
    return {"hit_rate": hit, "ttft_p50_s": p90 / 3, "ttft_mean_s": p90 / 2, "ttft_p90_s": p90,
            "errors": 0}  # fmt: skip


def test_the_vllm_verdict_compares_runs_within_the_estimates_own_spread() -> None:
    sys.path.insert(0, str(BENCH))
    from realkit import vllmrouting
    from realkit.runs import pooled

    # One run each: compared as they are.
    single = {"prefix": _vllm_row(0.70, 0.50), "prefix_exact": _vllm_row(0.70, 0.51)}
    assert vllmrouting.verdict(single) == {
        "ok": False, "hit_rate_at_or_above": True, "ttft_p90_at_or_below": False,
        "control_spread": {"hit_rate": 0.0, "ttft_p90_s": 0.0},
    }  # fmt: skip
    # Three runs each: means, within what the estimate moved by between its runs.
    runs = ((0.5, 0.9), (0.7, 0.5), (0.6, 0.7))
    estimated = pooled([_vllm_row(h, p) for h, p in runs])
    assert estimated["hit_rate"] == 0.6 and estimated["ttft_p90_s_range"] == [0.5, 0.9]
    near = pooled([_vllm_row(h, p) for h, p in ((0.45, 1.0), (0.5, 0.9), (0.4, 0.8))])
    verdict = vllmrouting.verdict({"prefix": estimated, "prefix_exact": near})
    assert verdict is not None and verdict["ok"]
    assert verdict["control_spread"] == {"hit_rate": 0.2, "ttft_p90_s": 0.4}
    # Below the estimate by more than its spread: fails.
    far = pooled([_vllm_row(h, p) for h, p in ((0.3, 1.2), (0.35, 1.1), (0.3, 1.3))])
    verdict = vllmrouting.verdict({"prefix": estimated, "prefix_exact": far})
    assert verdict is not None and not verdict["ok"]
    assert not verdict["hit_rate_at_or_above"] and not verdict["ttft_p90_at_or_below"]


def test_repeat_takes_one_run_or_more_on_either_engine() -> None:
    for engine in ([], ["--engine", "vllm"]):
        with pytest.raises(SystemExit):
            real.parse_args([*engine, "--repeat", "0"])
        args, _ = real.parse_args([*engine, "--repeat", "3"])
        assert args.repeat == 3
