"""Routing benchmark: a shared-prefix workload through a gateway to K simulated engines.

For each policy -- round-robin, least-loaded, prefix, prefix with two
gateway instances sharing the traffic (requests alternate between them),
round-robin again as a control (the spread between its two runs is the
run's noise), and SGLang's router with its ``cache_aware`` policy when ``sglang-router`` is
installed (``pip install 'llmgw[bench]'``) -- the same seeded workload climbs a
ladder of Poisson rates. Per rate: TTFT
p50/p90/p99 (client side, first content chunk), output tokens/s, and the
engines' own prefix-cache hit rate (delta of ``vllm:prefix_cache_hits_total``
over ``vllm:prefix_cache_queries_total``). ``saturation_rate`` is the first
rate where round-robin's TTFT p90 exceeds 10x its value at the lowest rate;
the targets (issue 7) are read there. Issue 16's target, prefix routing's
p90 at or below round-robin's and least-loaded's at every rate, is checked
per rate, with the control's spread beside any rate where it is missed.

The workload is llm-d's "B2B-SaaS" shape (research/routing.md §6.2) scaled
down by 10 in tokens (150 groups x 5 prompts, system 600 and question 120
tokens instead of 6,000 and 1,200; KV sized so the working set is 70 % of the
fleet's) and by 10 in prefill speed (2,048 tok/s, chunks of 819 tokens instead
of 20,480 and 8,192), so a cold prompt costs what it costs there (~0.35 s)
and the rates are the published ones; output is cut to 32 tokens to save CPU
(see docs/simulator.md, "Routing benchmark").

Processes: the engines (one process, all policies' engines, each policy on
fresh ones), the gateways (one process for the single-gateway policies and
the first prefix_2gw instance, another for the second), and this one, the
load generator; for ``sglang_ca``, sglang-router started by the benchmark on
its own set of engines. Gateways get a static config through a MemoryLink, so
the benchmark measures routing, not the scheduler.

    python bench/routing.py [--quick] [--engines 8] [--rates 4,8,...] [--stage-s 12]
    python bench/routing.py --router-url http://127.0.0.1:9000/v1 --policies external \\
        --engine-port 18000      # measure another router against the same engines

Last line: one JSON object, per policy and rate ttft_p50_s, ttft_p90_s,
ttft_p99_s, hit_rate, output_tok_s; plus saturation_rate, the targets, and
prefix_minus_simpler_paired (per rate, prefix's TTFT minus each simpler
policy's request by request: median_ms, mean_ms, requests).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from simfleet import children

from llmgw.sim import benchstats, loadgen
from llmgw.sim.workloads import RateStage, SharedPrefixSpec, TimedRequest, shared_prefix
from llmgw.wire import SimParams

if TYPE_CHECKING:
    from simfleet.gateways import GatewaySpec

API_KEY = "sk-llmgw-bench-routing-0123456789abcdefghijklmnop"
MODEL = "sim"
POLICIES = {
    "round_robin": "round-robin",
    "least_loaded": "least-loaded",
    "prefix": "prefix",
    "prefix_2gw": "prefix",
    "round_robin_again": "round-robin",
}
# Round-robin a second time on engines of its own, measured like any policy:
# how far two runs of the same policy land apart at each rate is the run's
# own noise. At 4 req/s, where every policy prefills cold prompts on idle
# engines, that spread (up to ~1 ms at p90) is as large as the differences
# between policies, and a reader should see it beside them.
CONTROL = "round_robin_again"
# The simpler policies prefix routing must be at or below at every rate (issue 16).
SIMPLER = ("round_robin", "least_loaded")


def gateway_count(policy: str) -> int:
    """What a control plane would tell the policy's gateways: how many share its traffic."""
    return 2 if policy == "prefix_2gw" else 1


# Measured, not served by a gateway: sglang-router's cache_aware policy, with
# its own defaults, on its own engines (only when sglang-router is installed).
SGLANG = "sglang_ca"


