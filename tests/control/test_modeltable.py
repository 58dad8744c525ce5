"""The catalog's table counts every write, and nothing else."""

from __future__ import annotations

from llmgw.control.modeltable import ModelTable
from llmgw.control.state import FleetState


def test_the_model_table_counts_every_write() -> None:
    table: ModelTable[int] = ModelTable({"a": 1})
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


def test_a_fleet_state_keeps_its_models_in_a_counting_table() -> None:
    assert isinstance(FleetState().models, ModelTable)
    given = FleetState(models={})
    assert isinstance(given.models, ModelTable)
