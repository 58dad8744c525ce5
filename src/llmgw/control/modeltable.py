"""The catalog's models by name: a table that counts its writes.

The adapter index every report's answer reads (control.adapters) is rebuilt
when a model came, went or was replaced. The routing version would also tell
it, but that moves with every node that turns unreachable or back: at 10,000
nodes reporting slower than every 30 s that was nearly every report, and each
one walked the whole catalog again (a sixth of the control plane's CPU,
measured with py-spy). ``version`` moves on every write to the table and on
nothing else.

A record's ``spec`` is replaced only together with a write of the record
to the table (services.catalog does both), so a reader keyed on
``version`` never keeps a stale spec.
"""

from __future__ import annotations

from typing import TypeVar

from llmgw.control.countedtable import CountedTable

V = TypeVar("V")


class ModelTable(CountedTable[V]):
    __slots__ = ()


__all__ = ["ModelTable"]
