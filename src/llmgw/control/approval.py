"""Holding new nodes until an operator accepts them (``serve --approve-nodes``).

A join token proves only that its holder was given it; on a shared network
a leaked one lets any machine join the fleet, take replicas (and the prompts
routed to them) and read weights from its peers. With approval on, a node
that registers is kept cordoned (nothing is placed there) and gets no peer
token and no weight peers, until ``llmgw ctl nodes approve NAME``. Its
agent reports as usual meanwhile, so an operator sees its inventory before
deciding.

A node's fabrics decide which peers it copies weights from and which
multi-node replicas it joins; taken from its own report, one rogue node
could name any fabric. An operator can pin them (``llmgw ctl nodes fabrics
NAME ib-a``), and approving a node pins the fabrics it reported, the ones
the operator saw: from then on reports do not change them.

Which nodes wait is one JSON list under the ``pending_nodes`` setting (a
handful of names; no schema change), read with the nodes at load.
"""

from __future__ import annotations

import orjson

from llmgw.control.state import NodeRecord

SETTING = "pending_nodes"
# Nodes whose fabrics an operator set: their names (the fabrics are in the
# nodes table, as for any node).
PINNED_SETTING = "pinned_fabrics"


def parse(document: str | None) -> set[str]:
    return set(orjson.loads(document)) if document else set()


def dump(nodes: dict[str, NodeRecord]) -> str:
    return orjson.dumps(sorted(n.name for n in nodes.values() if n.pending_approval)).decode()


def dump_pinned(nodes: dict[str, NodeRecord]) -> str:
    return orjson.dumps(sorted(n.name for n in nodes.values() if n.fabrics_pinned)).decode()
