"""bench/routing.py replayed in simulated time: deterministic, seconds instead of minutes.

The same workload, engines and flags as bench/routing.py, but nothing runs in
real time: each engine is the simulated engine's own scheduler
(``EngineCore``, stepped by this script's clock instead of sleeping), and each
gateway is the gateway's own router (``ConfigView`` built from the same config
and ``GatewaySettings``: index, policy, in-flight and queued-prefill counts,
measured prefill speed), told what the gateway's handler would tell it --
a request sent, its first token, its end. Two gateways are two routers with
their own state, requests alternating between them.
``sglang_ca`` is a stand-in for sglang-router's ``cache_aware`` rule
(:class:`SglangCacheAware`), which the live benchmark runs for real.

What it leaves out: HTTP and the processes' CPU. A fixed 1 ms each way stands
in for the network. On two busy cores the live benchmark's TTFT moves by
~10 ms from run to run at low rates, which is the size of the differences
that decide whether prefix routing is ever worse than round-robin there; the
replay shows such differences without that noise, and a change to the
policy can be tried on both seeds in under a minute. The live benchmark
remains the measurement.

    python bench/routing_replay.py [--seed 1] [--policies prefix,round_robin] \\
        [--rates 4,8,...] [--decode-ms 25]      # the flags of bench/routing.py

Last line: one JSON object, per policy and rate ttft_p50_s, ttft_p90_s,
hit_rate (prompt tokens found cached over prompt tokens, of the requests that
arrived at that rate), cold_beside_decode (prompts with nothing cached whose
prefill began in a step that also decoded other answers); each policy's hit
rate over the run; saturation_rate and the targets, read as bench/routing.py
reads them.
"""

from __future__ import annotations

import heapq
import itertools
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import routing as live  # bench/routing.py: the setup, its flags, its targets

from llmgw import secrets, wire
from llmgw.gateway.routing.prefill import LEARN_AFTER_S
from llmgw.gateway.routing.prefixindex import block_hashes, render_chat
from llmgw.gateway.routing.router import ModelRouter
from llmgw.gateway.settings import GatewaySettings
from llmgw.gateway.snapshot import ConfigView
from llmgw.sim import benchstats
from llmgw.sim import tokens as simtokens
from llmgw.sim.core import EngineCore, Phase, SimRequest, Step
from llmgw.sim.workloads import TimedRequest

NETWORK_S = 0.001  # each way, gateway <-> engine
REPLAYED = ("round_robin", "least_loaded", "prefix", "prefix_2gw", live.SGLANG)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class InFlight:
    """One request between its pick and its end, as the gateway's handler tracks it."""

    request: TimedRequest
    router: Any  # ModelRouter, or the stand-in SglangCacheAware
    pick: Any  # Pick, or the stand-in's WorkerPick
    ahead: float  # prefill queued on the replica when it was sent (this gateway's view)
    sent_at: float
    engine: int
    first_at: float | None = None
    # Whether its prefill began in a step that also decoded others' answers
    # (a decode step longer than alone): the few ms that decide low rates.
    beside_decode: bool | None = None
    sim: SimRequest | None = field(default=None, repr=False)


def _router(setup: live.Setup, policy: str, clock: Clock) -> ModelRouter:
    """A gateway's router for the model, built as the gateway builds it, on the replay's clock."""
    endpoints = [
        wire.Endpoint(
            replica_id=f"r{i}", url=f"http://engine-{i}", kv_capacity_tokens=setup.kv_blocks * 16
        )
        for i in range(setup.engines)
    ]
    route = wire.ModelRoute(
        name=live.MODEL, served_name=live.MODEL, routing=live.POLICIES[policy], endpoints=endpoints
    )
    key = wire.ApiKeyInfo(key_id="bench", secret_hash=secrets.hash_secret(live.API_KEY))
    table = wire.RoutingTable(version=1, models=[route], gateways=live.gateway_count(policy))
    config = wire.GatewayConfig(routing=table, keys=[key])
    view = ConfigView(config, GatewaySettings(gateway_id="replay"), None, clock)
    return view.routes[live.MODEL]


@dataclass
class Worker:
    """An engine as the stand-in router counts it (the replay's bookkeeping needs these)."""

    replica_id: str
    in_flight: int = 0
    pending_prefill: float = 0.0
    held: set[int] = field(default_factory=set)  # block hashes sent to it
    size: int = 0  # characters of them: the "tree size" new text goes by

    def charge(self, tokens: float, now: float) -> None:
        self.pending_prefill += tokens

    def answered(self, tokens: float, now: float) -> None:
        self.pending_prefill -= tokens