@dataclass(frozen=True)
class Setup:
    engines: int
    groups: int
    prompts_per_group: int
    system_tokens: int
    question_tokens: int
    output_tokens: int
    rates: tuple[float, ...]
    stage_s: float
    kv_fraction: float
    prefill_tps: float
    prefill_chunk: int
    decode_ms: float
    time_factor: float
    drain_s: float
    seed: int

    @property
    def prompt_tokens(self) -> int:
        # The rendered chat adds a few tokens of role markers (llmgw.sim.tokens).
        return self.system_tokens + self.question_tokens + 10

    @property
    def working_set_tokens(self) -> int:
        return self.groups * (self.system_tokens + self.prompts_per_group * self.question_tokens)

    @property
    def kv_blocks(self) -> int:
        per_engine = self.working_set_tokens / self.kv_fraction / self.engines
        return max(64, math.ceil(per_engine / 16))

    def sim_params(self) -> SimParams:
        return SimParams(
            startup_s=0.0,
            prefill_tokens_per_s=self.prefill_tps,
            prefill_chunk_tokens=self.prefill_chunk,
            decode_ms_per_token=self.decode_ms,
            decode_batch_alpha=0.02,
            kv_blocks=self.kv_blocks,
            block_tokens=16,
            max_running=64,
            time_factor=self.time_factor,
        )

    def workload(self) -> list[TimedRequest]:
        spec = SharedPrefixSpec(
            model=MODEL,
            groups=self.groups,
            prompts_per_group=self.prompts_per_group,
            system_tokens=self.system_tokens,
            question_tokens=self.question_tokens,
            output_tokens=self.output_tokens,
            stages=tuple(RateStage(r, self.stage_s) for r in self.rates),
            seed=self.seed,
        )
        return list(shared_prefix(spec))


FULL = Setup(
    engines=8, groups=150, prompts_per_group=5, system_tokens=600, question_tokens=120,
    output_tokens=32, rates=(4, 8, 12, 16, 20, 24, 28, 32, 36), stage_s=12.0, kv_fraction=0.70,
    prefill_tps=2048.0, prefill_chunk=819, decode_ms=11.0, time_factor=1.0, drain_s=60.0, seed=0,
)  # fmt: skip
# Quick: half the engines and 20 groups (same 70 % working set, so prefixes
# recur within seconds), three short stages; the same per-request costs, so
# the rates are about halved too.
QUICK = replace(FULL, engines=4, groups=20, rates=(3, 9, 15), stage_s=3.5, drain_s=10.0)


# ---------------------------------------------------------------------------
# Child processes
# ---------------------------------------------------------------------------


def start_engines(setup: Setup, count: int, port: int) -> tuple[subprocess.Popen[str], list[str]]:
    return children.start_sim_engines(MODEL, setup.sim_params(), count, port)


def start_gateways(routes: list[dict[str, Any]]) -> tuple[subprocess.Popen[str], list[str]]:
    proc = children.spawn([sys.executable, __file__, "--serve-gateways", json.dumps(routes)])
    return proc, children.read_urls(proc, children.GATEWAY_MARKER, len(routes))


def sglang_installed() -> bool:
    return importlib.util.find_spec("sglang_router") is not None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_sglang(
    engines: list[str], extra: Sequence[str] = ()
) -> tuple[subprocess.Popen[bytes], str, str]:
    """sglang-router, cache_aware with its defaults, in front of ``engines``: (proc, URL, log).

    ``extra``: more of its flags (an engine's health path, for engines without /health).
    """
    port = _free_port()
    log_path = os.path.join(tempfile.gettempdir(), f"bench-routing-sglang-{port}.log")
    argv = [
        sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
        "--port", str(port), "--worker-urls", *engines, "--policy", "cache_aware",
        # Its metrics port defaults to a fixed one; two runs at once would clash.
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port()),
        "--log-level", "warn", *extra,
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}/v1", log_path


# ---------------------------------------------------------------------------
# The gateway process
# ---------------------------------------------------------------------------


