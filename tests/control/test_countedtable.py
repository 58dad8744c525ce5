"""Tables that count their writes (the catalog's, the nodes') count every one and nothing else.

ModelTable and NodeTable take their counting from CountedTable; each is
checked here, so that one overriding a dict method cannot stop counting
unseen.
"""

from __future__ import annotations

import pytest

from llmgw.control.countedtable import CountedTable
from llmgw.control.modeltable import ModelTable
from llmgw.control.nodetable import NodeTable


@pytest.mark.parametrize("kind", [CountedTable, ModelTable, NodeTable])
def test_the_table_counts_every_write(kind: type[CountedTable[int]]) -> None:
    table = kind({"a": 1})
    counts = [table.version]
    table["b"] = 2
    counts.append(table.version)
    del table["a"]
    counts.append(table.version)
    assert table.pop("b") == 2
    counts.append(table.version)
    assert table.pop("x", 0) == 0
    counts.append(table.version)  # nothing written
    table.setdefault("c", 3)
    counts.append(table.version)
    table.setdefault("c", 4)
    counts.append(table.version)  # there already: nothing written
    table.update(d=4)
    counts.append(table.version)
    table |= {"e": 5}
    counts.append(table.version)
    table.popitem()
    counts.append(table.version)
    table.clear()
    counts.append(table.version)
    assert counts == [0, 1, 2, 3, 3, 4, 4, 5, 6, 7, 8]
    assert table == {}
