"""Judging a serving engine from its probes and metrics scrapes.

Two signs tell a hung engine from a busy one: its HTTP server stops
answering for a sustained run of probes (:class:`llmgw.agent.liveness.FailedProbes`),
or it has requests running while its token counters stand still
(:class:`llmgw.agent.progress.StallWatch`). While either lasts, the replica is
still routed to and its reason says why; once it has lasted long enough, the
engine is killed. The runner (agent.replicas) does the calls and acts on the
verdicts; this class only judges.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from llmgw.agent.liveness import FailedProbes, Liveness
from llmgw.agent.progress import StallWatch

log = logging.getLogger("llmgw.agent.replicas")


@dataclass(frozen=True)
class Verdict:
    reason: str | None  # what reports say of the replica; None: nothing amiss
    notify: bool = False  # report soon
    kill: bool = False  # hung or stalled long enough: kill the engine, fail with ``reason``


class ServingWatch:
    def __init__(self, replica_id: str, liveness: Liveness) -> None:
        self.replica_id = replica_id
        self.probes = FailedProbes(liveness)
        self.stall = StallWatch(liveness)

    def probed(
        self, path: str, error: str | None, began: float, began_wall: float, now: float
    ) -> Verdict | None:
        """A probe sent at ``began`` (monotonic; ``began_wall`` the same as time.time())
        ended at ``now`` with ``error`` (None: answered). None: nothing to change."""
        failed = self.probes
        if error is None:
            if failed.passed():
                log.info("replica %s answers %s again", self.replica_id, path)
                return Verdict(None, notify=True)
            return None
        first = not failed.failing
        # The engine has not answered since this probe was sent: the window
        # starts there, not when the probe gave up.
        failed.failed(error, began, began_wall)
        if failed.hung(now):
            return Verdict(failed.hung_reason(path, now), kill=True)
        if first:
            log.warning("replica %s: %s probe failed: %s", self.replica_id, path, error)
        # Still routed to: one slow answer is not a hung engine. The reason
        # shows in reports (and `llmgw ctl replicas`) while it lasts.
        return Verdict(failed.failing_reason(path), notify=first)

    def scraped(
        self, running: float, counters: tuple[float, ...], began: float, began_wall: float,
        now: float,
    ) -> Verdict | None:
        """A scrape sent at ``began`` read ``running`` and ``counters``. None: nothing to change."""
        stall = self.stall
        was_stalling = stall.stalling
        stall.observe(running, counters, began, began_wall)
        if not stall.stalling:
            if was_stalling:
                log.info("replica %s makes progress again", self.replica_id)
                return Verdict(None, notify=True)
            return None
        if stall.stalled(now):
            return Verdict(stall.stalled_reason(now), kill=True)
        if not was_stalling:
            log.warning("replica %s: %s", self.replica_id, stall.stalling_reason())
        return Verdict(stall.stalling_reason(), notify=not was_stalling)
