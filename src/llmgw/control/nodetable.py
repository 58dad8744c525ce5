"""The fleet's nodes by name: a dict that counts its writes and holds its nodes' write log.

Readers that keep something derived from the nodes (the admin summary's
keeper) read the fields of only the nodes written to since their last look
(``writes``, writelog.py), but must also know whether a node came, went or was
put in another's place; listing and comparing 10,000 names and records to
learn that it had not was ~1 ms a call. ``version`` answers it: it moves on
every write to the table (like ReplicaTable.version).
"""

from __future__ import annotations

from typing import Any, TypeVar

from llmgw.control.writelog import WriteLog

V = TypeVar("V")
_MISSING: Any = object()


class NodeTable(dict[str, V]):
    __slots__ = ("version", "writes")

    def __init__(self, *args: Any, **kwargs: V) -> None:
        super().__init__(*args, **kwargs)
        self.version = 0
        # The fields assigned on the nodes here.
        self.writes: WriteLog[V] = WriteLog()
        for value in self.values():
            self.writes.adopt(value)

    def __setitem__(self, name: str, value: V) -> None:
        super().__setitem__(name, value)
        self.writes.adopt(value)
        self.version += 1

    def __delitem__(self, name: str) -> None:
        super().__delitem__(name)
        self.version += 1

    def pop(self, name: str, default: Any = _MISSING) -> Any:
        if default is _MISSING:
            value = super().pop(name)
        elif name not in self:
            return default
        else:
            value = super().pop(name)
        self.version += 1
        return value

    def popitem(self) -> tuple[str, V]:
        item = super().popitem()
        self.version += 1
        return item

    def clear(self) -> None:
        super().clear()
        self.version += 1

    def setdefault(self, name: str, default: V) -> V:
        if name not in self:
            self[name] = default
        return self[name]

    def update(self, *args: Any, **kwargs: V) -> None:
        added = dict(*args, **kwargs)
        super().update(added)
        for value in added.values():
            self.writes.adopt(value)
        self.version += 1

    def __ior__(self, other: Any) -> NodeTable[V]:  # type: ignore[override,misc]
        self.update(other)
        return self


__all__ = ["NodeTable"]
