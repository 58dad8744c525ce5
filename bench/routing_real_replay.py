"""bench/routing_real.py replayed in simulated time: its workload, its engines' cache rules.

The live benchmark takes ~7 minutes a seed and its engines' timings move
with the machine's load; this replays the same requests in seconds, so a
change to the prefix policy can be tried on many seeds before the live run
judges it. Each engine is a model of ``llama_cpp.server`` as the live
benchmark starts it, from llama-cpp-python's own code (llama.py,
llama_cache.py):

* one generation at a time, in arrival order;
* before a generation, the prompt's longest prefix among the cached states
  is loaded when it is longer than what the context already holds (the
  state cache's lookup also marks that state as just used, whichever it is);
* after it, the prompt and its answer are saved as one state, and the
  oldest states are dropped until ``cache_states`` remain;
* prefill costs ``prefill_ms`` a token, each answered token ``decode_ms``.

Tokens are modelled, not tokenised: a prompt is the template's shared
head, its tenant's context (``context_tokens`` x 1.06, as the live cache
budget counts it) and the question's own tokens. The gateway is llmgw's own
router (``ConfigView`` from the same route the live benchmark serves: one
gateway, endpoints that declare llama_cpp.server's dialect), told what the
gateway's handler tells it: the send, the first token, the usage.
``sglang_ca`` is bench/routing_replay.py's stand-in for sglang-router's
``cache_aware``.

    python bench/routing_real_replay.py [--seeds 0,1,2] [--routers prefix,sglang_ca,round_robin]

Last line: one JSON object, per router and seed hit_rate (a request is a
hit when at least half its prompt was found cached, as the live benchmark
counts), ttft_p50_s, ttft_mean_s, ttft_p90_s, generations per engine; and
per router the means over the seeds; per seed ``reachable_hits``, what a
sticky router and the best of all would get (bench/realkit/statecache.py).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import statistics
import sys
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import routing_real as live  # the workload and the route the live benchmark serves
from realkit import statecache
from routing_replay import SglangCacheAware

from llmgw import secrets, wire
from llmgw.gateway.routing.prefill import LEARN_AFTER_S
from llmgw.gateway.routing.prefixindex import render_chat
from llmgw.gateway.routing.turns import next_turn
from llmgw.gateway.settings import GatewaySettings
from llmgw.gateway.snapshot import ConfigView
from llmgw.sim import benchstats

NETWORK_S = 0.001
TEMPLATE_TOKENS = 12  # the chat template's head and the shared first line, alike for all
QUESTION_TOKENS = 18
ROUTERS = ("prefix", "round_robin", live.SGLANG)
# A llama_cpp.server dialect as the agent declares it: one generation at a time.
SERIAL = wire.EngineDialect(concurrent=False, max_completion_tokens=False, stream_usage=False)


@dataclass
class Timing:
    prefill_ms: float = 4.5
    decode_ms: float = 25.0
    # Per generation besides its tokens: the template, a cached state's load, the save after it.
    overhead_ms: float = 150.0


@dataclass
class Generation:
    flight: Flight
    tokens: tuple[Any, ...]
    found: int = 0
    cost: float = 0.0  # the router's estimate of its uncached tokens
    passed: int = 0
    began_at: float = 0.0  # when the engine began it (the gateway's turn)

    @property
    def blocks(self) -> list[int]:
        """Its prompt's block hashes, as the gateway's turns read them (Turns)."""
        hashes: list[int] = getattr(self.flight.pick, "hashes", [])
        return hashes


@dataclass
class Flight:
    index: int
    tenant: int
    at_s: float
    engine: int
    pick: Any
    router: Any
    ahead: float
    prompt_tokens: int
    output_tokens: int
    sent_at: float = 0.0
    first_at: float | None = None
    found: int = 0


class LlamaCppServer:
    """One llama_cpp.server engine: serial, a context, an LRU of saved states."""

    def __init__(self, cache_states: int, timing: Timing) -> None:
        self.cache: OrderedDict[tuple[Any, ...], None] = OrderedDict()
        self.cache_states = cache_states
        self.context: tuple[Any, ...] = ()
        self.queue: list[Generation] = []
        self.busy = False
        self.timing = timing
        self.generations: list[int] = []  # found tokens per generation

    @staticmethod
    def _common(a: tuple[Any, ...], b: tuple[Any, ...]) -> int:
        n = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            n += 1
        return n

    def begin(self, gen: Generation) -> tuple[float, float]:
        """(seconds to its first token, seconds to its end) from now."""
        prompt = gen.tokens
        in_context = self._common(self.context, prompt)
        found = in_context
        if self.cache:
            # The longest-prefix key, the first one found among equals; marked used.
            best_key, best = None, 0
            for key in self.cache:
                common = self._common(key, prompt)
                if common > best:
                    best_key, best = key, common
            if best_key is not None:
                self.cache.move_to_end(best_key)
                if best > in_context:
                    found = best
        found = min(found, len(prompt) - 1)  # the last token is always evaluated
        gen.found = found
        t = self.timing
        first = ((len(prompt) - found) * t.prefill_ms + t.decode_ms + t.overhead_ms) / 1000
        return first, first + (gen.flight.output_tokens - 1) * t.decode_ms / 1000

    def end(self, gen: Generation) -> None:
        answer = tuple(("a", gen.flight.index, i) for i in range(gen.flight.output_tokens))
        key = gen.tokens + answer
        self.context = key
        self.cache.pop(key, None)
        self.cache[key] = None
        while len(self.cache) > self.cache_states:
            self.cache.popitem(last=False)
        self.generations.append(gen.found)


def _router(setup: live.Setup, policy: str) -> Any:
    endpoints = [
        wire.Endpoint(replica_id=f"r{i}", url=f"http://engine-{i}",
                      kv_capacity_tokens=setup.n_ctx, dialect=SERIAL)
        for i in range(2)
    ]  # fmt: skip
    route = wire.ModelRoute(name=live.MODEL, served_name=live.MODEL,
                            routing=live.GATEWAY_POLICIES[policy], endpoints=endpoints)  # fmt: skip
    key = wire.ApiKeyInfo(key_id="bench", secret_hash=secrets.hash_secret(live.API_KEY))
    table = wire.RoutingTable(version=1, models=[route], gateways=1)
    config = wire.GatewayConfig(routing=table, keys=[key])
    return ConfigView(config, GatewaySettings(gateway_id="replay"), None).routes[live.MODEL]


def replay(setup: live.Setup, router_name: str, timing: Timing) -> dict[str, Any]:
    engines = [LlamaCppServer(setup.cache_states, timing) for _ in range(2)]
    router: Any = SglangCacheAware(2) if router_name == live.SGLANG else _router(setup, router_name)
    context_tokens = int(setup.context_tokens * 1.06)
    order = itertools.count()
    events: list[tuple[float, int, str, Any]] = []
    for request in setup.workload():
        heapq.heappush(events, (request.at_s, next(order), "arrive", request))
    ttfts: list[float] = []
    hits = 0
    flights: list[Flight] = []

    def start_next(engine_id: int, now: float) -> None:
        engine = engines[engine_id]
        if engine.busy or not engine.queue:
            return
        # llmgw's gateway holds a serial engine's queue and orders it (its
        # turns); sglang-router sends at once, and the engine serves in order.
        turns = router_name != live.SGLANG
        gen = engine.queue.pop(next_turn(engine.queue) if turns else 0)
        engine.busy = True
        gen.began_at = now
        first, whole = engine.begin(gen)
        heapq.heappush(events, (now + first, next(order), "first", gen))
        heapq.heappush(events, (now + whole, next(order), "end", (engine_id, gen)))

    while events:
        now, _, kind, what = heapq.heappop(events)
        if kind == "arrive":
            request = what
            tenant = live.tenant_of(request)
            prompt = render_chat(request.messages)
            pick = router.pick(prompt)
            replica = pick.replica
            engine_id = int(replica.replica_id[1:])
            tokens = (
                tuple(("h", i) for i in range(TEMPLATE_TOKENS))
                + tuple(("c", tenant, i) for i in range(context_tokens))
                + tuple(("q", request.index, i) for i in range(QUESTION_TOKENS))
            )
            output = request.max_tokens or setup.output_tokens
            flight = Flight(request.index, tenant, request.at_s, engine_id, pick, router,
                            replica.pending_prefill, len(tokens), output)  # fmt: skip
            flight.sent_at = now
            replica.in_flight += 1
            replica.charge(pick.uncached_tokens, now)
            if getattr(pick, "by_prefix", False):
                router.record(pick)  # right after the send (Prefill)
            flights.append(flight)
            submit = Generation(flight, tokens, cost=pick.uncached_tokens)
            heapq.heappush(events, (now + NETWORK_S, next(order), "submit", submit))
        elif kind == "submit":
            gen = what
            engines[gen.flight.engine].queue.append(gen)
            start_next(gen.flight.engine, now)
        elif kind == "first":
            flight = what.flight
            flight.first_at = now + NETWORK_S
            ttfts.append(flight.first_at - flight.at_s)
            pick = flight.pick
            pick.replica.answered(pick.uncached_tokens, now)
            heapq.heappush(events, (flight.first_at + LEARN_AFTER_S, next(order), "learn", flight))
        elif kind == "learn":
            flight = what
            pick = flight.pick
            if getattr(pick.replica, "serial", False):
                # Timed from its turn: its speed sample comes with its usage (Prefill.started).
                flight.router.record(pick)  # again as its answer starts (Prefill._learn)
            elif flight.ahead < 1.0:
                flight.router.measured(pick.uncached_tokens, flight.first_at - flight.sent_at)
        else:
            engine_id, gen = what
            engine = engines[engine_id]
            engine.end(gen)
            engine.busy = False
            flight = gen.flight
            flight.pick.replica.in_flight -= 1
            if gen.found * 2 >= flight.prompt_tokens:
                hits += 1
            if hasattr(router, "metered") and getattr(flight.pick, "prompt_chars", 0):
                # The engine reports no cached tokens; its time to the first
                # token since its turn began tells them (routing.cachesize).
                assert flight.first_at is not None
                computed_s = flight.first_at - NETWORK_S - gen.began_at
                router.metered(flight.pick, flight.prompt_tokens, 0, computed_s)
            start_next(engine_id, now)
    return {
        "hit_rate": round(hits / len(flights), 4),
        "ttft_p50_s": round(benchstats.percentile(ttfts, 50) or 0.0, 3),
        "ttft_mean_s": round(statistics.fmean(ttfts), 3),
        "ttft_p90_s": round(benchstats.percentile(ttfts, 90) or 0.0, 3),
        "generations_per_engine": [len(e.generations) for e in engines],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--prefill-ms", type=float, default=Timing.prefill_ms)
    parser.add_argument("--decode-ms", type=float, default=Timing.decode_ms)
    parser.add_argument("--overhead-ms", type=float, default=Timing.overhead_ms)
    parser.add_argument("--rate", type=float)
    args = parser.parse_args(argv)
    base = live.QUICK if args.quick else live.FULL
    if args.rate:
        base = live.replace(base, rate=args.rate)
    timing = Timing(args.prefill_ms, args.decode_ms, args.overhead_ms)
    seeds = [int(s) for s in args.seeds.split(",")]
    out: dict[str, Any] = {"bench": "routing_real_replay", "seeds": seeds}
    out["reachable_hits"] = {}
    for seed in seeds:
        setup = live.replace(base, seed=seed)
        order = [live.tenant_of(r) for r in setup.workload()]
        out["reachable_hits"][seed] = statecache.reachable(order, setup.cache_states)
        print(f"seed {seed}: hits reachable {out['reachable_hits'][seed]}", file=sys.stderr)
    for name in args.routers.split(","):
        rows = {seed: replay(live.replace(base, seed=seed), name, timing) for seed in seeds}
        means = {
            k: round(statistics.fmean(r[k] for r in rows.values()), 3)
            for k in ("hit_rate", "ttft_p50_s", "ttft_mean_s", "ttft_p90_s")
        }
        out[name] = {"seeds": rows, "mean": means}
        print(f"{name:12s} mean {means}", file=sys.stderr)
        for seed, row in rows.items():
            print(f"    seed {seed}: {row}", file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
