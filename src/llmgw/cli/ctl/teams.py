"""``llmgw ctl teams``: tenants listed (default), created, changed and deleted."""

from __future__ import annotations

from typing import Annotated

import typer

from llmgw.cli.ctl.client import admin_client, guarded
from llmgw.cli.ctl.limits import (
    BudgetOpt,
    DayOpt,
    MonthOpt,
    PeriodOpt,
    PriorityOpt,
    RpmOpt,
    TpmOpt,
    limits_body,
    limits_cell,
)
from llmgw.cli.ctl.listing import list_by_default
from llmgw.cli.ctl.render import JsonOpt, print_answer

teams_app = typer.Typer(help="Teams: list (default), create, set, delete.")

list_by_default(
    teams_app, "/teams",
    ("TEAM", "NAME", "MODELS", "LIMITS", "KEYS"),
    lambda t: (t["team_id"], t["name"], ",".join(t["models"]) or "all", limits_cell(t),
               str(t["keys"])),
    "No teams.",
    "Teams: their models, limits and live keys.",
)

WeightOpt = Annotated[float | None, typer.Option(
    help="Its weight against the other teams of its class when a model is at capacity"
    " (default 1).", min=0.001, max=1000)]
ModelOpt = Annotated[list[str] | None, typer.Option(
    "--model", help="A model its keys may use (repeat; default all).")]


@teams_app.command("create")
@guarded
def team_create(
    ctx: typer.Context,
    name: str,
    model: ModelOpt = None,
    rpm: RpmOpt = None, tpm: TpmOpt = None, tokens_per_day: DayOpt = None,
    tokens_per_month: MonthOpt = None, budget: BudgetOpt = None, budget_period: PeriodOpt = None,
    priority: PriorityOpt = None, weight: WeightOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Create a team; its limits hold over all its keys together, on every gateway."""
    body = {"name": name, "models": model or [],
            **limits_body(rpm, tpm, tokens_per_day, tokens_per_month, budget, budget_period,
                           priority), **({"weight": weight} if weight else {})}
    team = admin_client(ctx).call("POST", "/teams", body=body)
    print_answer(team, as_json,
                 f"team {team['name']} ({team['team_id']}) created: {limits_cell(team)}")


@teams_app.command("set")
@guarded
def team_set(
    ctx: typer.Context,
    team: Annotated[str, typer.Argument(help="The team's id or name.")],
    name: Annotated[str | None, typer.Option(help="A new name.")] = None,
    model: ModelOpt = None,
    all_models: Annotated[bool, typer.Option("--all-models", help="Allow every model.")
                          ] = False,
    rpm: RpmOpt = None, tpm: TpmOpt = None, tokens_per_day: DayOpt = None,
    tokens_per_month: MonthOpt = None, budget: BudgetOpt = None, budget_period: PeriodOpt = None,
    priority: PriorityOpt = None, weight: WeightOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Change a team's name, models or limits (those given; 0 clears a limit)."""
    body = limits_body(rpm, tpm, tokens_per_day, tokens_per_month, budget, budget_period,
                       priority)
    if weight:
        body["weight"] = weight
    if name is not None:
        body["name"] = name
    if model or all_models:
        body["models"] = [] if all_models else model
    changed = admin_client(ctx).call("PATCH", f"/teams/{team}", body=body)
    print_answer(changed, as_json,
                 f"team {changed['name']} ({changed['team_id']}): {limits_cell(changed)}")


@teams_app.command("delete")
@guarded
def team_delete(ctx: typer.Context, team: str) -> None:
    """Delete a team (refused while live keys belong to it)."""
    gone = admin_client(ctx).call("DELETE", f"/teams/{team}")
    typer.echo(f"team {gone['name']} ({gone['team_id']}) deleted")
