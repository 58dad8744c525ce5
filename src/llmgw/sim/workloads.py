"""Seeded workloads: timed requests for benchmarks and tests.

Prefix-aware routing only pays off when prompts share prefixes, and how much
depends on the shape of the traffic; these generators reproduce the two shapes
the published router comparisons use (research/routing.md §6):

- :func:`shared_prefix`: ``groups`` system prompts, ``prompts_per_group``
  questions each. The pool of groups * prompts full prompts is built and
  shuffled once, and request k uses prompt ``k mod pool``, so every full prompt
  recurs once per pool (inference-perf's ``shared_prefix`` and llm-d's
  "B2B-SaaS" workload). Arrivals are Poisson, stage by stage of a rate ladder.
- :func:`multi_turn`: sessions that each send ``turns`` requests; turn k's
  messages are turn k-1's plus the answer and a new question, so the context
  grows and every turn's prompt starts with the previous one. Sessions start
  as a Poisson process; turns follow each other after ``think_s``.

Lengths are in tokens of :mod:`llmgw.sim.tokens` (one word = one token). The
same spec and seed always give the same requests, byte for byte, so runs of
different routers see the same traffic.
"""

from __future__ import annotations

import dataclasses
import heapq
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from llmgw.errors import ValidationError
from llmgw.sim import tokens

Message = dict[str, str]


@dataclass(frozen=True)
class TimedRequest:
    """One request of a workload: send it ``at_s`` seconds after the start."""

    at_s: float
    model: str
    messages: list[Message]
    max_tokens: int
    group: str  # the shared-prefix group, or the chat session
    index: int  # position in the workload, from 0
    stage: int = 0  # index of the rate stage it arrived in
    turn: int = 0  # multi-turn: 0-based turn in its session

    @property
    def prompt(self) -> str:
        """The same request as a completions prompt (the canonical chat rendering)."""
        return tokens.render_chat(self.messages)


@dataclass(frozen=True)
class RateStage:
    rate: float  # requests (or sessions) per second
    duration_s: float

    def __post_init__(self) -> None:
        if self.rate < 0 or self.duration_s < 0:
            raise ValidationError(f"a rate stage needs rate and duration >= 0, got {self}")


def ladder(rates: Sequence[float], duration_s: float) -> tuple[RateStage, ...]:
    """Stages of equal length, one per rate."""
    return tuple(RateStage(r, duration_s) for r in rates)


def parse_stages(text: str) -> tuple[RateStage, ...]:
    """``"15x50,3x20"`` -> 15 req/s for 50 s, then 3 req/s for 20 s."""
    stages = []
    for item in text.split(","):
        rate, sep, duration = item.strip().partition("x")
        try:
            if not sep:
                raise ValueError(item)
            stages.append(RateStage(float(rate), float(duration)))
        except ValueError:
            raise ValidationError(
                f"bad rate stage {item.strip()!r}: write RATExSECONDS, e.g. 15x50"
            ) from None
    return tuple(stages)


def poisson_arrivals(
    stages: Sequence[RateStage], rng: random.Random
) -> Iterator[tuple[float, int]]:
    """(time, stage index) of Poisson arrivals, stage after stage."""
    start = 0.0
    for i, stage in enumerate(stages):
        end = start + stage.duration_s
        if stage.rate > 0:
            t = start + rng.expovariate(stage.rate)
            while t < end:
                yield t, i
                t += rng.expovariate(stage.rate)
        start = end


@dataclass(frozen=True)
class SharedPrefixSpec:
    model: str = "sim"
    groups: int = 10
    prompts_per_group: int = 10
    system_tokens: int = 100
    question_tokens: int = 50
    output_tokens: int = 50
    stages: tuple[RateStage, ...] = field(default_factory=lambda: (RateStage(1.0, 60.0),))
    seed: int = 0

    def __post_init__(self) -> None:
        _check_counts(
            groups=self.groups,
            prompts_per_group=self.prompts_per_group,
            output_tokens=self.output_tokens,
        )
        _check_lengths(system_tokens=self.system_tokens, question_tokens=self.question_tokens)


