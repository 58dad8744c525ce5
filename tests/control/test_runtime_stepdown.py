"""A leader whose write is refused for a stale epoch steps down and contends again."""

from __future__ import annotations

import pytest
from tests.control.planekit import running
from tests.waiting import eventually

from llmgw.control.plane import ControlPlane
from llmgw.control.reconciler import PassResult, Reconciler
from llmgw.errors import NotLeaderError


async def test_a_refused_pass_lets_go_of_the_lock_and_contends_again(
    cp: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_pass = Reconciler.run_pass
    refused = 0

    async def refused_once(self: Reconciler, now: float, epoch: int) -> PassResult:
        nonlocal refused
        if refused == 0:
            refused += 1
            raise NotLeaderError(f"epoch {epoch} is no longer current")
        return await real_pass(self, now, epoch)

    monkeypatch.setattr(Reconciler, "run_pass", refused_once)
    async with running(cp, reconcile_interval_s=0.1) as runtime:
        first_epoch = runtime.election.epoch
        assert first_epoch >= 1
        # Stepping down while still holding the lock would leave no leader
        # at all: nobody else can take it, and this instance does not lead.
        await eventually(
            lambda: refused and cp.is_leader and runtime.election.epoch > first_epoch, 10,
            "a refused pass, then leading again under a newer epoch",
            note=lambda: (refused, cp.is_leader, runtime.election.epoch))
