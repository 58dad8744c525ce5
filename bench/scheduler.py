"""Scheduler benchmark: a full reconcile pass from empty, a steady-state pass,
placements per second including the store's writes, the planner, peak RSS.

    .venv/bin/python bench/scheduler.py            # 2,000 nodes x 8 GPUs, 1,000 models
    .venv/bin/python bench/scheduler.py --quick    # 500 nodes, 250 models
    .venv/bin/python bench/scheduler.py --pg postgresql://user@host/db   # also PostgreSQL

The fleet comes from ``llmgw.sim.fleetgen.generate``: four
classes, 10 % of cards in MIG mode (some with nothing carved), four fabrics,
some unhealthy cards, a few cordoned, draining and unreachable nodes, weights
cached on a few nodes per model. The catalog mixes 1/2/4/8-GPU models,
2-node x 8 models, MIG models and on-demand ones, plus a few models that
cannot fit, so every steady-state pass also explains why.

Baseline measured in the same run: the pure placement pass (``decide``, no
store) on the same fleet, so ``store_share`` says how much of a pass is the
store's writes. With ``--split`` the pass from empty runs once more, its
parts timed (the snapshot of the fleet, the placement search, committing
placements to the snapshot, the rest of the decision, the rows and applying
them, the store's write): a separate run, so the wrappers' own cost stays
out of the figures above. The last line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

from llmgw.control.gcpause import paused_gc
from llmgw.control.reconciler import Reconciler
from llmgw.control.scheduler import shortfall
from llmgw.control.scheduler.decide import Scheduler
from llmgw.control.scheduler.keeper import SnapshotKeeper
from llmgw.control.scheduler.placement import Placer
from llmgw.control.scheduler.planner import plan
from llmgw.control.state import FleetState, ModelRecord
from llmgw.control.store.repo import Store
from llmgw.sim import fleetgen
from llmgw.wire import ReplicaState

NOW = 1_000_000.0
TARGETS = {"steady_pass_ms": 100.0, "placements_per_s": 5000.0, "planner_ms": 2000.0}


def build(nodes: int, models: int, seed: int) -> FleetState:
    state = fleetgen.generate(nodes=nodes, models=models, seed=seed, now=NOW)
    # Models that cannot be placed: a class nobody has, and more 8-GPU L4
    # replicas than there are L4 nodes.
    extra = [
        fleetgen.model("bench-never", classes=["b200-192g"], gpus=8),
        fleetgen.model(
            "bench-short", classes=["l4-24g"], gpus=8, min_replicas=nodes, max_replicas=nodes
        ),
    ]
    for spec in extra:
        state.models[spec.name] = ModelRecord(spec=spec, created_at=NOW, updated_at=NOW)
    return state


def _freeze() -> None:
    gc.collect()
    gc.freeze()


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


@asynccontextmanager
async def fresh_fleet(
    url: str, args: argparse.Namespace
) -> AsyncIterator[tuple[Store, FleetState, Reconciler, int]]:
    """The store at a new epoch, the generated fleet, and a reconciler on both."""
    store = await Store.open(url)
    try:
        epoch = await store.bump_epoch()
        state = build(args.nodes, args.models, args.seed)
        # What a running control plane does with its long-lived state: the
        # runtime freezes the heap after every heartbeat flush (every 5 s),
        # so the cyclic collector never walks the fleet's records again.
        _freeze()
        yield store, state, Reconciler(state, store), epoch
    finally:
        await store.close()


async def reconcile(url: str, args: argparse.Namespace) -> dict[str, float]:
    async with fresh_fleet(url, args) as (store, state, reconciler, epoch):
        started, cpu = time.perf_counter(), time.process_time()
        first = await reconciler.run_pass(NOW, epoch)
        full_s = time.perf_counter() - started
        full_cpu_s = time.process_time() - cpu
        # Agents report: every replica is up.
        for replica in state.replicas.values():
            replica.state = ReplicaState.READY
            replica.ready_at = NOW + 1
        _freeze()  # the new replicas are long-lived too (see above)
        steady, steady_cpu = [], []
        for step in range(args.steady_passes):
            started, cpu = time.perf_counter(), time.process_time()
            result = await reconciler.run_pass(NOW + 2 + step, epoch)
            steady.append(time.perf_counter() - started)
            steady_cpu.append(time.process_time() - cpu)
            if result.placed or result.removed:
                print(f"  note: steady pass {step} changed {result.placed}+{result.removed}")
        started, cpu = time.perf_counter(), time.process_time()
        planned = plan(state, NOW + 3, policy=reconciler.scheduler.policy)
        planner_s = time.perf_counter() - started
        planner_cpu_s = time.process_time() - cpu
        if args.cleanup:
            await store.write_replicas([], list(state.replicas), epoch=epoch)
        return {
            "placed": first.placed,
            "unplaceable": first.unplaceable,
            "full_s": full_s,
            "full_cpu_s": full_cpu_s,
            "steady_s": statistics.median(steady),
            "steady_cpu_s": statistics.median(steady_cpu),
            "planner_cpu_s": planner_cpu_s,
            "steady_max_s": max(steady),
            "planner_s": planner_s,
            "planned_models": len(planned.models),
            "replicas": len(state.replicas),
        }


@contextmanager
def timed_parts(parts: defaultdict[str, float]) -> Iterator[None]:
    """Add each wrapped function's wall time to ``parts`` under its name."""
    targets: list[tuple[Any, str, str]] = [
        (Scheduler, "decide", "decide"),
        (SnapshotKeeper, "refresh", "snapshot"),
        (Placer, "place", "placement search"),
        (shortfall, "commit", "commit to snapshot"),
        (Store, "write_replicas", "store write"),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]

    def wrap(function: Callable[..., Any], part: str) -> Callable[..., Any]:
        if asyncio.iscoroutinefunction(function):

            async def timed_async(*args: Any, **kwargs: Any) -> Any:
                started = time.perf_counter()
                try:
                    return await function(*args, **kwargs)
                finally:
                    parts[part] += time.perf_counter() - started

            return timed_async

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                parts[part] += time.perf_counter() - started

        return timed

    try:
        for (owner, name, part), (_, _, function) in zip(targets, saved, strict=True):
            setattr(owner, name, wrap(function, part))
        yield
    finally:
        for owner, name, function in saved:
            setattr(owner, name, function)


