"""``llmgw ctl usage``: requests, tokens and spend per team, key, model or day, as a table,
JSON or CSV.

Two views. Without ``--since``, ``--until``, ``--by`` or ``--csv`` it is the
last ``--minutes`` per key and model from ``GET /admin/v1/usage`` (with
``--per-minute``, one row per minute). With any of them it is a report over
any period from ``GET /admin/v1/usage/report``, summed by the database: a
month by day is a few lines. ``--csv`` prints the CSV the control plane
makes, the same file the console's usage page downloads.

Times: ``2026-11-01`` or ``2026-11-01T08:00`` (UTC unless an offset is given,
like the report's days), ``7d``/``12h``/``30m`` ago, ``now``, or unix seconds.
"""

from __future__ import annotations

import re
import sys
import time
from datetime import UTC, datetime
from typing import Annotated, Any

import typer

from llmgw.cli.ctl.client import CtlError, admin_client, guarded
from llmgw.cli.ctl.render import JsonOpt, local_time, make_console, new_table, print_json

_AGO = re.compile(r"(\d+)([smhdw])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_COUNTERS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "errors",
             "spend_usd")
_COUNTER_HEADS = ("REQUESTS", "PROMPT", "COMPLETION", "CACHED", "ERRORS", "SPEND $")


def _cell(row: dict[str, Any], counter: str) -> str:
    value = row.get(counter, 0)
    return f"{value:.4f}" if counter == "spend_usd" else str(value)


def parse_when(text: str, option: str, now: float | None = None) -> int:
    """A point in time as unix seconds; CtlError naming ``option`` if it is none."""
    now = time.time() if now is None else now
    value = text.strip()
    if value == "now":
        return int(now)
    if value.isdigit():
        return int(value)
    ago = _AGO.fullmatch(value)
    if ago:
        return int(now) - int(ago.group(1)) * _UNIT_S[ago.group(2)]
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise CtlError(f"{option} {text!r}: give a date (2026-11-01), a date and time "
                       "(2026-11-01T08:00, UTC unless an offset is given), an age (7d, 12h, "
                       "30m), now, or unix seconds") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return int(when.timestamp())


@guarded
def usage(
    ctx: typer.Context,
    minutes: Annotated[int, typer.Option(help="Over the last N minutes.", min=1)] = 60,
    since: Annotated[str | None, typer.Option(
        help="From (a date, date and time, 7d ago, unix seconds); default: --minutes ago, "
             "30 days with --by or --csv.")] = None,
    until: Annotated[str | None, typer.Option(help="Until, exclusive; default: now.")] = None,
    by: Annotated[str | None, typer.Option(
        help="team, key, model or day (UTC); several comma-separated: day,model. "
             "Default: key,model.")] = None,
    csv: Annotated[bool, typer.Option("--csv", help="CSV on stdout (as the console's "
                                                    "download).")] = False,
    key: Annotated[str | None, typer.Option(help="Only this key id.")] = None,
    team: Annotated[str | None, typer.Option(help="Only this team's keys (id or name).")
                    ] = None,
    model: Annotated[str | None, typer.Option(help="Only this model.")] = None,
    per_minute: Annotated[bool, typer.Option(help="One row per minute.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Requests, tokens and spend per team, key, model or day; --csv for a spreadsheet."""
    report = since is not None or until is not None or by is not None or csv
    if not report:
        _recent(ctx, minutes, key, model, per_minute, as_json, team)
        return
    if per_minute:
        raise CtlError("--per-minute is for the recent view; a report's finest grain is "
                       "--by day")
    if csv and as_json:
        raise CtlError("--csv and --json: choose one")
    now = time.time()
    params: dict[str, Any] = {
        "since": parse_when(since, "--since", now) if since is not None else None,
        "until": parse_when(until, "--until", now) if until is not None else None,
        "by": by or "key,model", "key_id": key, "model": model, "team": team,
    }
    client = admin_client(ctx)
    if csv:
        # Raw, not through rich: a table console would wrap and pad the lines.
        sys.stdout.write(client.call("GET", "/usage/report", params={**params, "format": "csv"},
                                     text=True))
        sys.stdout.flush()
        return
    data = client.call("GET", "/usage/report", params=params)
    if as_json:
        print_json(data)
        return
    _print_report(data)


def _print_report(data: dict[str, Any]) -> None:
    heads = {"day": ("DAY",), "team": ("TEAM", "TEAM NAME"), "key": ("KEY", "NAME"),
             "model": ("MODEL",)}
    cells = {"day": ("day",), "team": ("team_id", "team_name"), "key": ("key_id", "key_name"),
             "model": ("model",)}
    table = new_table(*(h for d in data["by"] for h in heads[d]), *_COUNTER_HEADS)
    width = sum(len(cells[d]) for d in data["by"])
    for row in data["rows"]:
        table.add_row(*(str(row[c] or "") for d in data["by"] for c in cells[d]),
                      *(_cell(row, c) for c in _COUNTERS))
    total = data["total"]
    table.add_row("total", *([""] * (width - 1)), *(_cell(total, c) for c in _COUNTERS))
    console = make_console()
    console.print(f"{local_time(data['since'])} to {local_time(data['until'])} (local time)")
    console.print(table)


def _recent(ctx: typer.Context, minutes: int, key: str | None, model: str | None,
            per_minute: bool, as_json: bool, team: str | None = None) -> None:
    since = int(time.time()) - minutes * 60
    data = admin_client(ctx).call("GET", "/usage", params={"since": since, "key_id": key,
                                                           "model": model, "team": team})
    if as_json:
        print_json(data)
        return
    rows = data["rows"] if per_minute else data["by_key_model"]
    columns = ("MINUTE",) if per_minute else ()
    table = new_table(*columns, "KEY", "MODEL", *_COUNTER_HEADS)
    for row in [*rows, {**data["total"], "key_id": "total", "model": ""}]:
        minute = (local_time(row["minute"]) if "minute" in row else "",) if per_minute else ()
        table.add_row(*minute, row["key_id"] or "", row["model"] or "",
                      *(_cell(row, c) for c in _COUNTERS))
    make_console().print(table)