def _gateway_specs(routes: list[dict[str, Any]]) -> list[GatewaySpec]:
    """One gateway per route (its policy, endpoints and the gateways sharing its traffic)."""
    from llmgw import secrets, wire
    from llmgw.gateway.settings import GatewaySettings

    key = wire.ApiKeyInfo(key_id="bench", secret_hash=secrets.hash_secret(API_KEY))
    specs = []
    for i, item in enumerate(routes):
        route = wire.ModelRoute(
            name=MODEL,
            served_name=MODEL,
            routing=item["routing"],
            endpoints=[wire.Endpoint(**e) for e in item["endpoints"]],
        )
        config = wire.GatewayConfig(
            routing=wire.RoutingTable(version=1, models=[route], gateways=item["gateways"]),
            keys=[key],
        )
        specs.append((config, GatewaySettings(gateway_id=f"bench-{i}")))
    return specs


def serve_gateways(raw: str) -> int:
    """The gateways' process (``--serve-gateways``, also started by bench/routing_real.py)."""
    from simfleet import gateways

    return gateways.run(_gateway_specs(json.loads(raw)))


# ---------------------------------------------------------------------------
# One policy
# ---------------------------------------------------------------------------


async def scrape(session: aiohttp.ClientSession, engines: list[str]) -> dict[str, float]:
    async def one(url: str) -> dict[str, float]:
        async with session.get(f"{url}/metrics") as resp:
            return benchstats.parse_counters(await resp.text())

    return benchstats.add_counters(await asyncio.gather(*(one(u) for u in engines)))


