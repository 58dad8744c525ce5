"""The limit options keys and teams share in ``llmgw ctl`` (docs/tenancy.md)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from llmgw.cli.ctl.client import CtlError
from llmgw.wire import PRIORITY_CLASSES

RpmOpt = Annotated[int | None, typer.Option(help="Requests per minute (0: none).", min=0)]
TpmOpt = Annotated[int | None, typer.Option(help="Tokens per minute (0: none).", min=0)]
DayOpt = Annotated[int | None, typer.Option(
    "--tokens-per-day", help="Token quota per UTC day (0: none).", min=0)]
MonthOpt = Annotated[int | None, typer.Option(
    "--tokens-per-month", help="Token quota per calendar month (0: none).", min=0)]
BudgetOpt = Annotated[float | None, typer.Option(
    "--budget", help="Budget in US dollars per --budget-period (0: none).", min=0)]
PeriodOpt = Annotated[str | None, typer.Option(
    "--budget-period", help="day, week or month (default month).")]
PriorityOpt = Annotated[str | None, typer.Option(
    "--priority", help="Class when a model is at capacity: interactive, standard or batch"
    " ('none': a key's team's, else standard).")]


def limits_body(rpm: int | None, tpm: int | None, day: int | None, month: int | None,
                budget: float | None, period: str | None, priority: str | None,
                ) -> dict[str, Any]:
    """The options given, as the admin API's fields; 0 clears a limit (null), and
    ``--priority none`` the key's or team's class."""
    if period is not None and period not in ("day", "week", "month"):
        raise CtlError(f"--budget-period {period!r}: day, week or month")
    given = {"rpm": rpm, "tpm": tpm, "tokens_per_day": day, "tokens_per_month": month,
             "budget_usd": budget}
    body: dict[str, Any] = {k: (v or None) for k, v in given.items() if v is not None}
    if period is not None:
        body["budget_period"] = period
    if priority == "none":
        body["priority"] = None
    elif priority is not None:
        if priority not in PRIORITY_CLASSES:
            raise CtlError(f"--priority {priority!r}: {', '.join(PRIORITY_CLASSES)} or none")
        body["priority"] = priority
    return body


def limits_cell(item: dict[str, Any]) -> str:
    """A key's or team's limits on one line: rpm 60, tpm 1000, 1M/day, $25/month."""
    parts = []
    if item.get("rpm"):
        parts.append(f"rpm {item['rpm']}")
    if item.get("tpm"):
        parts.append(f"tpm {item['tpm']}")
    if item.get("tokens_per_day"):
        parts.append(f"{item['tokens_per_day']:,} tok/day")
    if item.get("tokens_per_month"):
        parts.append(f"{item['tokens_per_month']:,} tok/month")
    if item.get("budget_usd"):
        parts.append(f"${item['budget_usd']:,.2f}/{item.get('budget_period') or 'month'}")
    if item.get("priority"):
        parts.append(str(item["priority"]))
    if item.get("weight") not in (None, 1, 1.0):
        parts.append(f"weight {item['weight']:g}")
    return ", ".join(parts) or "-"
