"""The runtime's periodic gc.freeze never makes garbage immortal (found by bench/soak.py)."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from pathlib import Path

import pytest

from llmgw.control import runtime as runtime_module
from llmgw.control.runtime import ControlPlaneRuntime
from llmgw.control.service import ControlPlane
from llmgw.control.store.repo import Store


class Node:
    """A reference cycle, as SQLAlchemy statements and exception tracebacks form."""

    def __init__(self) -> None:
        self.me = self


async def test_cyclic_garbage_is_collected_before_the_runtime_freezes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runtime_module, "HEARTBEAT_FLUSH_S", 0.05)
    store = await Store.open(f"sqlite:///{tmp_path / 'cp.db'}")
    cp = ControlPlane(store)
    await cp.load()
    runtime = ControlPlaneRuntime(cp, reconcile_interval_s=0.1)
    # Only the runtime may collect: an automatic collection could free the
    # cycle before a freeze and hide the leak.
    gc.disable()
    try:
        await runtime.start()
        garbage = weakref.ref(Node())  # unreachable from here on, but a cycle
        frozen_before = gc.get_freeze_count()
        deadline = time.monotonic() + 10
        while gc.get_freeze_count() <= frozen_before:  # a flush froze survivors
            assert time.monotonic() < deadline, "the runtime never froze"
            await asyncio.sleep(0.05)
        # Frozen without a collection first, the cycle would live forever.
        assert garbage() is None
    finally:
        gc.enable()
        gc.unfreeze()
        await runtime.stop()
        await store.close()