async def split_pass(url: str, args: argparse.Namespace) -> dict[str, float]:
    """The pass from empty once more, ms by part (see the module docstring)."""
    parts: defaultdict[str, float] = defaultdict(float)
    async with fresh_fleet(url, args) as (_, _, reconciler, epoch):
        with timed_parts(parts):
            started = time.perf_counter()
            await reconciler.run_pass(NOW, epoch)
            total = time.perf_counter() - started
    return split_of(parts, total)


def split_of(timed: Mapping[str, float], total: float) -> dict[str, float]:
    """The pass by part, ms, from the wrapped functions' seconds and the pass's.

    Two parts are what is left: of decide, once the three timed inside it
    are taken out, and of the pass, once decide and the store's write are.
    Those only mean something when the timed parts nest as the pass calls
    them (each inside its caller, none counted twice): a refresh moved out of
    decide, or a wrapped function that calls another, would make a rest
    negative, and the figures are refused rather than printed.
    """
    inside = timed["snapshot"] + timed["placement search"] + timed["commit to snapshot"]
    out = {
        "snapshot": timed["snapshot"],
        "placement search": timed["placement search"],
        "commit to snapshot": timed["commit to snapshot"],
        # Triage, replica records and their events, the evictable list.
        "rest of decide": timed["decide"] - inside,
        # Rows for the store, applying the pass to memory, the pass's result.
        "rows and applying": total - timed["decide"] - timed["store write"],
        "store write": timed["store write"],
        "total": total,
    }
    untimed = [part for part in ("snapshot", "placement search", "commit to snapshot",
                                 "store write") if out[part] <= 0]
    overlapping = [part for part in ("rest of decide", "rows and applying") if out[part] < 0]
    if untimed or overlapping:
        raise ValueError(f"the split does not hold: never timed {untimed}, negative (the"
                         f" timed parts overlap) {overlapping}: {out}")
    return {part: round(seconds * 1000, 1) for part, seconds in out.items()}


