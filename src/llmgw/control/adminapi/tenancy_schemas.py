"""Admin API bodies for teams and for the limits keys and teams share."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from llmgw.wire import BudgetPeriod, PriorityClass, TeamInfo


class LimitsBody(BaseModel):
    """Limits as a client sends them; null (or absent): no such limit."""

    model_config = ConfigDict(extra="forbid")

    rpm: int | None = Field(None, ge=1, le=10**9)
    tpm: int | None = Field(None, ge=1, le=10**12)
    tokens_per_day: int | None = Field(None, ge=1, le=10**15)
    tokens_per_month: int | None = Field(None, ge=1, le=10**15)
    budget_usd: float | None = Field(None, gt=0, le=10**12)
    budget_period: BudgetPeriod = "month"
    # Its class when a model is at capacity (interactive, standard, batch);
    # null: a key's team's, else standard.
    priority: PriorityClass | None = None


class TeamCreate(LimitsBody):
    name: str = Field(min_length=1, max_length=200)
    # Models the team's keys may use; empty: all.
    models: list[str] = Field(default_factory=list, max_length=1000)
    # Its weight against the other teams of its class when a model is saturated.
    weight: float = Field(1.0, gt=0, le=1000)


class LimitsUpdate(BaseModel):
    """Limits to change on a key or a team; those left out stay as they are (null clears one)."""

    model_config = ConfigDict(extra="forbid")

    models: list[str] | None = Field(None, max_length=1000)
    rpm: int | None = Field(None, ge=1, le=10**9)
    tpm: int | None = Field(None, ge=1, le=10**12)
    tokens_per_day: int | None = Field(None, ge=1, le=10**15)
    tokens_per_month: int | None = Field(None, ge=1, le=10**15)
    budget_usd: float | None = Field(None, gt=0, le=10**12)
    budget_period: BudgetPeriod | None = None
    priority: PriorityClass | None = None


class TeamUpdate(LimitsUpdate):
    """The fields to change; those left out stay as they are (null clears a limit)."""

    name: str | None = Field(None, min_length=1, max_length=200)
    weight: float = Field(1.0, gt=0, le=1000)  # left out: unchanged (never null)


class TeamView(LimitsBody):
    model_config = ConfigDict(extra="ignore")

    team_id: str
    name: str
    models: list[str]
    weight: float = 1.0
    # Live (unrevoked) keys in the team.
    keys: int = 0


def team_view(team: TeamInfo, keys: int) -> TeamView:
    return TeamView.model_validate({**team.model_dump(), "keys": keys})
