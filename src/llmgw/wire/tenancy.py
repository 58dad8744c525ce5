"""Teams and the limits a key or a team carries; the allowance exchange behind them.

A key belongs to at most one team (none: the operator's). Both carry the same
set of limits: requests and tokens per minute, tokens per UTC day and month,
and a budget in US dollars over a period. The limits hold fleet-wide: each
gateway worker enforces a share of every limit that the control plane lends
it (llmgw.allowance), which is what the allowance messages carry.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from llmgw.wire.base import PriorityClass, Wire

BudgetPeriod = Literal["day", "week", "month"]
# What one share is of: a limit over a window (llmgw.allowance).
LimitKind = Literal["rpm", "tpm", "tokens_day", "tokens_month", "budget"]
LIMIT_KINDS: tuple[LimitKind, ...] = ("rpm", "tpm", "tokens_day", "tokens_month", "budget")


class TenantLimits(Wire):
    """Limits shared by keys and teams; None: no such limit."""

    rpm: int | None = Field(None, ge=1)
    tpm: int | None = Field(None, ge=1)
    tokens_per_day: int | None = Field(None, ge=1)
    tokens_per_month: int | None = Field(None, ge=1)
    # US dollars over ``budget_period`` (UTC day, ISO week, calendar month),
    # spent at the catalog's prices (ModelSpec.price).
    budget_usd: float | None = Field(None, gt=0)
    budget_period: BudgetPeriod = "month"
    # Not a limit but a term of service kept beside them: the class of the
    # requests in a saturated model's hold queue (llmgw.gateway.admission).
    # A key's wins over its team's; None on both: standard.
    priority: PriorityClass | None = None

    def limit_of(self, kind: LimitKind) -> float | None:
        if kind == "rpm":
            return self.rpm
        if kind == "tpm":
            return self.tpm
        if kind == "tokens_day":
            return self.tokens_per_day
        if kind == "tokens_month":
            return self.tokens_per_month
        return self.budget_usd


class TeamInfo(TenantLimits):
    """A team as the gateway needs it: its models and limits."""

    team_id: str
    name: str = ""
    models: list[str] = Field(default_factory=list)  # empty: all models
    # Its weight against the other teams of its priority class when a model
    # is saturated (llmgw.gateway.admission): a team of weight 2 is served
    # twice as often as one of weight 1 while both wait.
    weight: float = Field(1.0, gt=0, le=1000)


class AllowanceUse(Wire):
    """One enforcement point's use of one limit, as it reports it.

    ``used``: what it counted in the limit's current window (requests, tokens
    or dollars); ``wanted``: what it was asked for there, refused included,
    which is how the control plane shares a limit by demand.
    """

    subject: str  # "key:<id>" or "team:<id>"
    kind: LimitKind
    window: int  # the window's start (unix s): a minute bucket's or a period's
    used: float = 0.0
    wanted: float = 0.0
    # The share it enforces now (0: none yet), which may be one it was sent
    # before its last report was answered.
    enforced: float = 0.0


class AllowanceReport(Wire):
    """A gateway worker's use of every limit it enforces, and what it asks a share of."""

    point: str  # one gateway worker process: unique per process start
    uses: list[AllowanceUse] = Field(default_factory=list)


class AllowanceShare(Wire):
    subject: str
    kind: LimitKind
    window: int
    share: float  # what this point may count in the window (rpm/tpm: per sliding minute)
    limit: float  # the whole limit, for messages
    # The points together have used all of it: a refusal is the fleet's.
    exhausted: bool = False


class AllowanceAnswer(Wire):
    shares: list[AllowanceShare] = Field(default_factory=list)
    # How often the point should report (s), so the control plane paces its load.
    report_every_s: float = 1.0
    # A leader that has just taken over lends no more than points say they
    # enforce for this long (s): a point refused meanwhile asks again then.
    settling_s: float = 0.0