def baseline(args: argparse.Namespace) -> dict[str, float]:
    """The pass from empty without the store: decide as the reconciler runs it."""
    state = build(args.nodes, args.models, args.seed)
    _freeze()
    started = time.perf_counter()
    with paused_gc():
        decisions = Scheduler().decide(state, NOW)
    return {"placed": len(decisions.new), "decide_s": time.perf_counter() - started}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="500 nodes, 250 models")
    parser.add_argument("--nodes", type=int, default=None)
    parser.add_argument("--models", type=int, default=None)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steady-passes", type=int, default=5)
    parser.add_argument("--pg", default=None, help="also run against this PostgreSQL URL")
    parser.add_argument(
        "--split", action="store_true", help="time the pass from empty by part (one more run)"
    )
    args = parser.parse_args()
    args.nodes = args.nodes or (500 if args.quick else 2000)
    args.models = args.models or (250 if args.quick else 1000)
    args.cleanup = False

    base = baseline(args)
    with tempfile.TemporaryDirectory() as tmp:
        sqlite = asyncio.run(reconcile("sqlite:///" + str(Path(tmp) / "bench.db"), args))
    split = None
    if args.split:
        with tempfile.TemporaryDirectory() as tmp:
            split = asyncio.run(split_pass("sqlite:///" + str(Path(tmp) / "split.db"), args))
    pg = None
    if args.pg:
        args.cleanup = True
        pg = asyncio.run(reconcile(args.pg, args))

    gpus = sum(
        len(n.inventory.devices) if n.inventory else 0
        for n in build(args.nodes, 0, args.seed).nodes.values()
    )
    placements_per_s = sqlite["placed"] / sqlite["full_s"]
    decide_per_s = base["placed"] / base["decide_s"]
    print(
        f"fleet: {args.nodes} nodes, {gpus} placeable units (cards, MIG instances), "
        f"{args.models + 2} models"
    )
    print(
        f"full pass from empty (SQLite): {sqlite['full_s'] * 1000:.0f} ms, "
        f"{sqlite['placed']:.0f} replicas placed, {sqlite['unplaceable']:.0f} models unplaceable"
    )
    print(
        f"placements/s incl. store writes: {placements_per_s:.0f} "
        f"(placement alone: {decide_per_s:.0f}/s)"
    )
    print(
        f"steady-state pass: median {sqlite['steady_s'] * 1000:.1f} ms, "
        f"max {sqlite['steady_max_s'] * 1000:.1f} ms over {args.steady_passes} passes"
    )
    print(f"planner: {sqlite['planner_s'] * 1000:.0f} ms for {sqlite['planned_models']:.0f} models")
    if split is not None:
        print(
            "pass from empty by part (another run, timed by wrappers): "
            + ", ".join(f"{part} {ms:.0f} ms" for part, ms in split.items())
        )
    if pg is not None:
        print(
            f"PostgreSQL: full pass {pg['full_s'] * 1000:.0f} ms "
            f"({pg['placed'] / pg['full_s']:.0f} placements/s), "
            f"steady {pg['steady_s'] * 1000:.1f} ms"
        )
    rss = peak_rss_mb()
    print(f"peak RSS: {rss:.0f} MB")
    print(
        f"CPU time: full pass {sqlite['full_cpu_s'] * 1000:.0f} ms, steady pass"
        f" {sqlite['steady_cpu_s'] * 1000:.1f} ms, planner {sqlite['planner_cpu_s'] * 1000:.0f} ms"
        f" (load average {os.getloadavg()[0]:.1f})"
    )
    report = {
        "nodes": args.nodes,
        "gpus": gpus,
        "models": args.models + 2,
        "replicas": int(sqlite["replicas"]),
        "full_pass_ms": round(sqlite["full_s"] * 1000, 1),
        "steady_pass_ms": round(sqlite["steady_s"] * 1000, 1),
        "placements_per_s": round(placements_per_s),
        "planner_ms": round(sqlite["planner_s"] * 1000, 1),
        "peak_rss_mb": round(rss, 1),
        "baseline_placements_per_s_without_store": round(decide_per_s),
        "store_share": round(1 - (base["decide_s"] / sqlite["full_s"]), 3),
        # CPU seconds of this process: on a shared 2-core box the wall times
        # above include waiting for other processes; these do not.
        "full_pass_cpu_ms": round(sqlite["full_cpu_s"] * 1000, 1),
        "steady_pass_cpu_ms": round(sqlite["steady_cpu_s"] * 1000, 1),
        "planner_cpu_ms": round(sqlite["planner_cpu_s"] * 1000, 1),
        "placements_per_cpu_s": round(sqlite["placed"] / sqlite["full_cpu_s"]),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "targets_met": {
            "steady_pass_ms": sqlite["steady_s"] * 1000 <= TARGETS["steady_pass_ms"],
            "placements_per_s": placements_per_s >= TARGETS["placements_per_s"],
            "planner_ms": sqlite["planner_s"] * 1000 <= TARGETS["planner_ms"],
        },
    }
    if split is not None:
        report["full_pass_parts_ms"] = split
    if pg is not None:
        report["pg_full_pass_ms"] = round(pg["full_s"] * 1000, 1)
        report["pg_placements_per_s"] = round(pg["placed"] / pg["full_s"])
        report["pg_steady_pass_ms"] = round(pg["steady_s"] * 1000, 1)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
