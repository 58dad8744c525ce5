"""Placement of one replica: filters, then scorers, over indexed candidates.

The pipeline is assembled in one place (:class:`Placer`) so that the
reconciler, the planner and the tests all run exactly the same checks in
the same order. Placement reads a :class:`PlacementSnapshot` and returns what it
would do; applying it (``PlacementSnapshot.allocate``, writing replicas) is the
caller's separate step, so a dry run is the real run minus that step.

Candidates come from the snapshot's indexes rather than a scan of every
node: nodes holding the weights, then ready nodes in ascending order of free
devices (best fit). Like Nomad's limit iterator, only a bounded number of
feasible candidates are scored; past a handful, more candidates change the
choice rarely and cost a scan of the fleet every time. With the default
scorers the walk stops sooner still, once no node left could rank among
the candidates shown (``Placer._bucket_bound``): same pick, same candidates.
The filters still run on every candidate, so the index can narrow the
search but never admit a node a filter would refuse.
"""

from __future__ import annotations

from llmgw.control.scheduler.explain import explain
from llmgw.control.scheduler.filters import (
    AvoidFailedNodes,
    ClassAccepted,
    EnoughFreeDevices,
    EnoughMemory,
    Filter,
    InFabric,
    MigSingleInstance,
    NodeReady,
    Rejection,
    Request,
    WholeNode,
    usable_class,
)
from llmgw.control.scheduler.placed import Candidate, Placement, Unplaceable, pick_shard
from llmgw.control.scheduler.placementnode import PlacementNode
from llmgw.control.scheduler.scorers import BinPack, Scorer, Spread, WeightsLocal
from llmgw.control.scheduler.snapshot import PlacementSnapshot


