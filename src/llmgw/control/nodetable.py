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

from llmgw.control.countedtable import CountedTable
from llmgw.control.writelog import WriteLog

V = TypeVar("V")


class NodeTable(CountedTable[V]):
    __slots__ = ("writes",)

    def __init__(self, *args: Any, **kwargs: V) -> None:
        super().__init__(*args, **kwargs)
        # The fields assigned on the nodes here.
        self.writes: WriteLog[V] = WriteLog()
        for value in self.values():
            self.writes.adopt(value)

    def __setitem__(self, name: str, value: V) -> None:
        super().__setitem__(name, value)
        self.writes.adopt(value)

    def update(self, *args: Any, **kwargs: V) -> None:
        added = dict(*args, **kwargs)
        super().update(added)
        for value in added.values():
            self.writes.adopt(value)


__all__ = ["NodeTable"]
