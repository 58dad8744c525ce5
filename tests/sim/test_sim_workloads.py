"""Workloads: deterministic for a seed, and shaped as specified."""

from __future__ import annotations

import itertools
import statistics
from collections import Counter

import pytest

from llmgw.errors import ValidationError
from llmgw.sim import tokens
from llmgw.sim.workloads import (
    MultiTurnSpec,
    RateStage,
    SharedPrefixSpec,
    TimedRequest,
    ladder,
    multi_turn,
    parse_stages,
    shared_prefix,
)


def words(text: str) -> int:
    return len(text.split())


def test_shared_prefix_is_deterministic_per_seed() -> None:
    spec = SharedPrefixSpec(groups=3, prompts_per_group=4, stages=ladder([20, 40], 2.0), seed=5)
    first = list(shared_prefix(spec))
    assert first == list(shared_prefix(spec))
    other = list(shared_prefix(SharedPrefixSpec(**{**spec.__dict__, "seed": 6})))
    assert [r.messages for r in other[:12]] != [r.messages for r in first[:12]]
    assert [r.at_s for r in other] != [r.at_s for r in first]


def test_shared_prefix_shape() -> None:
    spec = SharedPrefixSpec(
        model="m",
        groups=5,
        prompts_per_group=3,
        system_tokens=120,
        question_tokens=30,
        output_tokens=9,
        stages=(RateStage(50.0, 4.0), RateStage(100.0, 4.0)),
        seed=1,
    )
    reqs = list(shared_prefix(spec))
    pool = spec.groups * spec.prompts_per_group
    # Poisson counts: about 200 then 400, well within 5 standard deviations.
    by_stage = Counter(r.stage for r in reqs)
    assert abs(by_stage[0] - 200) < 5 * 200**0.5
    assert abs(by_stage[1] - 400) < 5 * 400**0.5
    assert [r.at_s for r in reqs] == sorted(r.at_s for r in reqs)
    assert all(0 <= r.at_s < 4 for r in reqs if r.stage == 0)
    assert all(4 <= r.at_s < 8 for r in reqs if r.stage == 1)
    gaps = [b.at_s - a.at_s for a, b in itertools.pairwise(reqs) if a.stage == b.stage == 1]
    assert statistics.mean(gaps) == pytest.approx(1 / 100, rel=0.2)
    assert [r.index for r in reqs] == list(range(len(reqs)))
    for r in reqs:
        assert (r.model, r.max_tokens) == ("m", 9)
        system, question = r.messages
        assert system["role"] == "system" and words(system["content"]) == 120
        assert question["role"] == "user" and words(question["content"]) == 30
        assert tokens.count_tokens(system["content"]) == 120
    # The pool repeats: request k and k + pool carry the same prompt.
    assert all(reqs[k].messages == reqs[k + pool].messages for k in range(len(reqs) - pool))
    first_pool = reqs[:pool]
    assert len({r.messages[1]["content"] for r in first_pool}) == pool
    # Each group shares one system prompt, and groups differ.
    systems: dict[str, set[str]] = {}
    for r in first_pool:
        systems.setdefault(r.group, set()).add(r.messages[0]["content"])
    assert len(systems) == 5 and all(len(s) == 1 for s in systems.values())
    assert len({next(iter(s)) for s in systems.values()}) == 5
    # Shuffled: the pool is not in group order.
    assert [r.group for r in first_pool] != sorted(r.group for r in first_pool)


def test_multi_turn_context_grows_and_is_a_prefix() -> None:
    spec = MultiTurnSpec(
        model="m",
        stages=(RateStage(5.0, 4.0),),
        turns=3,
        groups=2,
        system_tokens=40,
        question_tokens=10,
        answer_tokens=6,
        think_s=0.5,
        seed=2,
    )
    reqs = list(multi_turn(spec))
    assert reqs == list(multi_turn(spec))
    assert [r.at_s for r in reqs] == sorted(r.at_s for r in reqs)
    assert [r.index for r in reqs] == list(range(len(reqs)))
    sessions: dict[str, list[TimedRequest]] = {}
    for r in reqs:
        sessions.setdefault(r.group, []).append(r)
    assert len(sessions) >= 5
    for turns in sessions.values():
        assert [t.turn for t in turns] == [0, 1, 2]
        assert [len(t.messages) for t in turns] == [2, 4, 6]
        assert turns[1].at_s - turns[0].at_s == pytest.approx(0.5)
        for earlier, later in itertools.pairwise(turns):
            # The previous prompt is an exact prefix of the next: a cache hit.
            assert later.prompt.startswith(earlier.prompt)
            assert later.messages[-2] == {
                "role": "assistant",
                "content": tokens.filler_text(6),
            }
    systems = {turns[0].messages[0]["content"] for turns in sessions.values()}
    assert len(systems) == 2


def test_parse_stages_and_bad_specs() -> None:
    assert parse_stages("15x50, 3x20") == (RateStage(15, 50), RateStage(3, 20))
    with pytest.raises(ValidationError, match="RATExSECONDS"):
        parse_stages("15:50")
    with pytest.raises(ValidationError, match="groups"):
        SharedPrefixSpec(groups=0)
    with pytest.raises(ValidationError, match="think_s"):
        MultiTurnSpec(think_s=-1)
    with pytest.raises(ValidationError, match="rate stage"):
        RateStage(-1, 3)
