"""``llmgw ctl models`` (list, show, delete) and ``unpark``."""

from __future__ import annotations

from typing import Any

import typer

from llmgw.cli.ctl.client import admin_client, guarded
from llmgw.cli.ctl.listing import list_by_default
from llmgw.cli.ctl.render import print_json

models_app = typer.Typer(help="Models: list (default), show, delete.")


def _model_status(m: dict[str, Any]) -> str:
    if m.get("external") is not None:
        # Counts of URLs: ready are up, starting not checked yet.
        if m["ready"] >= m["desired"]:
            return "ok"
        if m["ready"] + m["starting"] >= m["desired"]:
            return "checking"
        return "down" if m["ready"] == 0 else "degraded"
    if m["parked"]:
        return "parked"
    if m["ready"] >= m["desired"]:
        return "ok"
    return "unplaceable" if m["unplaceable"] or m["total"] <= m["ready"] else "starting"


def under_bases(models: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each base model followed by its adapters; an adapter whose base is gone last."""
    by_base: dict[str, list[dict[str, Any]]] = {}
    for m in models:
        if m.get("base"):
            by_base.setdefault(m["base"], []).append(m)
    names = {m["name"] for m in models}
    ordered: list[dict[str, Any]] = []
    for m in models:
        if not m.get("base"):
            ordered += [m, *by_base.get(m["name"], [])]
    ordered += [m for m in models if m.get("base") and m["base"] not in names]
    return ordered


def _row(m: dict[str, Any]) -> tuple[str, ...]:
    if m.get("base"):
        # An adapter: loaded on how many of its base's replicas, not replicas of its own.
        rank = (m["spec"].get("adapter") or {}).get("rank", "?")
        status = "loaded" if m.get("loaded_on") else ("asked" if m["demanded"] else "idle")
        return (f"  └ {m['name']}", f"lora r{rank}", f"on {m.get('loaded_on', 0)}", "-",
                f"{m['min_replicas']}-{m['max_replicas']}", status, m["reason"] or "")
    return (m["name"], m["spec"]["engine"], f"{m['ready']}/{m['desired']}", str(m["starting"]),
            "-" if m.get("external") else f"{m['min_replicas']}-{m['max_replicas']}",
            _model_status(m), m["reason"] or "")


list_by_default(
    models_app, "/models",
    ("MODEL", "ENGINE", "READY", "STARTING", "MIN-MAX", "STATUS", "REASON"),
    _row,
    "No models in the catalog (llmgw ctl apply -f FILE).",
    "Models: replicas ready against what they should have now; a LoRA adapter under its"
    " base, with the base's replicas it is loaded on.",
    order=under_bases,
)


@models_app.command("show")
@guarded
def model_show(ctx: typer.Context, name: str) -> None:
    """One model and its entry, as JSON."""
    print_json(admin_client(ctx).call("GET", f"/models/{name}"))


@models_app.command("delete")
@guarded
def model_delete(ctx: typer.Context, name: str) -> None:
    """Remove a model from the catalog and stop its replicas."""
    typer.echo(admin_client(ctx).call("DELETE", f"/models/{name}")["message"])


@guarded
def unpark(ctx: typer.Context, model: str) -> None:
    """Retry a parked model from zero failures."""
    m = admin_client(ctx).call("POST", f"/models/{model}/unpark")
    typer.echo(f"model {m['name']} unparked")