async def wait_router(url: str, key: str, timeout_s: float) -> None:
    """Wait until ``url`` (an external router's /v1) answers a tiny request."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    headers = {"Authorization": f"Bearer {key}"}
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.post(
                    f"{url}/chat/completions", json=body, headers=headers
                ) as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"router {url} did not answer within {timeout_s:g} s")
            await asyncio.sleep(1.0)


async def run_policy(
    setup: Setup,
    requests: list[TimedRequest],
    urls: list[str],
    engines: list[str],
    key: str = API_KEY,
) -> dict[str, Any]:
    snapshots: list[dict[str, float]] = []
    async with aiohttp.ClientSession() as session:

        async def take() -> None:
            snapshots.append(await scrape(session, engines))

        await take()
        probes = [
            loadgen.Probe(at_s=(i + 1) * setup.stage_s, action=take)
            for i in range(len(setup.rates) - 1)
        ]
        run = await loadgen.run(requests, urls, api_key=key, probes=probes, drain_s=setup.drain_s)
        await take()
    per_rate: dict[str, Any] = {}
    for i, rate in enumerate(setup.rates):
        start, end = i * setup.stage_s, (i + 1) * setup.stage_s
        stage = [r for r in run.results if r.stage == i]
        values = benchstats.ttfts(stage, censor_at=run.ended_at)
        hit = (
            benchstats.hit_rate(snapshots[i], snapshots[i + 1]) if i + 1 < len(snapshots) else None
        )
        per_rate[f"{rate:g}"] = {
            "ttft_p50_s": _round(benchstats.percentile(values, 50)),
            "ttft_p90_s": _round(benchstats.percentile(values, 90)),
            "ttft_p99_s": _round(benchstats.percentile(values, 99)),
            "hit_rate": _round(hit),
            "output_tok_s": _round(benchstats.output_rate(run.results, start, end), 1),
            "requests": len(stage),
            "errors": sum(1 for r in stage if r.error is not None),
        }
    overall = benchstats.hit_rate(snapshots[0], snapshots[-1])
    # Each request's TTFT by its index, for comparing policies request by
    # request (paired): every policy is sent the same requests at the same times.
    by_request = {
        r.index: (r.stage, r.ttft) for r in run.results if r.ttft is not None and r.error is None
    }
    return {"rates": per_rate, "hit_rate_all": _round(overall), "ttfts": by_request}


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


# ---------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------


def targets(results: dict[str, Any], saturation: float | None) -> dict[str, Any]:
    out: dict[str, Any] = {"saturation_rate": saturation}
    rr, prefix, two = (results.get(p) for p in ("round_robin", "prefix", "prefix_2gw"))
    if saturation is not None and rr is not None and prefix is not None:
        key = f"{saturation:g}"
        rr_p90 = rr["rates"][key]["ttft_p90_s"]
        prefix_p90 = prefix["rates"][key]["ttft_p90_s"]
        if rr_p90 is not None and prefix_p90:
            ratio = rr_p90 / prefix_p90
            out["rr_over_prefix_ttft_p90_at_saturation"] = round(ratio, 2)
            out["prefix_10x_lower_at_saturation"] = ratio >= 10.0
    if prefix is not None and two is not None:
        a, b = prefix["hit_rate_all"], two["hit_rate_all"]
        if a is not None and b is not None:
            gap = abs(a - b) * 100
            out["hit_rate_gap_2gw_points"] = round(gap, 2)
            out["two_gateways_within_5_points"] = gap <= 5.0
    out |= never_worse(results)
    return out


def never_worse(results: dict[str, Any]) -> dict[str, Any]:
    """Prefix routing's TTFT p90 against the simpler policies', rate by rate.

    ``prefix_above_simpler_ms`` names each rate where prefix is above the
    lower of them and by how much (None: a stage with no answers, not a
    pass either). ``control_spread_ms``, when the control ran, is how far
    round-robin's two runs landed apart at each rate. The verdict is not
    softened by the spread; the spread says how much of a miss the run
    could tell from its own noise.
    """
    prefix = results.get("prefix")
    if prefix is None or any(p not in results for p in SIMPLER):
        return {}
    above: dict[str, float | None] = {}
    for rate, row in prefix["rates"].items():
        mine = row["ttft_p90_s"]
        theirs = [results[p]["rates"][rate]["ttft_p90_s"] for p in SIMPLER]
        if mine is None or None in theirs:
            above[rate] = None
        elif mine > min(theirs):
            above[rate] = round((mine - min(theirs)) * 1000, 2)
    out: dict[str, Any] = {
        "prefix_at_or_below_simpler_every_rate": not above,
        "prefix_above_simpler_ms": above,
    }
    control = results.get(CONTROL)
    if control is not None:
        first = results["round_robin"]["rates"]
        out["control_spread_ms"] = {
            rate: None
            if row["ttft_p90_s"] is None or first[rate]["ttft_p90_s"] is None
            else round(abs(row["ttft_p90_s"] - first[rate]["ttft_p90_s"]) * 1000, 2)
            for rate, row in control["rates"].items()
        }
    return out


def paired(results: dict[str, Any], rates: tuple[float, ...]) -> dict[str, Any]:
    """Prefix routing's TTFT minus each simpler policy's, request by request, per rate (ms).

    Every policy is sent the same requests at the same times, so the
    difference for one request is the policies' difference plus that
    request's noise, not the run's: where every policy prefills cold prompts
    on idle engines (4 req/s), two runs' p90 land up to a millisecond apart
    while the median of the paired differences is what prefix routing's own
    work costs. The mean also counts the prompts only prefix routing sent
    to a replica holding their prefix. Reported beside the verdict, never
    instead of it.
    """
    prefix = results.get("prefix")
    if prefix is None:
        return {}
    out: dict[str, Any] = {}
    for stage, rate in enumerate(rates):
        row: dict[str, Any] = {}
        for other in SIMPLER:
            if other not in results:
                continue
            theirs = results[other]["ttfts"]
            diffs = [
                (ttft - theirs[i][1]) * 1000
                for i, (st, ttft) in prefix["ttfts"].items()
                if st == stage and i in theirs
            ]
            if diffs:
                row[other] = {
                    "median_ms": _round(statistics.median(diffs), 3),
                    "mean_ms": _round(statistics.fmean(diffs), 3),
                    "requests": len(diffs),
                }
        out[f"{rate:g}"] = row
    return out


def print_paired(rows: dict[str, Any]) -> None:
    if not rows:
        return
    print("\nprefix minus simpler, request by request (ms): median / mean", file=sys.stderr)
    for rate, row in rows.items():
        cells = "  ".join(
            f"{other} {cell['median_ms']:+.3f} / {cell['mean_ms']:+.1f}"
            for other, cell in row.items()
        )
        print(f"  {rate:>4}  {cells}", file=sys.stderr)


def print_table(name: str, result: dict[str, Any]) -> None:
    print(f"\n{name}  (hit rate over the run: {result['hit_rate_all']})", file=sys.stderr)
    print("  rate  p50_s   p90_s   p99_s   hit    out_tok/s  reqs  errs", file=sys.stderr)
    for rate, row in result["rates"].items():
        cells = [row[k] for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "hit_rate")]
        text = "  ".join("  -   " if c is None else f"{c:6.3f}" for c in cells)
        print(
            f"  {rate:>4}  {text}  {row['output_tok_s']:9.1f}  {row['requests']:4d}"
            f"  {row['errors']:4d}",
            file=sys.stderr,
        )


def choose_policies(args: argparse.Namespace) -> list[str]:
    if args.policies:
        policies: list[str] = args.policies.split(",")
    else:
        policies = list(POLICIES) + ([SGLANG] if sglang_installed() else [])
        if args.quick:
            policies.remove(CONTROL)  # a minute's run has no room for it
    if args.router_url and "external" not in policies:
        policies.append("external")
    known = [*POLICIES, SGLANG, "external"]
    for policy in policies:
        if policy not in known:
            raise SystemExit(f"unknown policy {policy!r}; known: {', '.join(known)}")
    if "external" in policies and not args.router_url:
        raise SystemExit("policy external needs --router-url")
    if SGLANG in policies and not sglang_installed():
        raise SystemExit(f"policy {SGLANG} needs sglang-router: pip install 'llmgw[bench]'")
    return policies


async def bench(args: argparse.Namespace, setup: Setup) -> dict[str, Any]:
    policies = choose_policies(args)
    requests = setup.workload()
    procs: list[subprocess.Popen[Any]] = []
    results: dict[str, Any] = {}
    started = time.monotonic()
    try:
        engine_proc, urls = start_engines(setup, setup.engines * len(policies), args.engine_port)
        procs.append(engine_proc)
        sets = {
            p: urls[i * setup.engines : (i + 1) * setup.engines] for i, p in enumerate(policies)
        }
        capacity = setup.kv_blocks * 16
        first: list[dict[str, Any]] = []
        second: list[dict[str, Any]] = []
        routers = ("external", SGLANG)  # not a gateway's policy
        for policy in policies:
            if policy in routers:
                continue
            endpoints = [
                {"replica_id": f"{policy}-{i}", "url": u, "kv_capacity_tokens": capacity}
                for i, u in enumerate(sets[policy])
            ]
            route = {
                "routing": POLICIES[policy], "endpoints": endpoints,
                "gateways": gateway_count(policy),
            }  # fmt: skip
            first.append(route)
            if policy == "prefix_2gw":
                second.append(route)
        gateway_urls: dict[str, list[str]] = {}
        if first:
            proc, got = start_gateways(first)
            procs.append(proc)
            names = [p for p in policies if p not in routers]
            gateway_urls = {p: [u] for p, u in zip(names, got, strict=True)}
        if second:
            proc, got = start_gateways(second)
            procs.append(proc)
            gateway_urls["prefix_2gw"].append(got[0])
        if SGLANG in policies:
            sglang, url, log_path = start_sglang(sets[SGLANG])
            procs.append(sglang)
            print(f"sglang-router (cache_aware) on {url}, log {log_path}", file=sys.stderr)
            try:
                await wait_router(url, API_KEY, args.router_wait_s)
            except RuntimeError as exc:
                raise RuntimeError(f"{exc}; its log: {log_path}") from None
            gateway_urls[SGLANG] = [url]
        if "external" in policies:
            print("engines for the external router (model 'sim'):", file=sys.stderr)
            for url in sets["external"]:
                print(f"  {url}/v1", file=sys.stderr)
            await wait_router(args.router_url.rstrip("/"), args.router_key, args.router_wait_s)
            gateway_urls["external"] = [args.router_url.rstrip("/")]
        print(
            f"workload: {len(requests)} requests, {setup.groups} groups x"
            f" {setup.prompts_per_group}, prompt ~{setup.prompt_tokens} tokens, output"
            f" {setup.output_tokens}; {setup.engines} engines x {setup.kv_blocks * 16} KV tokens"
            f" (working set {setup.working_set_tokens} = {setup.kv_fraction:.0%} of the fleet's)",
            file=sys.stderr,
        )
        for policy in policies:
            # What earlier policies left in this process (their results,
            # sessions, parsed events) is out of the collector's sight
            # before the next one is timed: otherwise each policy's
            # client-side timing would include collections over more of it
            # than the one before, and a policy's place in the order would
            # count.
            gc.collect()
            gc.freeze()
            t0 = time.monotonic()
            key = args.router_key if policy == "external" else API_KEY
            results[policy] = await run_policy(
                setup, requests, gateway_urls[policy], sets[policy], key
            )
            print_table(f"{policy} ({time.monotonic() - t0:.0f} s)", results[policy])
    finally:
        children.stop(procs)
    out = results_json({"bench": "routing", "quick": bool(args.quick)}, results)
    out["prefix_minus_simpler_paired"] = paired(results, setup.rates)
    print_paired(out["prefix_minus_simpler_paired"])
    out["setup"] = {k: v for k, v in setup.__dict__.items() if k not in ("rates",)} | {
        "rates": list(setup.rates),
        "kv_tokens_per_engine": setup.kv_blocks * 16,
    }
    out["elapsed_s"] = round(time.monotonic() - started, 1)
    return out


def results_json(head: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    """``head``, then each policy's rows and hit rate, round-robin's saturation, the targets."""
    rr = results.get("round_robin")
    saturation = (
        benchstats.saturation_rate(
            [(float(rate), row["ttft_p90_s"]) for rate, row in rr["rates"].items()]
        )
        if rr is not None
        else None
    )
    out = dict(head)
    for policy, result in results.items():
        out[policy] = result["rates"]
        out[f"{policy}_hit_rate_all"] = result["hit_rate_all"]
    out["saturation_rate"] = saturation
    out["targets"] = targets(results, saturation)
    return out


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, Setup]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="about a minute, smaller fleet")
    parser.add_argument("--engines", type=int, help="engines per policy")
    parser.add_argument("--groups", type=int)
    parser.add_argument("--prompts-per-group", type=int)
    parser.add_argument("--system-tokens", type=int)
    parser.add_argument("--question-tokens", type=int)
    parser.add_argument("--output-tokens", type=int)
    parser.add_argument("--rates", help="comma-separated requests/s, e.g. 4,8,16")
    parser.add_argument("--stage-s", type=float, help="seconds per rate")
    parser.add_argument("--kv-fraction", type=float, help="working set / fleet KV")
    parser.add_argument("--prefill-tps", type=float, help="engine prefill tokens/s")
    parser.add_argument("--prefill-chunk", type=int, help="prefill tokens per engine step")
    parser.add_argument("--decode-ms", type=float, help="decode ms per token")
    parser.add_argument("--time-factor", type=float, help="multiplies every engine duration")
    parser.add_argument("--drain-s", type=float, help="wait for stragglers after the last stage")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--policies", help=f"subset of {','.join(POLICIES)},{SGLANG},external")
    parser.add_argument("--router-url", help="an external router's base URL (ending in /v1)")
    parser.add_argument("--router-key", default=API_KEY, help="Bearer token for that router")
    parser.add_argument("--router-wait-s", type=float, default=300.0)
    parser.add_argument("--engine-port", type=int, default=0, help="first engine port (0: any)")
    parser.add_argument("--serve-gateways", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    setup = QUICK if args.quick else FULL
    overrides: dict[str, Any] = {}
    for name in (
        "engines", "groups", "prompts_per_group", "system_tokens", "question_tokens",
        "output_tokens", "stage_s", "kv_fraction", "prefill_tps", "prefill_chunk",
        "decode_ms", "time_factor", "drain_s", "seed",
    ):  # fmt: skip
        value = getattr(args, name)
        if value is not None:
            overrides[name] = value
    if args.rates:
        overrides["rates"] = tuple(float(r) for r in args.rates.split(","))
    return args, replace(setup, **overrides)


def main(argv: list[str] | None = None) -> int:
    args, setup = parse_args(argv)
    if args.serve_gateways:
        return serve_gateways(args.serve_gateways)
    import uvloop

    # Stopped with a plain kill as with Ctrl-C: through bench()'s finally,
    # which stops the engines, gateways and routers it started in sessions
    # of their own (a SIGTERM ended this process alone and left them running).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    out = uvloop.run(bench(args, setup))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
