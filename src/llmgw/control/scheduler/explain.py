"""Why a replica cannot be placed, as one sentence a person can act on.

"unplaceable" alone sends an operator to read every node; a sentence that
counts nodes by the reason that refused them ("0/2000 nodes fit: 1890 too
few free h100-80g (at most 2 free), 96 cordoned, 14 unreachable") says
whether to uncordon, add cards, or free some. Each node is counted once,
under its first rejection in filter order, so the counts add up to the
fleet. The status separates "cannot fit now" (wait, or free something) from
"can never fit" (change the catalog or the fleet).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from llmgw.control.scheduler.filters import (
    CORDONED,
    DRAINING,
    FAILED_HERE,
    MIG_ONE_INSTANCE,
    NO_CLASS,
    NO_FABRIC,
    NOT_ENTIRELY_FREE,
    TOO_FEW_FREE,
    TOO_FEW_HEALTHY,
    TOO_LITTLE_RAM,
    TOO_SMALL,
    UNREACHABLE,
    Request,
)
from llmgw.control.scheduler.snapshot import PlacementSnapshot
from llmgw.memory import RamNeed

if TYPE_CHECKING:
    from llmgw.control.scheduler.placement import Placer

CANNOT_FIT_NOW = "cannot fit now"
CAN_NEVER_FIT = "can never fit"

# How many fabrics a multi-node sentence names before summarising the rest.
_FABRICS_SHOWN = 6


def explain(
    placer: Placer, snapshot: PlacementSnapshot, request: Request
) -> tuple[str, str, dict[str, int]]:
    """(status, sentence, node counts by reason) for a request that did not fit."""
    if not request.classes:
        classes = " or ".join(request.mig_refused)
        devices = request.per_node * request.nodes
        shape = (
            f"needs {devices} devices per replica"
            if devices > 1
            else f"is split ({', '.join(request.split)})"
        )
        return (
            CAN_NEVER_FIT,
            f"{shape} but accepts only MIG class {classes}:"
            " a replica on MIG runs on exactly one instance",
            {},
        )
    counts, fit, most_free = _count(placer, snapshot, request)
    breakdown = _breakdown(counts, request, most_free)
    total = len(snapshot.nodes)
    keyed = {f"{reason}:{dim}": n for (reason, dim), n in counts.items()}
    if request.multi_node:
        return _explain_multi(placer, snapshot, request, fit, total, breakdown, keyed)
    largest = max(
        (
            snapshot.nodes[n].total.get(c, 0)
            for c in request.classes
            for n in snapshot.class_nodes(c)
        ),
        default=0,
    )
    cls = request.class_phrase()
    if largest == 0:
        # An empty fleet is the usual first minute (`llmgw up` schedules
        # before its own agent has registered): say so, rather than send
        # the reader to look for a node without these devices.
        where = "no node has joined the fleet yet" if total == 0 else f"no node has {cls}"
        return (
            CAN_NEVER_FIT,
            f"needs {request.per_node} {cls} on one node; {where}",
            keyed,
        )
    if largest < request.per_node:
        return (
            CAN_NEVER_FIT,
            f"needs {request.per_node} {cls} on one node; no node has that many"
            f" (the largest has {largest})",
            keyed,
        )
    short = _ram_short(snapshot, request)
    if short is not None:
        need, most = short
        return (
            CAN_NEVER_FIT,
            f"needs {need} MiB of RAM per replica; the node with the most has"
            f" {most} MiB for engines: {_LESS_RAM}",
            keyed,
        )
    return (
        CANNOT_FIT_NOW,
        f"needs {request.per_node} free {cls} on one node; {fit}/{total} nodes fit: {breakdown}",
        keyed,
    )


# What a person can change when a CPU replica does not fit in RAM.
_LESS_RAM = "lower the model's memory_mib or its context (kv_capacity_tokens), or add RAM"


def _ram_short(snapshot: PlacementSnapshot, request: Request) -> tuple[int, int] | None:
    """(the need, the RAM for engines) on the node with the most RAM, when no node with an
    accepted class has RAM enough for one shard; None when one may have."""
    if request.memory is None:
        return None
    views = [snapshot.nodes[n] for c in request.classes for n in snapshot.class_nodes(c)]
    short: tuple[int, int] | None = None
    for view in views:
        total = view.memory_total_mib
        need = request.memory.on(view.cpu_bf16)
        if total is None or total >= need:
            return None  # a node that does not report its RAM may have enough of it
        if short is None or total > short[1]:
            short = (need, total)
    return short


def _explain_multi(
    placer: Placer,
    snapshot: PlacementSnapshot,
    request: Request,
    fit: int,
    total: int,
    breakdown: str,
    keyed: dict[str, int],
) -> tuple[str, str, dict[str, int]]:
    cls = request.class_phrase()
    now_by_fabric: Counter[str] = Counter()
    ever_by_fabric: Counter[str] = Counter()
    for gpu_class in request.classes:
        now_here: Counter[str] = Counter()
        ever_here: Counter[str] = Counter()
        for name in snapshot.class_nodes(gpu_class):
            view = snapshot.nodes[name]
            for fabric in view.fabrics:
                now_here[fabric] += 0
                if view.total.get(gpu_class, 0) >= request.per_node:
                    ever_here[fabric] += 1
                if (
                    view.free_count(gpu_class) >= request.per_node
                    and placer.first_rejection(view, request) is None
                ):
                    now_here[fabric] += 1
        for fabric in now_here:
            now_by_fabric[fabric] = max(now_by_fabric[fabric], now_here[fabric])
            ever_by_fabric[fabric] = max(ever_by_fabric[fabric], ever_here[fabric])
    need = f"needs {request.nodes} nodes with {request.per_node}"
    if not ever_by_fabric:
        return (
            CAN_NEVER_FIT,
            f"{need} {cls} in one fabric; no node with {cls} is in a fabric",
            keyed,
        )
    if max(ever_by_fabric.values()) < request.nodes:
        return (
            CAN_NEVER_FIT,
            f"{need} {cls} in one fabric; {_per_fabric(ever_by_fabric)}",
            keyed,
        )
    return (
        CANNOT_FIT_NOW,
        f"{need} free {cls} in one fabric; {_per_fabric(now_by_fabric)};"
        f" {fit}/{total} nodes fit: {breakdown}",
        keyed,
    )


def _per_fabric(counts: Counter[str]) -> str:
    ordered = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    parts = []
    for index, (fabric, n) in enumerate(ordered[:_FABRICS_SHOWN]):
        noun = "" if index else (" such node" if n == 1 else " such nodes")
        parts.append(f"{fabric} has {n}{noun}")
    rest = ordered[_FABRICS_SHOWN:]
    if rest:
        parts.append(f"{len(rest)} more fabrics have at most {max(n for _, n in rest)}")
    return ", ".join(parts)


def _count(
    placer: Placer, snapshot: PlacementSnapshot, request: Request
) -> tuple[Counter[tuple[str, str]], int, dict[str, int]]:
    """Nodes by first rejection, nodes that fit, and the most free seen per class."""
    counts: Counter[tuple[str, str]] = Counter()
    most_free: dict[str, int] = {}
    fit = 0
    with_class: dict[str, None] = {}
    for gpu_class in request.all_classes:
        with_class.update(snapshot.class_nodes(gpu_class))
    # Nodes without any accepted class are counted without looking at them:
    # on a mixed fleet they are most of it.
    missing = len(snapshot.nodes) - len(with_class)
    if missing:
        counts[(NO_CLASS, request.class_phrase())] = missing
    for name in with_class:
        view = snapshot.nodes[name]
        rejection = placer.first_rejection(view, request)
        if rejection is None:
            fit += 1
            continue
        counts[(rejection.reason, rejection.dimension)] += 1
        if rejection.reason in (TOO_FEW_FREE, TOO_LITTLE_RAM) and rejection.available is not None:
            dim = rejection.dimension
            most_free[dim] = max(most_free.get(dim, 0), rejection.available)
    return counts, fit, most_free


def _breakdown(
    counts: Counter[tuple[str, str]], request: Request, most_free: dict[str, int]
) -> str:
    ordered = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(_phrase(rej, n, request, most_free) for rej, n in ordered)


# How each reason reads in the unplaceable sentence, after its count of
# nodes: {dim} is the rejection's dimension, {most} the most free seen on a
# node rejected for it; a reason not listed reads as itself.
# tests/control/scheduler pins the wording.
_PHRASES = {
    UNREACHABLE: "{reason}",
    CORDONED: "{reason}",
    DRAINING: "{reason}",
    NO_CLASS: "no {dim}",
    MIG_ONE_INSTANCE: "only MIG {dim} (one instance per replica)",
    TOO_SMALL: "fewer than {per_node} {dim} in all",
    TOO_FEW_HEALTHY: "too few healthy {dim}",
    TOO_FEW_FREE: "too few free {dim} (at most {most} free)",
    TOO_LITTLE_RAM: "too little free RAM (needs {memory_mib}, at most {most} MiB free)",
    NOT_ENTIRELY_FREE: "not entirely free",
    NO_FABRIC: "in no fabric",
    FAILED_HERE: "avoided after failures of {model} there",
}


def _phrase(key: tuple[str, str], n: int, request: Request, most_free: dict[str, int]) -> str:
    reason, dim = key
    words = _PHRASES.get(reason, "{reason}").format(
        reason=reason,
        dim=dim,
        most=most_free.get(dim, 0),
        per_node=request.per_node,
        memory_mib=_need_words(request.memory),
        model=request.model,
    )
    return f"{n} {words}"


def _need_words(need: RamNeed | None) -> str:
    """``3584 MiB`` or, where the node's CPU decides, ``3584 MiB (6656 MiB on CPUs without
    bfloat16)``."""
    if need is None:
        return "0 MiB"
    if need.float32 == need.native:
        return f"{need.native} MiB"
    return f"{need.native} MiB ({need.float32} MiB on CPUs without bfloat16)"
