"""``llmgw ctl status``: the whole fleet on one screen, from the admin summary."""

from __future__ import annotations

from typing import Any

import typer
from rich.console import Group
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


def status_view(data: dict[str, Any]) -> Group:
    s, models = data["summary"], data["models"]
    n, r, m = s["nodes"], s["replicas"], s["models"]
    parts: list[Any] = [
        Text.from_markup(
            f"[bold]Nodes[/]     {n['total']} total: {n['ready']} ready, {n['cordoned']} cordoned, "
            f"{n['draining']} draining, {n['unreachable']} unreachable"),
        Text.from_markup(
            f"[bold]Replicas[/]  {r['ready']} ready, {r['starting']} starting, "
            f"{r['draining']} draining, {r['failed']} failed, "
            f"{r['unreachable']} unreachable"),
        Text.from_markup(
            f"[bold]Models[/]    {m['total']} total: {m['satisfied']} satisfied, "
            f"{m['short']} short"),
        Text(""),
    ]
    devices = new_table("CLASS", "TOTAL", "USED", "FREE", "UNHEALTHY", title="Devices by class")
    for g in s["gpus"]:
        devices.add_row(g["class"], str(g["total"]), str(g["used"]), str(g["free"]),
                        str(g["unhealthy"]))
    parts += [devices if s["gpus"] else Text("Devices: none reported"), Text("")]
    if s["fabrics"]:
        fabrics = new_table("FABRIC", "NODES", "WITH WEIGHTS", "MODELS", "FREE BLOCK",
                            title="Fabrics")
        for f in s["fabrics"]:
            fabrics.add_row(f["fabric"], str(f["nodes"]), str(f["nodes_with_weights"]),
                            str(f["models_present"]), str(f["largest_free_block"]))
        parts += [fabrics, Text("")]
    reasons = {mv["name"]: mv.get("reason") for mv in models}
    if s["unplaceable"]:
        parts.append(Text("Unplaceable", style="bold red"))
        for name in s["unplaceable"]:
            why = reasons.get(name) or "short of replicas, none starting"
            parts.append(Text(f"  {name}: {why}"))
        parts.append(Text(""))
    if s["parked"]:
        parts.append(Text("Parked (not retried; llmgw ctl unpark MODEL)", style="bold yellow"))
        for p in s["parked"]:
            parts.append(Text(f"  {p['model']}: {p['failures']} failures: {p['reason'] or '-'}"))
        parts.append(Text(""))
    if s["idle_replicas"]:
        idle = new_table("REPLICA", "MODEL", "IDLE", "GPUS", title="Idle replicas (10 min or more)")
        for i in s["idle_replicas"]:
            idle.add_row(i["id"], i["model"], duration(i["idle_seconds"]), str(i["gpus"]))
        parts += [idle, Text("")]
    if s.get("store_error"):
        parts.append(Text(f"Store: {s['store_error']}", style="bold red"))
    elif s["store"]:
        store = new_table("MEMBER", "HOST", "ROLE", "STATE", "LAG", title="Store")
        for mb in s["store"]:
            store.add_row(mb["name"], mb["host"], mb["role"], mb["state"],
                          "unknown" if mb["lag"] < 0 else byte_size(mb["lag"]))
        parts.append(store)
    else:
        parts.append(Text("Store: a single database"))
    return Group(*parts)


@guarded
def status(ctx: typer.Context, as_json: JsonOpt = False, watch: WatchOpt = None) -> None:
    """The whole fleet on one screen."""
    client = admin_client(ctx)

    def fetch() -> dict[str, Any]:
        summary = client.call("GET", "/summary")
        # The reasons behind "unplaceable" live on the models.
        models = client.call("GET", "/models") if summary["unplaceable"] else []
        return {"summary": summary, "models": models}

    if as_json:
        # --json prints the summary alone; the models are only for the table's reasons.
        print_json(client.call("GET", "/summary"))
    else:
        show_view(fetch, status_view, watch)