class Placer:
    def __init__(self, *, candidate_limit: int = 8, show_top: int = 3) -> None:
        # Cheapest and most selective first: a node's state is one comparison
        # and rules out cordoned, draining and unreachable nodes before any
        # per-class work; class and MIG checks look at the node's class list;
        # the multi-node checks are one attribute each; counting free devices
        # comes next, then the RAM a CPU replica needs (only meaningful
        # once a free slot was found). The order also decides which reason a
        # node is counted under in an unplaceable sentence (its first
        # rejection). Avoiding nodes where the model failed is after all of
        # them: it is the only filter that relaxes (see try_place), so a node
        # some hard rule refuses must be counted under that rule.
        self.filters: tuple[Filter, ...] = (
            NodeReady(),
            ClassAccepted(),
            MigSingleInstance(),
            InFabric(),
            WholeNode(),
            EnoughFreeDevices(),
            EnoughMemory(),
            AvoidFailedNodes(),
        )
        # Weights outrank everything (copying weights is minutes), spreading
        # one model outranks packing (failure isolation), packing breaks ties.
        self.scorers: tuple[Scorer, ...] = (WeightsLocal(10.0), Spread(2.0), BinPack(1.0))
        self._weight_sum = sum(s.weight for s in self.scorers) or 1.0
        self.candidate_limit = candidate_limit
        self.show_top = show_top
        # Unplaceable answers by request shape and the versions of the nodes
        # of its classes (PlacementSnapshot.version): a model that did not fit last
        # pass, on a fleet that did not change where it could go, gets the
        # same answer without a fleet-wide explanation.
        self._memo: dict[tuple[object, ...], Unplaceable] = {}
        # Request -> the filters that apply to it (Filter.applies).
        self._applying: dict[Request, tuple[tuple[Filter, ...], tuple[Filter, ...]]] = {}
        self._applying_to: tuple[Filter, ...] = self.filters
        # The default scorers' weights (``_default_weights``), for the scorers
        # they were read from.
        self._weights: tuple[float, float, float] | None = None
        self._weights_of: tuple[Scorer, ...] | None = None
        self._scorer_names: tuple[str, ...] = ()

    # -- building blocks ---------------------------------------------------------

    def first_rejection(self, node: PlacementNode, request: Request) -> Rejection | None:
        for check in self._active(request):
            rejection = check.check(node, request)
            if rejection is not None:
                return rejection
        return None

    def _active(self, request: Request) -> tuple[Filter, ...]:
        """The filters that can refuse a node for ``request`` (Filter.applies), in order."""
        return self._applicable(request)[0]

    def _applicable(self, request: Request) -> tuple[tuple[Filter, ...], tuple[Filter, ...]]:
        """``_active``'s filters, and those of them a bucketed candidate must
        still pass (not ``indexed``)."""
        if self._applying_to is not self.filters:
            self._applying, self._applying_to = {}, self.filters
        found = self._applying.get(request)
        if found is None:
            if len(self._applying) >= 4096:
                self._applying.clear()
            active = tuple(f for f in self.filters if getattr(f, "applies", _always)(request))
            unindexed = tuple(f for f in active if not getattr(f, "indexed", False))
            found = self._applying[request] = (active, unindexed)
        return found

    def _default_weights(self) -> tuple[float, float, float] | None:
        """The weights of WeightsLocal, Spread and BinPack when those are the
        scorers, in that order (``_scored`` then computes them inline); None
        for any other set."""
        if self._weights_of is not self.scorers:
            scorers = self.scorers
            kinds = tuple(type(s) for s in scorers)
            self._weights = (
                (scorers[0].weight, scorers[1].weight, scorers[2].weight)
                if kinds == (WeightsLocal, Spread, BinPack)
                else None
            )
            self._scorer_names = tuple(s.name for s in scorers)
            self._weights_of = scorers
        return self._weights

    def _bucket_bound(self, weights: tuple[float, float, float]) -> float | None:
        """The highest total ``_place_single`` can give a node without the
        weights: spread and packing at their most (1), computed as it
        computes a total, so no such node's total is above it. None when a
        negative weight leaves no such bound."""
        w_weights, w_spread, w_pack = weights
        if w_spread < 0 or w_pack < 0 or self._weight_sum <= 0:
            return None
        total = w_weights * 0.0
        total += w_spread * 1.0
        total += w_pack * 1.0
        return round(total / self._weight_sum, 6)

    def score(self, node: PlacementNode, request: Request, gpu_class: str) -> Candidate:
        parts = []
        total = 0.0
        for scorer in self.scorers:
            value = scorer.score(node, request)
            parts.append((scorer.name, value))
            total += scorer.weight * value
        return Candidate(node.name, gpu_class, round(total / self._weight_sum, 6), tuple(parts))

    def _total(self, node: PlacementNode, request: Request) -> float:
        """``score(...).score`` without its parts: the parts are shown for the
        best few only, and building them for every candidate was a third of
        placing a replica."""
        total = 0.0
        for scorer in self.scorers:
            total += scorer.weight * scorer.score(node, request)
        return round(total / self._weight_sum, 6)

    # -- placing -----------------------------------------------------------------

    def place(
        self, snapshot: PlacementSnapshot, request: Request, *, expect_unplaceable: bool = False
    ) -> Placement | Unplaceable:
        """Place one replica, or say why not.

        ``expect_unplaceable``: the caller saw this shape fail recently, so
        looking up an earlier answer is likely to pay; the answer is the
        same either way.
        """
        key = self._memo_key(snapshot, request) if expect_unplaceable else None
        if key is not None:
            known = self._memo.get(key)
            if known is not None:
                return Unplaceable(request, known.status, known.reason, dict(known.counts))
        placement = self.try_place(snapshot, request)
        if placement is not None:
            return placement
        # Nothing fits even with the avoided nodes (try_place relaxed it):
        # the reason is the relaxed request's, and the memo holds for both.
        status, reason, counts = explain(self, snapshot, request.relaxed())
        result = Unplaceable(request, status, reason, counts)
        if len(self._memo) >= 4096:
            self._memo.clear()
        self._memo[key or self._memo_key(snapshot, request)] = result
        return result

    def _memo_key(self, snapshot: PlacementSnapshot, request: Request) -> tuple[object, ...]:
        return (
            request.classes,
            request.mig_refused,
            request.per_node,
            request.nodes,
            request.memory,
            len(snapshot.nodes),
            tuple(snapshot.version(c) for c in request.all_classes),
        )

    def try_place(self, snapshot: PlacementSnapshot, request: Request) -> Placement | None:
        """A placement, or None without the (fleet-wide) explanation.

        Nodes in ``request.avoid`` are used only when no other node fits:
        a model that failed on the one node that can take it is retried
        there (after its own backoff) rather than left unplaced.
        """
        placement = self._try_place(snapshot, request)
        if placement is None and request.avoid:
            placement = self._try_place(snapshot, request.relaxed())
        return placement

    def _try_place(self, snapshot: PlacementSnapshot, request: Request) -> Placement | None:
        if request.multi_node:
            return self._place_multi(snapshot, request)
        return self._place_single(snapshot, request)

    def _place_single(self, snapshot: PlacementSnapshot, request: Request) -> Placement | None:
        weights = self._default_weights()
        if weights is None:
            return self._place_single_scored(snapshot, request)
        # The same walk as _place_single_scored with the default scorers
        # written out (the same arithmetic in the same order, so the same
        # floats): per replica it is about ten candidates, and the calls per
        # filter, scorer and candidate were most of placing one.
        w_weights, w_spread, w_pack = weights
        weight_sum = self._weight_sum
        model, per_node, classes = request.model, request.per_node, request.classes
        limit = self.candidate_limit
        nodes = snapshot.nodes
        # (score, node, class, and each scorer's part for the best few shown)
        candidates: list[_Parted] = []
        seen: set[str] = set()
        active, unindexed = self._applicable(request)

        def consider(name: str, checks: tuple[Filter, ...]) -> bool:  # _consider
            if name in seen:
                return False
            seen.add(name)
            node = nodes[name]
            for check in checks:
                if check.check(node, request) is not None:
                    return False
            free = node.free
            for gpu_class in classes:  # usable_class
                held = free.get(gpu_class)
                if held and len(held) >= per_node:
                    break
            else:
                return False
            capacity = node.capacity_total
            local = 1.0 if model in node.weights else 0.0
            spread = 1.0 / (1.0 + node.replicas.get(model, 0))
            pack = 0.0 if capacity <= 0 else min(1.0, (node.used_total + per_node) / capacity)
            total = w_weights * local
            total += w_spread * spread
            total += w_pack * pack
            candidates.append((round(total / weight_sum, 6), name, gpu_class, local, spread, pack))
            return True

        every_holder_seen = True
        for examined, name in enumerate(snapshot.holders(model), start=1):
            if examined > 8 * limit or len(candidates) >= limit:
                every_holder_seen = False
                break
            consider(name, active)
        # The walk of the buckets stops as soon as nothing left in it can
        # change the answer: once every holder of the weights was looked at,
        # no node still to come scores above ``bound``, so with ``shown``
        # candidates at or above it the pick and the candidates shown are
        # the full walk's (later equal scores rank behind: the sort is
        # stable). At 10,000 nodes a holder with free devices usually wins,
        # and the walk was eight more candidates for every replica placed.
        bound = self._bucket_bound(weights) if every_holder_seen else None
        shown = max(1, self.show_top)
        strong = 0 if bound is None else sum(1 for c in candidates if c[0] >= bound)
        settled = strong >= shown
        found_in_buckets = 0
        # As _place_single_scored, limit included: once it is reached, each
        # later class still has the first node of its first bucket looked at.
        for gpu_class in classes:
            if settled:
                break
            buckets = snapshot.buckets(gpu_class)
            for count in sorted(c for c in buckets if c >= per_node):
                for name in buckets[count]:
                    if consider(name, unindexed):
                        found_in_buckets += 1
                        if bound is not None and candidates[-1][0] >= bound:
                            strong += 1
                            settled = strong >= shown
                    if found_in_buckets >= limit or settled:
                        break
                if found_in_buckets >= limit or settled:
                    break
        if not candidates:
            return None
        # Stable: equal scores keep candidate order (weights holders, then best fit).
        ranked = sorted(candidates, key=_by_score_parted)
        best = nodes[ranked[0][1]]
        local_name, spread_name, pack_name = self._scorer_names
        return Placement(
            request,
            [pick_shard(best, ranked[0][2], per_node)],
            candidates=[
                Candidate(
                    name,
                    gpu_class,
                    total,
                    ((local_name, local), (spread_name, spread), (pack_name, pack)),
                )
                for total, name, gpu_class, local, spread, pack in ranked[: self.show_top]
            ],
        )

    def _place_single_scored(
        self, snapshot: PlacementSnapshot, request: Request
    ) -> Placement | None:
        """_place_single through the scorers' objects: for other scorers than the default."""
        candidates: list[_Scored] = []
        seen: set[str] = set()
        active, unindexed = self._applicable(request)
        for examined, name in enumerate(snapshot.holders(request.model), start=1):
            if examined > 8 * self.candidate_limit or len(candidates) >= self.candidate_limit:
                break
            self._consider(snapshot.nodes[name], request, candidates, seen, active)
        found_in_buckets = 0
        for gpu_class in request.classes:
            buckets = snapshot.buckets(gpu_class)
            for count in sorted(c for c in buckets if c >= request.per_node):
                for name in buckets[count]:
                    if self._consider(snapshot.nodes[name], request, candidates, seen, unindexed):
                        found_in_buckets += 1
                    if found_in_buckets >= self.candidate_limit:
                        break
                if found_in_buckets >= self.candidate_limit:
                    break
        if not candidates:
            return None
        ranked = sorted(candidates, key=_by_score)
        best = snapshot.nodes[ranked[0][1]]
        return Placement(
            request,
            [pick_shard(best, ranked[0][2], request.per_node)],
            candidates=[
                self.score(snapshot.nodes[name], request, gpu_class)
                for _, name, gpu_class in ranked[: self.show_top]
            ],
        )

    def _consider(
        self,
        node: PlacementNode,
        request: Request,
        out: list[_Scored],
        seen: set[str],
        active: tuple[Filter, ...],
    ) -> bool:
        if node.name in seen:
            return False
        seen.add(node.name)
        for check in active:  # first_rejection, with the filters looked up once
            if check.check(node, request) is not None:
                return False
        gpu_class = usable_class(node, request)
        if gpu_class is None:
            return False
        out.append((self._total(node, request), node.name, gpu_class))
        return True

    def _place_multi(self, snapshot: PlacementSnapshot, request: Request) -> Placement | None:
        """Whole free nodes of one fabric, all of one class.

        Among fabrics that can take the replica, prefer the one whose chosen
        nodes hold the most weights, then the one with the fewest whole free
        nodes (best fit: large islands stay whole for larger replicas).
        """
        best: tuple[tuple[float, int, str, str], str, str, list[Candidate]] | None = None
        for gpu_class in request.classes:
            for fabric, names in sorted(snapshot.whole_free(gpu_class).items()):
                if len(names) < request.nodes:
                    continue
                chosen = self._fabric_candidates(snapshot, request, gpu_class, names)
                if len(chosen) < request.nodes:
                    continue
                chosen = chosen[: request.nodes]
                holders = sum(1 for c in chosen if request.model in snapshot.nodes[c.node].weights)
                key = (-float(holders), len(names), fabric, gpu_class)
                if best is None or key < best[0]:
                    best = (key, gpu_class, fabric, chosen)
        if best is None:
            return None
        _, gpu_class, fabric, chosen = best
        shards = [pick_shard(snapshot.nodes[c.node], gpu_class, request.per_node) for c in chosen]
        return Placement(request, shards, fabric=fabric, candidates=chosen[: self.show_top])

    def _fabric_candidates(
        self, snapshot: PlacementSnapshot, request: Request, gpu_class: str, names: dict[str, None]
    ) -> list[Candidate]:
        out: list[Candidate] = []
        seen: set[str] = set()
        wanted = request.nodes + self.candidate_limit
        ordered = [n for n in snapshot.holders(request.model) if n in names]
        for group in (ordered, names):
            for name in group:
                if len(out) >= wanted:
                    break
                if name in seen:
                    continue
                seen.add(name)
                view = snapshot.nodes[name]
                # The count first: both must pass, and at 10,000 nodes most
                # entirely free nodes of a fabric lack a whole node's worth of
                # the class (MIG cards, unhealthy ones), so the filters ran
                # fifty times for every candidate kept.
                if view.free_count(gpu_class) < request.per_node:
                    continue
                if self.first_rejection(view, request) is not None:
                    continue
                out.append(self.score(view, request, gpu_class))
        return _rank(out)


# (score, node, class): what ranking needs of a candidate (Placer._total).
_Scored = tuple[float, str, str]


def _by_score(candidate: _Scored) -> float:
    return -candidate[0]


# (score, node, class, and each default scorer's part): Placer._place_single's.
_Parted = tuple[float, str, str, float, float, float]


def _by_score_parted(candidate: _Parted) -> float:
    return -candidate[0]


def _always(request: Request) -> bool:
    return True


def _rank(candidates: list[Candidate]) -> list[Candidate]:
    # Stable: equal scores keep candidate order (weights holders, then best fit).
    return sorted(candidates, key=lambda c: -c.score)
