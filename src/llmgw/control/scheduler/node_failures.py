"""A model's failed starts by node: which nodes it avoids, and over how many it failed.

A failed replica says something about its model *and* about the node it ran
on, and counting it against the model alone gets both wrong: a node with a
broken card or driver fails every replica put on it, so every model placed
there backs off and is parked, while the same models would run fine on any
other node; and the next placement, preferring the node that holds the
weights, picks that very node again. So each failure is also counted per
(model, node) (``state.NodeFailure``):

- placement avoids, for this model, a node where it failed recently (a
  minute after the first failure there, doubling, at most an hour;
  ``Policy.node_backoff``), and drops the avoidance when no other node
  fits, so a one-node fleet still retries (filters.AvoidFailedNodes);
- a start that succeeds on a node forgets the failures there;
- parking asks how many distinct nodes the model's current run of
  failures hit (triage.py).

Only models that failed somewhere have entries, and only their own entries
are read: a pass costs nothing more for the others.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, replace

from llmgw.control.state import NodeFailure


@dataclass(frozen=True, slots=True)
class Avoided:
    """A node placement avoids for one model, and until when."""

    node: str
    failures: int
    last_at: float
    until: float

    def sentence(self, model: str, now: float, *, used: bool = False) -> str:
        """E.g. "n3: model m failed there 2 times, last 40 s ago; avoided for 3 min"."""
        times = "1 time" if self.failures == 1 else f"{self.failures} times"
        last = span(now - self.last_at)
        start = f"{self.node}: model {model} failed there {times}, last {last} ago"
        if used:
            return f"{start}; used anyway: no other node fits"
        return f"{start}; avoided for {span(self.until - now)}"


class NodeFailureBook:
    """One model's failures by node during one pass, copy on write.

    ``decide`` must not change the state it reads (the planner runs it on
    the live state), so the record's map is copied on the first change and
    the copy is what the pass hands back (``ModelUpdate.node_failures``).
    """

    def __init__(self, current: dict[str, NodeFailure]) -> None:
        self._current = current
        self._edited: dict[str, NodeFailure] | None = None

    def __bool__(self) -> bool:
        return bool(self.entries)

    @property
    def entries(self) -> dict[str, NodeFailure]:
        return self._current if self._edited is None else self._edited

    @property
    def changed(self) -> bool:
        return self._edited is not None and self._edited != self._current

    def _edit(self) -> dict[str, NodeFailure]:
        if self._edited is None:
            self._edited = dict(self._current)
        return self._edited

    def keep_only(self, nodes: Container[str]) -> None:
        """Forget nodes that left the fleet (a name may come back as another machine)."""
        gone = [n for n in self.entries if n not in nodes]
        if gone:
            edited = self._edit()
            for name in gone:
                del edited[name]

    def started(self, node: str, created_at: float) -> None:
        """A replica created at ``created_at`` on ``node`` became ready."""
        entry = self.entries.get(node)
        if entry is not None and created_at >= entry.last_at:
            del self._edit()[node]

    def end_run(self) -> None:
        """A start succeeded somewhere: earlier failures no longer count towards parking.

        They still steer placement away from their nodes until they expire.
        """
        if any(f.current_run for f in self.entries.values()):
            edited = self._edit()
            for name, entry in edited.items():
                if entry.current_run:
                    edited[name] = replace(entry, current_run=False)

    def failed(self, nodes: Iterable[str], now: float) -> None:
        # A multi-node replica's failure counts on each of its nodes: which
        # one broke it is not known, and avoiding all of them is safe.
        edited = self._edit()
        for name in nodes:
            entry = edited.get(name)
            count = entry.failures + 1 if entry is not None else 1
            edited[name] = NodeFailure(count, now, current_run=True)

    def run_nodes(self) -> list[str]:
        """Nodes the model failed on in its current run of consecutive failures."""
        return sorted(n for n, f in self.entries.items() if f.current_run)

    def avoided(self, now: float, backoff: Callable[[int], float]) -> tuple[Avoided, ...]:
        found = []
        for name, entry in sorted(self.entries.items()):
            until = entry.last_at + backoff(entry.failures)
            if until > now:
                found.append(Avoided(name, entry.failures, entry.last_at, until))
        return tuple(found)


def span(seconds: float) -> str:
    """A short duration for sentences: "40 s", "3 min", "1.5 h"."""
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