def shared_prefix_pool(spec: SharedPrefixSpec) -> list[tuple[str, list[Message]]]:
    """The shuffled pool of (group id, messages); request k uses entry k mod len."""
    rng = random.Random(f"shared-prefix/{spec.seed}")
    pool: list[tuple[str, list[Message]]] = []
    for g in range(spec.groups):
        system = tokens.random_words(rng, spec.system_tokens)
        for _ in range(spec.prompts_per_group):
            question = tokens.random_words(rng, spec.question_tokens)
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ]
            pool.append((f"g{g}", messages))
    rng.shuffle(pool)
    return pool


def shared_prefix(spec: SharedPrefixSpec) -> Iterator[TimedRequest]:
    pool = shared_prefix_pool(spec)
    arrivals = poisson_arrivals(spec.stages, random.Random(f"arrivals/{spec.seed}"))
    for k, (at, stage) in enumerate(arrivals):
        group, messages = pool[k % len(pool)]
        yield TimedRequest(
            at_s=at,
            model=spec.model,
            messages=messages,
            max_tokens=spec.output_tokens,
            group=group,
            index=k,
            stage=stage,
        )


@dataclass(frozen=True)
class MultiTurnSpec:
    model: str = "sim"
    # Sessions start as a Poisson process over the stages (rate = sessions/s).
    stages: tuple[RateStage, ...] = field(default_factory=lambda: (RateStage(1.0, 30.0),))
    turns: int = 5
    groups: int = 4  # distinct system prompts; session i uses group i mod groups
    system_tokens: int = 200
    question_tokens: int = 50
    answer_tokens: int = 50
    think_s: float = 2.0  # pause between one turn and the next
    seed: int = 0

    def __post_init__(self) -> None:
        _check_counts(turns=self.turns, groups=self.groups, answer_tokens=self.answer_tokens)
        _check_lengths(system_tokens=self.system_tokens, question_tokens=self.question_tokens)
        if self.think_s < 0:
            raise ValidationError(f"think_s must be >= 0, got {self.think_s}")


def multi_turn(spec: MultiTurnSpec) -> Iterator[TimedRequest]:
    """Requests of all sessions, in time order.

    The answer inserted before each next question is exactly what the
    simulated engine answers to ``answer_tokens`` (``tokens.filler_text``), so
    a real conversation with a sim engine and this trace agree byte for byte.
    """
    rng = random.Random(f"multi-turn/{spec.seed}")
    systems = [tokens.random_words(rng, spec.system_tokens) for _ in range(spec.groups)]
    answer = tokens.filler_text(spec.answer_tokens)
    arrivals = poisson_arrivals(spec.stages, random.Random(f"sessions/{spec.seed}"))
    # Build every session's turns, then merge them in time order. Each session's
    # questions come from its own seeded stream, so adding a stage never changes
    # the sessions before it.
    pending: list[tuple[float, int, int, TimedRequest]] = []
    for s, (start, stage) in enumerate(arrivals):
        session_rng = random.Random(f"multi-turn/{spec.seed}/session/{s}")
        messages: list[Message] = [{"role": "system", "content": systems[s % spec.groups]}]
        for turn in range(spec.turns):
            if turn:
                messages = [*messages, {"role": "assistant", "content": answer}]
            question = tokens.random_words(session_rng, spec.question_tokens)
            messages = [*messages, {"role": "user", "content": question}]
            at = start + turn * spec.think_s
            req = TimedRequest(
                at_s=at,
                model=spec.model,
                messages=messages,
                max_tokens=spec.answer_tokens,
                group=f"s{s}",
                index=0,
                stage=stage,
                turn=turn,
            )
            heapq.heappush(pending, (at, s, turn, req))
    index = 0
    while pending:
        *_, req = heapq.heappop(pending)
        yield dataclasses.replace(req, index=index)
        index += 1


def _check_counts(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValidationError(f"{name} must be >= 1, got {value}", field=name)


def _check_lengths(**values: int) -> None:
    for name, value in values.items():
        if value < 0:
            raise ValidationError(f"{name} must be >= 0, got {value}", field=name)
