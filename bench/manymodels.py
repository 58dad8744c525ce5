"""Many models on few GPUs: 100 LoRA adapters of one base against 100 whole on-demand models.

The same traffic twice, on the same devices:

* adapters: one base model (an 8B fine-tuned many ways) on ``--base-replicas``
  GPUs, each engine with ``--max-loras`` adapter slots, and ``--adapters``
  adapters of it; which adapter is loaded where is decided by llmgw's own
  policy (``llmgw.control.adapters.plan_adapters``, run on a FleetState as
  the reconciler runs it after a request asks for an adapter that is not
  loaded), loads and unloads serialised per engine and costing
  ``--lora-load-s`` / ``--lora-unload-s``;
* whole models: each adapter merged into a whole on-demand model, on the
  same GPUs, one replica per GPU, placed and evicted by llmgw's own
  scheduler (``Scheduler.decide`` on a FleetState, passes every second and
  on each demand, as the reconciler runs them: an idle replica is evicted
  for another model only after ``evict_min_idle_s``, longest idle first), a
  cold start (``--cold-start-s``) for each start; a request waits at most
  the gateway's hold (``--hold-s``, 180 s) and is refused after it (counted
  with the hold as its TTFT).

A few whole always-on models (``--whole``) take their own GPUs and a share of
the traffic in both runs. Requests arrive as a Poisson process of
``--rate`` per second for ``--minutes`` of simulated time; an adapter is
drawn from a Zipf law (exponent ``--zipf``) over its popularity rank.

What this is, and is not: a model of the fleet in virtual time, run on
llmgw's adapter-placement code with engine timings sized like a real GPU
fleet (vLLM loading an adapter of a few tens of MB in about half a second;
starting an 8B model, weights on local disk, about a minute). The HTTP path
(gateway hold, agent loads through the engine's runtime routes, routing
table) is what tests/test_adapters_e2e.py runs for real on simulated
engines, and tests/engines/test_vllm_adapters.py on vLLM.

    .venv/bin/python bench/manymodels.py [--quick] [--max-loras 8] [--rate 20] ...

Prints TTFT p50/p90 per popularity band (hot: ranks 1-10, warm: 11-30,
cold: 31-), loads and unloads per minute and requests that waited for a
load, for both runs. Last line: JSON with ``adapters``, ``ttft_p90_s_hot``,
``ttft_p90_s_cold``, ``loads_per_min``, ``whole_models_ttft_p90_s`` and
``verdict`` (``ok`` false when adapters' cold p90 is not under
``--cold-target-s`` or not a fifth of the whole models' p90; exit status 1).
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import random
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from llmgw.control.adapters import plan_adapters
from llmgw.control.scheduler.decide import Scheduler
from llmgw.control.scheduler.decisions import Policy
from llmgw.control.state import FleetState, ModelRecord, NodeRecord, ReplicaRecord
from llmgw.wire import Device, ModelSpec, NodeInventory, ReplicaState, ShardAssignment, device_label

BANDS = (("hot", 1, 10), ("warm", 11, 30), ("cold", 31, 10**9))
# The reconcile pass and the agent's nudge between a demand and the engine
# call (bench/coldstart.py measures tens of ms on this machine).
CONTROL_S = 0.05
# Prefill of a ~500-token prompt and the first decode step on an H100.
FIRST_TOKEN_S = 0.04
# The reconciler's pass interval when nothing wakes it.
PASS_S = 1.0
H100 = "NVIDIA H100 80GB HBM3"


@dataclass
class Request:
    at: float
    model: str
    rank: int  # popularity rank of an adapter (1 = hottest); 0 for a whole model


@dataclass
class Result:
    ttft: dict[str, list[float]] = field(default_factory=dict)  # band -> TTFTs
    waited: int = 0  # requests that waited for a load or a start
    loads: int = 0
    unloads: int = 0
    refused: int = 0  # waited past the gateway's hold: 503
    minutes: float = 1.0

    def add(self, band: str, ttft: float, waited: bool) -> None:
        self.ttft.setdefault(band, []).append(ttft)
        self.waited += waited

    def all(self) -> list[float]:
        return [t for band, ts in self.ttft.items() if band != "whole" for t in ts]


def traffic(args: argparse.Namespace, seed: int) -> list[Request]:
    rng = random.Random(seed)
    weights = [1.0 / (rank ** args.zipf) for rank in range(1, args.adapters + 1)]
    cumulative = list(itertools.accumulate(weights))
    out: list[Request] = []
    t = 0.0
    end = args.minutes * 60
    while True:
        t += rng.expovariate(args.rate)
        if t >= end:
            return out
        if rng.random() < args.whole_share:
            out.append(Request(t, f"whole-{rng.randrange(args.whole)}", 0))
            continue
        rank = bisect.bisect_left(cumulative, rng.random() * cumulative[-1]) + 1
        out.append(Request(t, f"ad-{rank:03d}", rank))


def band_of(rank: int) -> str:
    if rank == 0:
        return "whole"
    return next(name for name, low, high in BANDS if low <= rank <= high)


# -- adapters on their base's replicas ---------------------------------------------------


def adapter_fleet(args: argparse.Namespace) -> FleetState:
    state = FleetState()
    base = ModelSpec(name="base", engine="sim", min_replicas=args.base_replicas,
                     max_replicas=args.base_replicas,
                     sim={"max_loras": args.max_loras, "lora_load_s": args.lora_load_s,
                          "lora_unload_s": args.lora_unload_s})  # fmt: skip
    state.models["base"] = ModelRecord(spec=base, created_at=0, updated_at=0)
    for rank in range(1, args.adapters + 1):
        spec = ModelSpec(name=f"ad-{rank:03d}", engine="sim", base="base", min_replicas=0,
                         idle_timeout_s=args.idle_timeout_s)  # fmt: skip
        state.models[spec.name] = ModelRecord(spec=spec, created_at=0, updated_at=0)
    for i in range(args.base_replicas):
        node = f"gpu-node-{i // 8:02d}"
        if node not in state.nodes:
            state.nodes[node] = NodeRecord(name=node, registered_at=0, last_seen=0.0,
                                           inventory=NodeInventory(hostname=node))  # fmt: skip
        state.replicas[f"r{i:02d}"] = ReplicaRecord(
            id=f"r{i:02d}", model="base", created_at=0, state=ReplicaState.READY, ready_at=0,
            shards=[ShardAssignment(node=node, device_numbers=[i % 8])],
        )
    return state


def run_adapters(args: argparse.Namespace, requests: Sequence[Request]) -> Result:
    state = adapter_fleet(args)
    result = Result(minutes=args.minutes)
    ready_at: dict[tuple[str, str], float] = {}  # (replica, adapter) -> loaded at
    engine_free: dict[str, float] = dict.fromkeys(state.replicas, 0.0)  # serialised calls
    for request in requests:
        now = request.at
        if request.rank == 0:
            result.add("whole", FIRST_TOKEN_S, False)
            continue
        for node in state.nodes.values():
            node.last_seen = now
        model = state.models[request.model]
        model.demand_at = now  # the gateway's demand, or its use in the next load report
        holders = [r for r in state.replicas.values() if request.model in (r.adapters or ())]
        if not holders:
            plan = plan_adapters(state, now)
            for rid, names in plan.changes.items():
                replica = state.replicas[rid]
                before = set(replica.adapters or ())
                start = max(now + CONTROL_S, engine_free[rid])
                for gone in before - set(names):
                    start += args.lora_unload_s
                    result.unloads += 1
                    ready_at.pop((rid, gone), None)
                for added in [n for n in names if n not in before]:
                    start += args.lora_load_s
                    result.loads += 1
                    ready_at[(rid, added)] = start
                engine_free[rid] = start
                replica.adapters = names
                replica.loaded_adapters = frozenset(names)
            holders = [r for r in state.replicas.values() if request.model in (r.adapters or ())]
        if not holders:  # every slot holds an adapter used more recently: refused
            result.add(band_of(request.rank), args.hold_s, True)
            result.refused += 1
            continue
        loaded = min(ready_at[(r.id, request.model)] for r in holders)
        wait = max(0.0, loaded - now)
        if wait > args.hold_s:  # as for whole models: refused after the gateway's hold
            result.add(band_of(request.rank), args.hold_s, True)
            result.refused += 1
            continue
        result.add(band_of(request.rank), wait + FIRST_TOKEN_S, wait > 0)
    return result


# -- every adapter a whole on-demand model ---------------------------------------------------


def whole_fleet(args: argparse.Namespace) -> FleetState:
    """One node with the base's GPUs; every adapter a whole on-demand model of one GPU."""
    state = FleetState()
    devices = [
        Device(number=i, label=device_label(i), uuid=f"GPU-bench-{i}", name=H100,
               gpu_class="h100-80g", memory_total_mib=81920)
        for i in range(args.base_replicas)
    ]  # fmt: skip
    state.nodes["gpu-node-00"] = NodeRecord(
        name="gpu-node-00", registered_at=0, last_seen=0.0,
        inventory=NodeInventory(hostname="gpu-node-00", devices=devices),
    )
    for rank in range(1, args.adapters + 1):
        spec = ModelSpec(name=f"ad-{rank:03d}", engine="vllm", gpu_classes=["h100-80g"],
                         min_replicas=0, max_replicas=1, idle_timeout_s=args.idle_timeout_s,
                         start_timeout_s=args.cold_start_s * 10)  # fmt: skip
        state.models[spec.name] = ModelRecord(spec=spec, created_at=0, updated_at=0)
    return state


