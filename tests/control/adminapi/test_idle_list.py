"""The idle list's bytes are its entries as JSON, whatever the clock and the changes.

``IdleList.json`` joins per-entry pieces written once and keeps its last
answer while every entry's seconds hold; ``entries`` goes through neither.
Random candidates (ids and models with quotes, ``%`` and non-ASCII, equal
and distinct ``since``), random adds and drops between calls, and a clock
that moves by fractions of a second and by the idle threshold: the JSON
must always parse to ``entries``' list, longest first, then by id.
"""

from __future__ import annotations

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.control.adminapi.idlelist import IdleList
from llmgw.control.adminapi.summary import IDLE_THRESHOLD_S

NOW = 1_000_000.0
NAMES = st.sampled_from(["r1", "r2", 'r"3', "r%4", "r%d5", "r\u00e96", "r7", "r8", "r9"])
STEP = st.one_of(
    st.tuples(
        st.just("add"),
        NAMES,
        st.sampled_from([0.0, 0.25, 0.5, 900.0, 900.5, 5.0]),
        st.sampled_from(["m", 'm"q', "m%s", "m\\"]),
        st.integers(0, 8),
    ),
    st.tuples(st.just("drop"), NAMES),
    st.tuples(
        st.just("clock"), st.sampled_from([0.0, 0.1, 0.4, 1.0, 7.3, float(IDLE_THRESHOLD_S)])
    ),
)


def _expected(idle: IdleList, now: float) -> list[dict[str, object]]:
    return [
        {"id": rid, "model": model, "idle_seconds": -negative, "gpus": gpus}
        for negative, rid, model, gpus in idle.entries(now)
    ]


@settings(max_examples=200, deadline=None)
@given(st.lists(STEP, max_size=40))
def test_the_bytes_are_the_entries(steps: list[tuple[object, ...]]) -> None:
    idle = IdleList()
    now = NOW
    for step in steps:
        if step[0] == "add":
            _, rid, ago, model, gpus = step
            assert isinstance(rid, str) and isinstance(ago, float)
            assert isinstance(model, str) and isinstance(gpus, int)
            idle.add(rid, now - IDLE_THRESHOLD_S - ago, model, gpus)
        elif step[0] == "drop":
            assert isinstance(step[1], str)
            idle.drop(step[1])
        else:
            assert isinstance(step[1], float)
            now += step[1]
        expected = _expected(idle, now)
        assert orjson.loads(idle.json(now)) == expected
        assert orjson.loads(idle.json(now)) == expected  # the kept answer
        order = [(-e["idle_seconds"], e["id"]) for e in expected]  # type: ignore[operator]
        assert order == sorted(order)
        assert all(e["idle_seconds"] >= IDLE_THRESHOLD_S for e in expected)  # type: ignore[operator]