@dataclass
class WorkerPick:
    replica: Worker
    uncached_tokens: float = 0.0


class SglangCacheAware:
    """A stand-in for sglang-router's ``cache_aware`` policy with its defaults (0.3.x).

    The live benchmark runs the real router; this is its rule in simulated
    time, so a difference it shows can be taken apart without the live run's
    noise. Per request: when the workers' in-flight counts differ by more
    than ``balance_abs`` and the largest is over ``balance_rel`` times the
    smallest, the least loaded; otherwise the worker that was sent the
    longest prefix of the prompt if it covers over ``cache_threshold`` of it,
    else the worker sent the least text so far (the most spare cache). The
    prompt is added to the chosen worker's text when it is sent. sglang keeps
    a radix tree of characters; here each worker has a set of chained hashes
    of 16-character blocks, which matches the same prefixes to within a
    block. Its eviction (every 60 s, past 2^26 characters) never triggers in a
    run of this size, so none is modelled.
    """

    wants_prompt = True  # the replay renders the prompt for it, as for ModelRouter
    block_chars = 16

    def __init__(
        self,
        engines: int,
        cache_threshold: float = 0.3,
        balance_abs: int = 64,
        balance_rel: float = 1.5,
    ) -> None:
        self.workers = [Worker(f"r{i}") for i in range(engines)]
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel

    def pick(self, prompt: str | None) -> WorkerPick:
        assert prompt is not None
        workers = self.workers
        hashes = block_hashes(prompt, self.block_chars)
        loads = [w.in_flight for w in workers]
        low, high = min(loads), max(loads)
        if high - low > self.balance_abs and high > low * self.balance_rel:
            chosen = workers[loads.index(low)]
        else:
            longest, holder = 0, None
            for worker in workers:
                matched = 0
                for block in hashes:
                    if block not in worker.held:
                        break
                    matched += 1
                if matched > longest:
                    longest, holder = matched, worker
            covered = min(longest * self.block_chars, len(prompt)) / max(len(prompt), 1)
            if holder is not None and covered > self.cache_threshold:
                chosen = holder
            else:
                chosen = min(workers, key=lambda w: w.size)
        for block in hashes:
            if block not in chosen.held:
                chosen.held.add(block)
                chosen.size += self.block_chars
        return WorkerPick(chosen)

    def measured(self, tokens: float, seconds: float) -> None:
        pass  # it has no speed estimate

    def record(self, pick: WorkerPick) -> None:
        pass  # it learns when it sends


def replay(setup: live.Setup, policy: str) -> dict[str, Any]:
    clock = Clock()
    params = setup.sim_params()
    engines = [EngineCore(params, clock=clock) for _ in range(setup.engines)]
    routers: list[Any] = (
        [SglangCacheAware(setup.engines)]
        if policy == live.SGLANG
        else [_router(setup, policy, clock) for _ in range(2 if policy == "prefix_2gw" else 1)]
    )
    steps: list[Step | None] = [None] * len(engines)
    order = itertools.count()  # ties in time are taken in the order they were queued
    events: list[tuple[float, int, str, Any]] = []
    for request in setup.workload():
        heapq.heappush(events, (request.at_s, next(order), "arrive", request))
    flights: dict[int, InFlight] = {}  # id(SimRequest) -> its request
    done: list[Done] = []

    def start_step(engine: int) -> None:
        step = engines[engine].next_step()
        steps[engine] = step
        if step is not None:
            for sim, _ in step.plan:
                started = flights.get(id(sim))
                if started is not None and started.beside_decode is None:
                    started.beside_decode = bool(step.decoding)
            heapq.heappush(events, (clock.now + step.seconds, next(order), "step", engine))

    while events:
        clock.now, _, kind, what = heapq.heappop(events)
        if kind == "arrive":
            request = what
            router = routers[request.index % len(routers)]
            prompt = render_chat(request.messages) if router.wants_prompt else None
            pick = router.pick(prompt)
            assert pick is not None
            replica = pick.replica
            flight = InFlight(
                request, router, pick, replica.pending_prefill, clock.now,
                int(replica.replica_id[1:]),
            )  # fmt: skip
            replica.in_flight += 1
            replica.charge(pick.uncached_tokens, clock.now)
            if getattr(pick, "by_prefix", False):
                router.record(pick)  # right after the send (Prefill)
            heapq.heappush(events, (clock.now + NETWORK_S, next(order), "submit", flight))
        elif kind == "learn":
            _learn(what)
        elif kind == "submit":
            flight = what
            body = simtokens.render_chat(flight.request.messages).encode()
            flight.sim = engines[flight.engine].submit(body, flight.request.max_tokens)
            flights[id(flight.sim)] = flight
            if steps[flight.engine] is None:
                start_step(flight.engine)
        else:
            engine = what
            step = steps[engine]
            assert step is not None
            engines[engine].finish(step)
            for sim in [req for req, _ in step.plan] + step.decoding:
                flight_or_none = flights.get(id(sim))
                if flight_or_none is None:
                    continue
                flight = flight_or_none
                if flight.first_at is None and sim.first_token_at is not None:
                    _answer_started(flight, clock.now)
                    learn_at = clock.now + NETWORK_S + LEARN_AFTER_S
                    heapq.heappush(events, (learn_at, next(order), "learn", flight))
                if sim.phase is Phase.DONE:
                    flight.pick.replica.in_flight -= 1
                    assert flight.first_at is not None
                    done.append(
                        Done(
                            flight.request.stage, flight.first_at - flight.request.at_s,
                            sim.cached_tokens, sim.prompt_tokens, bool(flight.beside_decode),
                        )
                    )  # fmt: skip
                    del flights[id(sim)]
            start_step(engine)
    return _summary(setup, done)