class WholeRun:
    """The same traffic on whole on-demand models, placed by llmgw's own scheduler
    (``Scheduler.decide``: demand, placement, eviction of replicas idle past
    ``evict_min_idle_s``, longest idle first) in virtual time, applied as the
    reconciler applies a pass; a replica is ready ``--cold-start-s`` after it
    was placed. A request waits at most the gateway's hold (``--hold-s``) and is
    refused after it (counted with the hold as its TTFT)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.state = whole_fleet(args)
        self.scheduler = Scheduler(Policy())
        self.draining_since: dict[str, float] = {}
        self.pending: dict[str, list[Request]] = {}
        self.result = Result(minutes=args.minutes)
        self.last_pass = -1.0

    def run(self, requests: Sequence[Request]) -> Result:
        tick = 0.0
        for request in requests:
            while tick + PASS_S <= request.at:  # the reconciler's interval
                tick += PASS_S
                self.reconcile(tick)
            self.arrive(request)
        end = self.args.minutes * 60 + self.args.hold_s
        while tick < end and any(self.pending.values()):
            tick += PASS_S
            self.reconcile(tick)
        for waiting in self.pending.values():  # never served within the hold
            for request in waiting:
                self.refuse(request)
        return self.result

    def arrive(self, request: Request) -> None:
        now = request.at
        if request.rank == 0:
            self.result.add("whole", FIRST_TOKEN_S, False)
            return
        replicas = self.state.replicas_of(request.model)
        ready = [r for r in replicas if r.state is ReplicaState.READY]
        if ready:
            ready[0].last_request_at = now
            self.result.add(band_of(request.rank), FIRST_TOKEN_S, False)
            return
        self.pending.setdefault(request.model, []).append(request)
        self.state.models[request.model].demand_at = now
        # A demand wakes the reconciler at once (coalesced, as its wake-ups are).
        if now - self.last_pass >= CONTROL_S:
            self.reconcile(now)

    def reconcile(self, now: float) -> None:
        self.last_pass = now
        state, args = self.state, self.args
        for node in state.nodes.values():
            node.last_seen = now
        for replica in list(state.replicas.values()):
            started = replica.created_at + args.cold_start_s
            if replica.state is ReplicaState.STARTING and started <= now:
                replica.move_to(ReplicaState.READY)
                replica.ready_at = started
        self.serve_pending(now)
        decisions = self.scheduler.decide(state, now, self.draining_since)
        for removal in decisions.removals:
            state.replicas.pop(removal.replica.id, None)
            self.draining_since.pop(removal.replica.id, None)
            self.result.unloads += removal.kind in ("evicted", "unloaded")
        for replica in decisions.mark_draining:
            live = state.replicas.get(replica.id)
            if live is not None and live.can_move_to(ReplicaState.DRAINING):
                live.move_to(ReplicaState.DRAINING)
        for replica in decisions.new:
            state.replicas[replica.id] = replica
            self.result.loads += 1
        for rid, since in decisions.draining_since.items():
            self.draining_since.setdefault(rid, since)

    def serve_pending(self, now: float) -> None:
        for name, waiting in self.pending.items():
            ready = [r for r in self.state.replicas_of(name) if r.state is ReplicaState.READY]
            kept = []
            for request in waiting:
                if ready:
                    at = max(request.at, ready[0].ready_at or now)
                    ready[0].last_request_at = max(ready[0].last_request_at or 0.0, at)
                    if at - request.at > self.args.hold_s:
                        self.refuse(request)
                    else:
                        self.result.add(band_of(request.rank), at - request.at + FIRST_TOKEN_S,
                                        True)  # fmt: skip
                elif now - request.at > self.args.hold_s:
                    self.refuse(request)
                else:
                    kept.append(request)
            waiting[:] = kept

    def refuse(self, request: Request) -> None:
        self.result.add(band_of(request.rank), self.args.hold_s, True)
        self.result.refused += 1


def run_whole(args: argparse.Namespace, requests: Sequence[Request]) -> Result:
    return WholeRun(args).run(requests)


# -- report ---------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def describe(title: str, result: Result) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    print(f"{title}:")
    for band in [b[0] for b in BANDS] + ["whole"]:
        values = result.ttft.get(band, [])
        rows[band] = {"n": len(values), "p50": round(pct(values, 0.5), 3),
                      "p90": round(pct(values, 0.9), 3)}  # fmt: skip
        print(f"  {band:6s} n={len(values):6d}  TTFT p50 {rows[band]['p50']:8.3f} s"
              f"  p90 {rows[band]['p90']:8.3f} s")
    print(f"  loads {result.loads / result.minutes:.1f}/min, unloads"
          f" {result.unloads / result.minutes:.1f}/min, requests that waited for a load or"
          f" start: {result.waited} of {sum(len(v) for v in result.ttft.values())},"
          f" refused after the hold: {result.refused}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=100)
    parser.add_argument("--base-replicas", type=int, default=4)
    parser.add_argument("--max-loras", type=int, default=16)
    parser.add_argument("--lora-load-s", type=float, default=0.5)
    parser.add_argument("--lora-unload-s", type=float, default=0.05)
    parser.add_argument("--cold-start-s", type=float, default=60.0)
    parser.add_argument("--hold-s", type=float, default=180.0,
                        help="the gateway's on-demand hold (queue_wait_s)")
    parser.add_argument("--whole", type=int, default=3, help="always-on whole models")
    parser.add_argument("--whole-share", type=float, default=0.1)
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second")
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--idle-timeout-s", type=float, default=900.0)
    parser.add_argument("--cold-target-s", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="5 simulated minutes")
    args = parser.parse_args(argv)
    if args.quick:
        args.minutes = 5.0
    requests = traffic(args, args.seed)
    print(f"{len(requests)} requests over {args.minutes:g} min; {args.adapters} adapters"
          f" (Zipf {args.zipf}) of one base on {args.base_replicas} GPUs x {args.max_loras}"
          f" adapter slots; {args.whole} whole models ({args.whole_share:.0%} of requests)")
    adapters = run_adapters(args, requests)
    whole = run_whole(args, requests)
    a_rows = describe("adapters", adapters)
    w_rows = describe("every adapter a whole on-demand model", whole)
    whole_p90 = pct(whole.all(), 0.9)
    cold = a_rows["cold"]["p90"]
    ok = cold <= args.cold_target_s and cold * 5 <= whole_p90
    out = {
        "adapters": args.adapters,
        "requests": len(requests),
        "ttft_p50_s_hot": a_rows["hot"]["p50"],
        "ttft_p90_s_hot": a_rows["hot"]["p90"],
        "ttft_p90_s_warm": a_rows["warm"]["p90"],
        "ttft_p90_s_cold": cold,
        "loads_per_min": round(adapters.loads / adapters.minutes, 2),
        "unloads_per_min": round(adapters.unloads / adapters.minutes, 2),
        "waited_for_load": adapters.waited,
        "refused": adapters.refused,
        "whole_models_ttft_p90_s": round(whole_p90, 3),
        "whole_models_ttft_p90_s_hot": w_rows["hot"]["p90"],
        "whole_models_starts_per_min": round(whole.loads / whole.minutes, 2),
        "whole_models_waited": whole.waited,
        "whole_models_refused": whole.refused,
        "mean_ttft_s": round(statistics.fmean(adapters.all() or [0.0]), 3),
        "verdict": {
            "ok": ok,
            "rule": f"adapters' cold-band TTFT p90 <= {args.cold_target_s:g} s and at most a"
                    " fifth of the whole models' p90",
        },
    }
    print(json.dumps(out))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
