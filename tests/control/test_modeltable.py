"""The fleet state keeps its catalog in a table that counts its writes (test_countedtable)."""

from __future__ import annotations

from llmgw.control.modeltable import ModelTable
from llmgw.control.state import FleetState


def test_a_fleet_state_keeps_its_models_in_a_counting_table() -> None:
    assert isinstance(FleetState().models, ModelTable)
    given = FleetState(models={})
    assert isinstance(given.models, ModelTable)