def _answer_started(flight: InFlight, now: float) -> None:
    """What the gateway does at a stream's first chunk (gateway/routing/prefill.py, started).

    ``now``: when the engine sent it, which is when its queue moves on.
    """
    flight.first_at = now + NETWORK_S
    pick = flight.pick
    pick.replica.answered(pick.uncached_tokens, now)


def _learn(flight: InFlight) -> None:
    """What it does LEARN_AFTER_S later (Prefill.started): the speed sample."""
    pick = flight.pick
    assert flight.first_at is not None
    if flight.ahead < 1.0:
        flight.router.measured(pick.uncached_tokens, flight.first_at - flight.sent_at)


@dataclass(frozen=True)
class Done:
    """One answered request, as the summary reads it."""

    stage: int
    ttft: float
    cached_tokens: int
    prompt_tokens: int
    beside_decode: bool


def _summary(setup: live.Setup, done: list[Done]) -> dict[str, Any]:
    rates: dict[str, Any] = {}
    for stage, rate in enumerate(setup.rates):
        rows = [row for row in done if row.stage == stage]
        ttfts = [row.ttft for row in rows]
        queried = sum(row.prompt_tokens for row in rows)
        cached = sum(row.cached_tokens for row in rows)
        rates[f"{rate:g}"] = {
            "ttft_p50_s": _round(benchstats.percentile(ttfts, 50)),
            "ttft_p90_s": _round(benchstats.percentile(ttfts, 90)),
            "hit_rate": _round(cached / queried if queried else None),
            "requests": len(rows),
            # Prompts with nothing cached whose prefill shared a step with
            # others' decode: what round-robin's rotation mostly avoids at
            # low rates, and what sets every policy's p90 at 8 req/s.
            "cold_beside_decode": sum(
                1 for row in rows if row.beside_decode and row.cached_tokens == 0
            ),
        }
    queried = sum(row.prompt_tokens for row in done)
    cached = sum(row.cached_tokens for row in done)
    return {"rates": rates, "hit_rate_all": _round(cached / queried)}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def main(argv: list[str] | None = None) -> int:
    args, setup = live.parse_args(argv)
    policies = args.policies.split(",") if args.policies else list(REPLAYED)
    for policy in policies:
        if policy not in REPLAYED:
            raise SystemExit(f"policy {policy!r} is not replayed; these are: {', '.join(REPLAYED)}")
    results = {policy: replay(setup, policy) for policy in policies}
    for policy, result in results.items():
        print(f"\n{policy}  (hit rate over the run: {result['hit_rate_all']})", file=sys.stderr)
        print("  rate  p50_s   p90_s   hit    reqs  cold beside decode", file=sys.stderr)
        for rate, row in result["rates"].items():
            print(
                f"  {rate:>4}  {row['ttft_p50_s']:6.3f}  {row['ttft_p90_s']:6.3f}"
                f"  {row['hit_rate']:5.3f}  {row['requests']:4d}  {row['cold_beside_decode']:4d}",
                file=sys.stderr,
            )
    print(json.dumps(live.results_json({"bench": "routing_replay", "seed": setup.seed}, results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
