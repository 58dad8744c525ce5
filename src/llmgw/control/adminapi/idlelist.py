"""The summary's idle list, kept between calls and written for a given clock in C-speed passes.

The list is the one part of the summary as long as the fleet (7,485 of
16,838 replicas at 10,000 nodes in bench/admin.py), and its every entry's
``idle_seconds`` moves with the clock, so it cannot be cached as an answer.
Built per call as an object per entry, sorted with a Python key and then
encoded, it was 17-21 ms of a 30-45 ms summary. Here the candidates are
kept in order of when they went idle (inserted and removed by bisection as
replicas change, never sorted whole again), each with its JSON written once
with a ``%d`` where the seconds go; a call cuts the candidates idle long
enough, computes their seconds, orders them (already in order but for ties,
so the sort is one linear pass) and formats the bytes, each step a ``map``
over the whole list rather than a loop in Python.

The rules are summary.SummaryBuilder's (``IDLE_THRESHOLD_S``, whole seconds,
longest first then by id); the keeper's property test holds the two equal.
"""

from __future__ import annotations

import bisect
from itertools import repeat
from operator import getitem, itemgetter, mod, neg, sub

import orjson

from llmgw.control.adminapi.summary import IDLE_THRESHOLD_S

_FIRST = itemgetter(0)
_SECOND = itemgetter(1)


class IdleList:
    """Replicas that can be idle (ready, nothing in flight) and since when."""

    __slots__ = ("_info", "_last", "_order", "_templates")

    def __init__(self) -> None:
        # (since, id), ascending: the candidates by when they went idle.
        self._order: list[tuple[float, str]] = []
        # id -> (since, model, gpus)
        self._info: dict[str, tuple[float, str, int]] = {}
        # id -> its entry as JSON with ``%d`` for the seconds (any ``%`` of
        # the id or model doubled).
        self._templates: dict[str, bytes] = {}
        # The last answer and what it was computed from: the candidates cut
        # for the clock and their whole seconds. Between two calls a second
        # apart or less most of those seconds are the same, and in a fleet
        # whose replicas went idle at the same fraction of a second (every
        # clock-driven test, bench/admin.py) all of them; then the bytes are
        # the last call's. None after any change of the candidates.
        self._last: tuple[list[int], bytes] | None = None

    def __len__(self) -> int:
        return len(self._info)

    def add(self, rid: str, since: float, model: str, gpus: int) -> None:
        self.drop(rid)
        self._info[rid] = (since, model, gpus)
        self._last = None
        bisect.insort(self._order, (since, rid))
        head = orjson.dumps({"id": rid, "model": model})[:-1].replace(b"%", b"%%")
        self._templates[rid] = head + b',"idle_seconds":%d,"gpus":' + b"%d}" % gpus

    def drop(self, rid: str) -> None:
        info = self._info.pop(rid, None)
        if info is None:
            return
        del self._templates[rid]
        self._last = None
        order = self._order
        del order[bisect.bisect_left(order, (info[0], rid))]

    def _seconds(self, now: float) -> list[int]:
        """Whole seconds idle at ``now`` of the first candidates of ``_order``:
        those idle for at least IDLE_THRESHOLD_S."""
        order = self._order
        # Candidates by when they went idle: only those idle long enough are
        # looked at (one past the cut-off second, then checked exactly).
        end = bisect.bisect_right(order, (now - IDLE_THRESHOLD_S + 1.0,))
        # int(now - since), whole seconds as the builder counts them: all
        # positive here, so truncation is the floor; non-increasing along
        # ``order``, so those short of the threshold are a tail.
        idle = list(map(int, map(sub, repeat(now, end), map(_FIRST, order[:end]))))
        cut = end
        while cut and idle[cut - 1] < IDLE_THRESHOLD_S:
            cut -= 1
        if cut < end:
            del idle[cut:]
        return idle

    def _ranked(self, idle: list[int]) -> list[tuple[int, str]]:
        """(-idle seconds, id) for ``_seconds``' answer, longest first, then by id."""
        # ``_order`` is in that order already but for ties of seconds across
        # distinct ``since``, so sorting is about one comparison per entry.
        ids = map(_SECOND, self._order[: len(idle)])
        return sorted(zip(map(neg, idle), ids, strict=True))

    def entries(self, now: float) -> list[tuple[int, str, str, int]]:
        """(-idle seconds, id, model, gpus), longest first (SummaryBuilder.set_idle's form)."""
        info = self._info
        out = []
        for negative, rid in self._ranked(self._seconds(now)):
            _, model, gpus = info[rid]
            out.append((negative, rid, model, gpus))
        return out

    def json(self, now: float) -> bytes:
        """The idle list at ``now`` as the summary's JSON array."""
        idle = self._seconds(now)
        last = self._last
        if last is not None and last[0] == idle:
            return last[1]
        ranked = self._ranked(idle)
        templates = map(getitem, repeat(self._templates), map(_SECOND, ranked))
        seconds = map(neg, map(_FIRST, ranked))
        body = b"[" + b",".join(map(mod, templates, seconds)) + b"]"
        self._last = (idle, body)
        return body


__all__ = ["IdleList"]
