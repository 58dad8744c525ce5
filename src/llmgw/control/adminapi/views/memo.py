"""Views reused between two summaries while what they were built from is unchanged.

Between two summaries most nodes and replicas of a steady fleet change
nothing, and building 2,000 node views was half of a summary's time. A memo
maps a node's or replica's name to the inputs its last count-only view was
built from, and that view; a view whose inputs compare equal is handed back
instead of being built again.

Inputs are tuples of the record's fields compared with ``!=``: tuple equality
tries identity first, element by element, in C, so an unchanged inventory or
shard list costs a pointer comparison. That is sound only because the
control plane replaces inventories, fabric lists, weights, refusals and shard
lists rather than editing them in place (Agents.report);
tests/control/adminapi/test_summary_memo.py changes each input the way the
control plane does and expects the next summary to see it.

Only count-only views are memoised (a node's without its device list, a
replica's without detail): they are read for their counts and dropped, never
handed out, so a reused one may even be updated in place (a replica's idle
time moves with the clock).

The lookups themselves are written out where each view is built (nodes.py,
replicas.py) rather than behind a helper here: a function call per node and
per replica is a cost every summary would pay thousands of times.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TypeAlias, TypeVar

V = TypeVar("V")

# name -> (the inputs the view was built from, the view)
Memo: TypeAlias = dict[str, tuple[tuple[object, ...], V]]

# Entries beyond twice the fleet, plus this, trigger a sweep: a small fleet
# that churns should not sweep on every pass.
_SWEEP_SLACK = 64


def forget_gone(memo: Memo[V], alive: Collection[str]) -> None:
    """Drop the entries of names not in ``alive`` (the fleet's records by name), once many.

    Called once per pass. The sweep runs only when the memo has grown past
    twice the fleet, so a steady fleet never pays for it and one that churns
    pays once per doubling; without it, nodes and replicas that left would be
    kept alive forever.
    """
    if len(memo) > 2 * len(alive) + _SWEEP_SLACK:
        for gone in [name for name in memo if name not in alive]:
            del memo[gone]
