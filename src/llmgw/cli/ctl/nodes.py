"""``llmgw ctl nodes`` (list, show, delete) and ``cordon``/``uncordon``/``drain``."""

from __future__ import annotations

import urllib.parse
from typing import Annotated, Any

import typer
from rich.text import Text

from llmgw.cli.ctl.client import admin_client, guarded
from llmgw.cli.ctl.render import JsonOpt, ago, make_console, new_table, print_json, print_listing

nodes_app = typer.Typer(help="Nodes: list (default), show, delete.", no_args_is_help=False)


def _node_devices(node: dict[str, Any]) -> str:
    lines = []
    for c in node["classes"]:
        labels = [d["label"] for d in node["devices"] if d["gpu_class"] == c["gpu_class"]]
        mig = " [" + " ".join(labels) + "]" if "-mig-" in c["gpu_class"] else ""
        lines.append(f"{c['gpu_class']} {c['free']}/{c['total']} free{mig}")
    return "\n".join(lines) or "-"


def _node_issues(node: dict[str, Any]) -> str:
    lines = []
    for d in node["devices"]:
        if d["status"] == "unhealthy":
            lines.append(f"{d['label']} unhealthy: {'; '.join(d['unhealthy_reasons']) or '?'}")
        elif d["status"] == "unplaceable":
            lines.append(f"{d['label']} not placeable: {d['unplaceable_reason'] or '?'}")
    lines += node["warnings"]
    return "\n".join(lines) or "-"


@nodes_app.callback(invoke_without_command=True)
@guarded
def nodes(
    ctx: typer.Context,
    as_json: JsonOpt = False,
    state: Annotated[str | None, typer.Option(
        help="ready, cordoned, draining, unreachable")] = None,
    fabric: Annotated[str | None, typer.Option(help="Only nodes in this fabric.")] = None,
) -> None:
    """Nodes with their devices by class, health and reasons."""
    if ctx.invoked_subcommand is not None:
        return
    print_listing(
        admin_client(ctx).call("GET", "/nodes", params={"state": state, "fabric": fabric}),
        as_json, ("NODE", "STATE", "FABRICS", "DEVICES", "HEALTH", "MODELS", "SEEN"),
        lambda node: (node["name"], node["state"], ",".join(node["fabrics"]) or "-",
                      _node_devices(node), _node_issues(node), str(len(node["models"])),
                      ago(node["last_seen"])),
        "No nodes registered.",
    )


@nodes_app.command("show")
@guarded
def node_show(ctx: typer.Context, name: str, as_json: JsonOpt = False) -> None:
    """One node, device by device (MIG instances as card/migN)."""
    node = admin_client(ctx).call("GET", f"/nodes/{name}")
    if as_json:
        print_json(node)
        return
    console = make_console()
    console.print(Text.assemble(
        (node["name"], "bold"),
        f"  {node['state']}  {node['address']}  fabrics: {','.join(node['fabrics']) or '-'}"
        f"  seen {ago(node['last_seen'])}"))
    table = new_table("DEVICE", "CLASS", "STATUS", "USED BY", "MEMORY", "TEMP", "POWER", "UTIL",
                      "REASON")
    for d in node["devices"]:
        table.add_row(
            d["label"], d["gpu_class"], d["status"], d["used_by"] or "-",
            f"{d['memory_used_mib']}/{d['memory_total_mib']} MiB",
            "-" if d["temperature_c"] is None else f"{d['temperature_c']} C",
            "-" if d["power_w"] is None else f"{d['power_w']:.0f} W",
            "-" if d["utilization_pct"] is None else f"{d['utilization_pct']}%",
            "; ".join(d["unhealthy_reasons"]) or d["unplaceable_reason"] or "",
        )
    console.print(table)
    console.print(f"weights: {', '.join(node['models']) or '-'}")
    for warning in node["warnings"]:
        console.print(f"warning: {warning}")


@nodes_app.command("delete")
@guarded
def node_delete(ctx: typer.Context, name: str) -> None:
    """Forget a node; its agent must register again with a join token."""
    typer.echo(admin_client(ctx).call("DELETE", f"/nodes/{name}")["message"])


@nodes_app.command("addresses")
@guarded
def node_addresses(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """Which node each address is bound to (the server certificate that names it)."""
    claims = admin_client(ctx).call("GET", "/addresses")
    if as_json:
        print_json(claims)
        return
    for claim in claims:
        typer.echo(f"{claim['address']}  {claim['node']}")


@nodes_app.command("free-address")
@guarded
def node_free_address(ctx: typer.Context, address: str) -> None:
    """Unbind an address from its node: the next node to report it may get a certificate for it."""
    path = f"/addresses/{urllib.parse.quote(address, safe='')}"
    typer.echo(admin_client(ctx).call("DELETE", path)["message"])


@nodes_app.command("fabrics")
@guarded
def node_fabrics(
    ctx: typer.Context,
    name: str,
    fabric: Annotated[list[str] | None, typer.Argument(help="The node's fabrics.")] = None,
    reported: Annotated[bool, typer.Option(
        "--reported", help="Unset them: none, or what the node reports where serve runs"
        " with --trust-reported-fabrics.")] = False,
) -> None:
    """Set NODE's fabrics (a report only proposes them), or --reported."""
    client = admin_client(ctx)
    if reported:
        node = client.call("DELETE", f"/nodes/{name}/fabrics")
    else:
        node = client.call("PUT", f"/nodes/{name}/fabrics", body={"fabrics": fabric or []})
    typer.echo(f"node {node['name']} fabrics: {','.join(node['fabrics']) or 'none'}"
               + (" (unset)" if reported else " (set)"))


@nodes_app.command("approve")
@guarded
def node_approve(ctx: typer.Context, name: str) -> None:
    """Accept a node that registered while serve --approve-nodes holds new nodes."""
    node = admin_client(ctx).call("POST", f"/nodes/{name}/approve")
    typer.echo(f"node {node['name']} approved; it is {node['state']}")


# cordon, uncordon and drain are top-level commands (``llmgw ctl cordon NODE``);
# the ctl package registers them.


def _node_action(ctx: typer.Context, name: str, action: str) -> None:
    node = admin_client(ctx).call("POST", f"/nodes/{name}/{action}")
    typer.echo(f"node {node['name']} is {node['state']}")


@guarded
def cordon(ctx: typer.Context, node: str) -> None:
    """Place nothing new on NODE; its replicas stay."""
    _node_action(ctx, node, "cordon")


@guarded
def uncordon(ctx: typer.Context, node: str) -> None:
    """Let NODE take new replicas again."""
    _node_action(ctx, node, "uncordon")


@guarded
def drain(ctx: typer.Context, node: str) -> None:
    """Move NODE's replicas away (new one first, then the old one) and place nothing there."""
    _node_action(ctx, node, "drain")
