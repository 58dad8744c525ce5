"""Which failures a fault explains, and whether a fault's run passed.

A failure is excused only by a kill that can explain it: a replica killed
while the request was in flight, of the request's model, with the failure
arriving within ``NOTICE_S`` of the kill (kill -9 closes the engine's
sockets at once, so what it cut breaks at once; a failure long after was
something else). A killed replica explains at most as many failures as it
held requests (``Kill.held``), so failures of the same model on the replica
that lived are not excused by the one that died. A failure whose OpenAI code
says no replica took the request (``upstream_unavailable``,
``model_not_ready``, ...) is never excused, streamed or not: the gateway must
retry it elsewhere or hold it until a replica is there.

A fault passes when it ran, every failure is excused, the fleet was whole
again, requests were answered after the fault, every figure it claims was
measured, and the store lost nothing beyond its bound.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from chaoskit.load import UNSTARTED_CODES, Record

# From a kill to the failure of a request it cut: the gateway sees the
# engine's connection close at once and ends the client's answer.
NOTICE_S = 5.0


@dataclass(frozen=True)
class Kill:
    """One replica's engine killed."""

    at: float  # time.monotonic()
    model: str
    replica: str
    # Requests the engine held when it died, at most: its connections from
    # the gateway then (idle pooled ones included, so an upper bound).
    held: int


def excused(failures: Iterable[Record], kills: Sequence[Kill]) -> list[Record]:
    """The failures the kills explain (see the module docstring), each kill up to what it held."""
    room = [kill.held for kill in kills]
    out = []
    for record in sorted(failures, key=lambda r: r.done):
        if record.ok or record.code in UNSTARTED_CODES:
            continue
        for index, kill in enumerate(kills):
            if room[index] > 0 and _cut_by(record, kill):
                room[index] -= 1
                out.append(record)
                break
    return out


def _cut_by(record: Record, kill: Kill) -> bool:
    return (record.model == kill.model and record.sent <= kill.at <= record.done
            and record.done - kill.at <= NOTICE_S)


@dataclass(frozen=True)
class Judged:
    """What the verdict reads of one fault's run."""

    sent: int
    failed: int
    failed_unexcused: int
    answered_after: int  # answers to requests sent after the fault ended
    recovery_s: float | None
    lost: Mapping[str, int] | None  # catalog, keys, events, usage, usage_extra
    usage_bound: int
    figures: Mapping[str, float | None]
    skipped: str | None = None


def reasons(run: Judged) -> list[str]:
    """Why the fault's run failed; empty when it passed."""
    if run.skipped:
        return [f"not run: {run.skipped}"]
    out = []
    if run.sent == 0:
        out.append("no request was sent")
    if run.failed_unexcused:
        out.append(f"{run.failed_unexcused} failure(s) no kill explains")
    if run.answered_after == 0:
        out.append("nothing was answered after the fault")
    if run.recovery_s is None:
        out.append("the fleet was never whole again")
    if run.lost is None:
        out.append("the store's rows were not read")
    else:
        for what in ("catalog", "keys", "events"):
            if run.lost.get(what, 0):
                out.append(f"{run.lost[what]} {what} row(s) lost")
        if run.lost.get("usage", 0) > run.usage_bound:
            out.append(f"usage of {run.lost['usage']} answered request(s) lost"
                       f" (bound {run.usage_bound})")
        if run.lost.get("usage_extra", 0):
            out.append(f"{run.lost['usage_extra']} request(s) counted twice in usage")
    out += [f"{name} not measured" for name, value in run.figures.items() if value is None]
    return out
