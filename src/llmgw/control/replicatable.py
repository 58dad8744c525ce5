"""The fleet's replicas by id, also kept by model and by node.

At 10,000 nodes and as many replicas, "the replicas of this model" and
"the replicas on this node" asked by scanning every replica cost a
millisecond or more each, and they are asked once per model (the planner,
the gateways' routing table) and once per agent report (its assignments):
5,000 models made the planner scan 50 million records, 2,000 reports a
second would have spent more than the whole of one core on the scans
alone. So the table keeps both indexes as replicas come and go.

It is a dict, so every reader and writer that treats ``FleetState.replicas``
as one (``[rid] = r``, ``pop``, ``del``, ``update``, ``clear``) keeps
working and keeps the indexes right (and the write log, ``writes``, its
records' own). What it relies on: a replica's model
and shards never change once it is in the table (a replica that moves is a
new replica; a restart keeps both).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol, TypeVar, overload

from llmgw.control.writelog import WriteLog


class _Shard(Protocol):
    @property
    def node(self) -> str: ...


class _Replica(Protocol):
    @property
    def model(self) -> str: ...

    @property
    def shards(self) -> Any: ...  # a sequence of _Shard


R = TypeVar("R", bound=_Replica)
_D = TypeVar("_D")
_MISSING: Any = object()


class ReplicaTable(dict[str, R]):
    __slots__ = ("_by_model", "_by_node", "version", "writes")

    def __init__(self, items: Mapping[str, R] | Iterable[tuple[str, R]] = ()) -> None:
        super().__init__()
        # model or node -> replica id -> replica, in the order they came in.
        self._by_model: dict[str, dict[str, R]] = {}
        self._by_node: dict[str, dict[str, R]] = {}
        # Counts every write: a reader that saw this number has seen the
        # table as it is (the scheduler's keeper skips its scan of 10,000
        # replicas when nothing was added, replaced or removed).
        self.version = 0
        # The fields assigned on the replicas here (writelog.py).
        self.writes: WriteLog[R] = WriteLog()
        self.update(items)

    # -- the indexes -------------------------------------------------------------

    def of_model(self, model: str) -> Iterable[R]:
        """The model's replicas (a live view: copy it before changing the table).

        In the table's order, unless an id was given a record of another
        model or other nodes: that one then comes last here.
        """
        found = self._by_model.get(model)
        return found.values() if found else ()

    def models(self) -> Iterable[str]:
        """The models that have replicas here (a live view)."""
        return self._by_model.keys()

    def on_node(self, node: str) -> Iterable[R]:
        """Replicas with a shard on ``node`` (a live view, like ``of_model``)."""
        found = self._by_node.get(node)
        return found.values() if found else ()

    def _index(self, rid: str, replica: R) -> None:
        self._by_model.setdefault(replica.model, {})[rid] = replica
        for shard in replica.shards:
            self._by_node.setdefault(shard.node, {})[rid] = replica

    def _unindex(self, rid: str, replica: R) -> None:
        _drop(self._by_model, replica.model, rid)
        for shard in replica.shards:
            _drop(self._by_node, shard.node, rid)

    # -- dict writes, each keeping the indexes -------------------------------------

    def __setitem__(self, rid: str, replica: R) -> None:
        old = self.get(rid)
        # Unindexed first, then indexed: an id given a record of the same
        # model and nodes keeps its place in the indexes (assignment to an
        # existing key), as it keeps it in the table.
        if old is not None and (old.model != replica.model or _nodes(old) != _nodes(replica)):
            self._unindex(rid, old)
        super().__setitem__(rid, replica)
        self._index(rid, replica)
        self.writes.adopt(replica)
        self.version += 1

    def __delitem__(self, rid: str) -> None:
        replica = self[rid]
        super().__delitem__(rid)
        self._unindex(rid, replica)
        self.version += 1

    @overload
    def pop(self, rid: str) -> R: ...

    @overload
    def pop(self, rid: str, default: R | _D) -> R | _D: ...

    def pop(self, rid: str, default: Any = _MISSING) -> Any:
        if rid not in self:
            if default is _MISSING:
                raise KeyError(rid)
            return default
        replica = self[rid]
        del self[rid]
        return replica

    def popitem(self) -> tuple[str, R]:
        rid, replica = super().popitem()
        self._unindex(rid, replica)
        self.version += 1
        return rid, replica

    def clear(self) -> None:
        super().clear()
        self._by_model.clear()
        self._by_node.clear()
        self.version += 1

    def setdefault(self, rid: str, default: R) -> R:
        if rid not in self:
            self[rid] = default
        return self[rid]

    def update(self, *args: Any, **kwargs: R) -> None:
        for rid, replica in dict(*args, **kwargs).items():
            self[rid] = replica

    def __ior__(self, other: Any) -> ReplicaTable[R]:  # type: ignore[override,misc]
        self.update(other)
        return self


def _drop(index: dict[str, dict[str, Any]], key: str, rid: str) -> None:
    bucket = index.get(key)
    if bucket is not None:
        bucket.pop(rid, None)
        if not bucket:
            del index[key]


def _nodes(replica: _Replica) -> list[str]:
    return [s.node for s in replica.shards]
