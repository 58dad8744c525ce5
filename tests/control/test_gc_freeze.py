"""The runtime's gc.freeze never makes garbage immortal (both leaks found by bench/soak.py)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
from tests.control.planekit import running
from tests.waiting import eventually

from llmgw.control import gcpause
from llmgw.control import runtime as runtime_module
from llmgw.control.gcpause import freeze_survivors
from llmgw.control.plane import ControlPlane


class Node:
    """A reference cycle, as SQLAlchemy statements and exception tracebacks form."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def collector_by_hand() -> Iterator[None]:
    # Only the code under test may collect: an automatic collection could
    # free a cycle before a freeze and hide the leak.
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


async def test_cyclic_garbage_is_collected_before_the_runtime_freezes(
    cp: ControlPlane, monkeypatch: pytest.MonkeyPatch, collector_by_hand: None
) -> None:
    monkeypatch.setattr(runtime_module, "HEARTBEAT_FLUSH_S", 0.05)
    monkeypatch.setattr(gcpause, "FREEZE_MIN_OBJECTS", 0)  # freeze at every flush
    async with running(cp, reconcile_interval_s=0.1):
        garbage = weakref.ref(Node())  # unreachable from here on, but a cycle
        frozen_before = gc.get_freeze_count()
        await eventually(lambda: gc.get_freeze_count() > frozen_before, 10,
                         "a flush to freeze survivors")
        # Frozen without a collection first, the cycle would live forever.
        assert garbage() is None


def test_a_small_old_generation_is_not_frozen_so_work_in_flight_stays_collectable(
    collector_by_hand: None,
) -> None:
    in_flight = Node()  # alive while the runtime looks, dropped afterwards
    ref = weakref.ref(in_flight)
    frozen = gc.get_freeze_count()
    assert freeze_survivors(min_objects=len(gc.get_objects(generation=2)) + 1000) is False
    assert gc.get_freeze_count() == frozen
    del in_flight
    gc.collect()
    assert ref() is None


def test_what_a_freeze_catches_in_flight_outlives_its_work(collector_by_hand: None) -> None:
    """Why freezing must be rare: a cycle alive at a freeze is never collected."""
    in_flight = Node()
    ref = weakref.ref(in_flight)
    assert freeze_survivors(min_objects=0) is True
    del in_flight
    gc.collect()
    assert ref() is not None  # leaked, for as long as the freeze holds
    gc.unfreeze()
    gc.collect()
    assert ref() is None
