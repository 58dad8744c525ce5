"""``llmgw ctl replicas`` (list, show, drain): where replicas run, how far a start has got."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.text import Text

from llmgw.cli.ctl.client import admin_client, guarded
from llmgw.cli.ctl.render import (
    JsonOpt,
    WatchOpt,
    byte_size,
    duration,
    new_table,
    print_json,
    show_view,
)

replicas_app = typer.Typer(help="Replicas: list (default), show, drain.")


def _progress(r: dict[str, Any]) -> str:
    d = r.get("download")
    if d:
        total = d.get("bytes_total")
        pct = f"{100 * d['bytes_done'] / total:.0f}% of {byte_size(total)}" if total else (
            byte_size(d["bytes_done"]))
        eta = f", {duration(d['eta_s'])} left" if d.get("eta_s") else ""
        return f"weights {pct}{eta}"
    return r.get("reason") or ""


def replicas_view(data: list[dict[str, Any]]) -> Any:
    if not data:
        return Text("No replicas.")
    table = new_table("REPLICA", "MODEL", "STATE", "WHERE", "URL", "IDLE", "GPUS", "PROGRESS")
    for r in data:
        where = " ".join(f"{s['node']}:{','.join(s['devices'])}" for s in r["shards"])
        table.add_row(r["id"], r["model"], r["state"], where, r["url"] or "-",
                      duration(r["idle_seconds"]), str(r["gpus"]), _progress(r))
    return table


@replicas_app.callback(invoke_without_command=True)
@guarded
def replicas(
    ctx: typer.Context,
    model: Annotated[str | None, typer.Option(help="Only this model's replicas.")] = None,
    node: Annotated[str | None, typer.Option(help="Only replicas on this node.")] = None,
    state: Annotated[str | None, typer.Option(help="starting, ready, draining, failed")] = None,
    as_json: JsonOpt = False,
    watch: WatchOpt = None,
) -> None:
    """Replicas, where they run, and how far a start has got."""
    if ctx.invoked_subcommand is not None:
        return
    client = admin_client(ctx)

    def fetch() -> Any:
        return client.call("GET", "/replicas",
                           params={"model": model, "node": node, "state": state})

    if as_json:
        print_json(fetch())
    else:
        show_view(fetch, replicas_view, watch)


@replicas_app.command("show")
@guarded
def replica_show(ctx: typer.Context, replica_id: str) -> None:
    """One replica as JSON, with the engine's log tail."""
    print_json(admin_client(ctx).call("GET", f"/replicas/{replica_id}"))


@replicas_app.command("drain")
@guarded
def replica_drain(ctx: typer.Context, replica_id: str) -> None:
    """Stop routing to a replica; in-flight requests finish, then it stops."""
    r = admin_client(ctx).call("POST", f"/replicas/{replica_id}/drain")
    typer.echo(f"replica {r['id']} is {r['state']}")
