"""The summary's idle list, kept between calls and written for a given clock in C-speed passes.

The list is the one part of the summary as long as the fleet (7,485 of
16,838 replicas at 10,000 nodes in bench/admin.py), and its every entry's
``idle_seconds`` moves with the clock, so it cannot be cached as an answer.
Built per call as an object per entry, sorted with a Python key and then
encoded, it takes 17-21 ms of a 30-45 ms summary. Here the candidates are
kept in order of when they went idle (inserted and removed by bisection as
replicas change, never sorted whole again), each with its JSON written once
up to and after its seconds; a call cuts the candidates idle long enough,
computes their seconds, orders them (already in order but for ties, so the
sort is one linear pass) and joins the pieces, each step a ``map`` over the
whole list rather than a loop in Python.

The rules are summary.SummaryBuilder's (``IDLE_THRESHOLD_S``, whole seconds,
longest first then by id); the keeper's property test holds the two equal.
"""

from __future__ import annotations

import bisect
from itertools import chain, repeat
from operator import getitem, itemgetter, neg, sub

import orjson

from llmgw.control.adminapi.summary import IDLE_THRESHOLD_S

_FIRST = itemgetter(0)
_SECOND = itemgetter(1)


class IdleList:
    """Replicas that can be idle (ready, nothing in flight) and since when."""

    __slots__ = ("_heads", "_info", "_last", "_order", "_tails")

    def __init__(self) -> None:
        # (since, id), ascending: the candidates by when they went idle.
        self._order: list[tuple[float, str]] = []
        # id -> (since, model, gpus)
        self._info: dict[str, tuple[float, str, int]] = {}
        # id -> its entry as JSON up to its seconds (after the comma that
        # comes before every entry but the first), and after them.
        self._heads: dict[str, bytes] = {}
        self._tails: dict[str, bytes] = {}
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
        head = orjson.dumps({"id": rid, "model": model})[:-1]
        self._heads[rid] = b"," + head + b',"idle_seconds":'
        self._tails[rid] = b',"gpus":%d}' % gpus

    def drop(self, rid: str) -> None:
        info = self._info.pop(rid, None)
        if info is None:
            return
        del self._heads[rid], self._tails[rid]
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
        if not ranked:
            return b"[]"
        # One join of every entry's pieces, each a lookup: the seconds are a
        # few distinct numbers (formatted once each), the rest fixed per entry.
        written = {negative: b"%d" % -negative for negative in set(map(_FIRST, ranked))}
        ids = list(map(_SECOND, ranked))
        heads, tails = self._heads, self._tails
        first, first_seconds = ids[0], ranked[0][0]
        rest = zip(
            map(getitem, repeat(heads), ids[1:]),
            map(getitem, repeat(written), map(_FIRST, ranked[1:])),
            map(getitem, repeat(tails), ids[1:]),
            strict=True,
        )
        # One join straight into the answer's bytes (no copy after it).
        opening = (b"[", heads[first][1:], written[first_seconds], tails[first])
        body = b"".join(chain(opening, chain.from_iterable(rest), (b"]",)))
        self._last = (idle, body)
        return body


__all__ = ["IdleList"]
