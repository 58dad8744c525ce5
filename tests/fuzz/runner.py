"""Running a fuzz target for a given time and counting what it found.

A target is a hypothesis strategy and a check of one generated case. The
check raises :class:`Failure` when a property does not hold (two readings
of one request, an answer that contradicts the input), :class:`ServerError`
when a server answered 5xx, :class:`Hang` when nothing came back in time;
anything else it raises is a crash (an exception llmgw's code let escape).
Hypothesis is used as the generator only (no shrinking, no database): each
finding is counted and its first example kept, and the run goes on until
its time is up, so one run gives figures for every kind of finding.
"""

from __future__ import annotations

import contextlib
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import HypothesisWarning


class Failure(AssertionError):
    """A property of the target did not hold."""


class ServerError(AssertionError):
    """A server answered 5xx to a request (valid or not)."""


class Hang(AssertionError):
    """Nothing came back within the time the property allows."""


@dataclass
class Target:
    name: str
    # What the target needs while it runs (a server, a loop): entered once per run.
    setup: Callable[[], contextlib.AbstractContextManager[Any]]
    strategy: Callable[[Any], st.SearchStrategy[Any]]
    check: Callable[[Any, Any], None]


@dataclass
class Stats:
    target: str
    cases: int = 0
    failures: int = 0
    crashes: int = 0
    server_errors: int = 0
    hangs: int = 0
    seconds: float = 0.0
    examples: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.failures or self.crashes or self.server_errors or self.hangs)

    def as_dict(self) -> dict[str, Any]:
        return {"cases": self.cases, "failures": self.failures, "crashes": self.crashes,
                "5xx": self.server_errors, "hangs": self.hangs,
                "seconds": round(self.seconds, 1), "examples": self.examples}


class _TimeUp(Exception):
    pass


_KEEP_EXAMPLES = 5


def run(target: Target, seconds: float) -> Stats:
    """Run ``target`` for about ``seconds`` and count its cases and findings."""
    stats = Stats(target.name)
    started = time.monotonic()
    with target.setup() as context:
        # The clock starts at the first case: building a strategy (a schema's
        # operations) can take seconds, and the time is for cases.
        end: float | None = None
        timed_out = False

        @settings(max_examples=10**9, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck), derandomize=False)
        @given(target.strategy(context))
        def one(case: Any) -> None:
            nonlocal timed_out, end
            now = time.monotonic()
            if end is None:
                end = now + seconds
            if timed_out or now >= end:
                timed_out = True
                raise _TimeUp
            stats.cases += 1
            try:
                target.check(context, case)
            except ServerError as exc:
                stats.server_errors += 1
                _keep(stats, "5xx", case, exc)
            except Hang as exc:
                stats.hangs += 1
                _keep(stats, "hang", case, exc)
            except Failure as exc:
                stats.failures += 1
                _keep(stats, "failure", case, exc)
            except Exception as exc:
                stats.crashes += 1
                _keep(stats, "crash", case, exc)

        # A strategy that never yields a case still ends.
        give_up = time.monotonic() + seconds + 120.0
        while not timed_out and (end is None or time.monotonic() < end) and (
                time.monotonic() < give_up):
            try:
                with warnings.catch_warnings():
                    # A large case (a megabyte of nested braces) makes hypothesis
                    # warn that its repr is expensive: the repr is only made for
                    # the examples kept, and the warning is not a finding.
                    warnings.simplefilter("ignore", HypothesisWarning)
                    one()
            except BaseException as exc:  # hypothesis may wrap _TimeUp
                if not timed_out:
                    raise
                del exc
    stats.seconds = time.monotonic() - started
    return stats


def _keep(stats: Stats, kind: str, case: Any, exc: BaseException) -> None:
    if len(stats.examples) < _KEEP_EXAMPLES:
        where = "".join(traceback.format_exception(exc, limit=-3)) if kind == "crash" else str(exc)
        stats.examples.append(f"{kind}: {where.strip()[:1500]}\n  case: {case!r:.1500}")


@contextlib.contextmanager
def nothing() -> Iterator[None]:
    yield None
