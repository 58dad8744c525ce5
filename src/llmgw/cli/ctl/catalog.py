"""``llmgw ctl apply`` and ``llmgw ctl plan``: catalog changes and what they would do."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Group
from rich.text import Text

from llmgw.cli.ctl.client import CtlError, admin_client, guarded
from llmgw.cli.ctl.render import JsonOpt, make_console, new_table, print_json


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise CtlError(f"cannot read {path}: {exc.strerror or exc}") from None


def plan_view(plan: dict[str, Any]) -> Group:
    table = new_table("MODEL", "STATUS", "CURRENT", "DESIRED", "REASON")
    for m in plan.get("models", []):
        table.add_row(m["name"], m["status"], str(m["current"]), str(m["desired"]),
                      m.get("reason") or "")
    devices = new_table("CLASS", "TOTAL", "USED", "FREE", "UNHEALTHY", "FREE AFTER",
                        title="Devices by class")
    for d in plan.get("devices", []):
        devices.add_row(d["gpu_class"], str(d["total"]), str(d["used"]), str(d["free"]),
                        str(d["unhealthy"]), str(d.get("free_after", "")))
    lines: list[Any] = [table, Text("")]
    # Why placement went past a node for a model: without it a plan that
    # skips the node holding the weights looks like a scheduler bug.
    avoided = [line for m in plan.get("models", []) for line in m.get("avoided", [])]
    if avoided:
        lines.append(Text("Nodes avoided after failures:", style="bold"))
        lines.extend(Text(f"  {line}") for line in avoided)
        lines.append(Text(""))
    lines.extend([devices, Text("")])
    lines.extend(_adapter_lines(plan.get("adapters", [])))
    lines.append(Text(f"{plan.get('placements', 0)} placement(s), "
                      f"{plan.get('removals', 0)} removal(s)"))
    if plan.get("unplaceable"):
        lines.append(Text("unplaceable: " + ", ".join(plan["unplaceable"]), style="bold red"))
    return Group(*lines)


def _adapter_lines(bases: list[dict[str, Any]]) -> list[Text]:
    """Per base model: its adapters loaded where, and those asked for and loaded nowhere."""
    lines: list[Text] = []
    for base in bases:
        loaded = {rid: names for rid, names in base["loaded"].items() if names}
        count = sum(len(names) for names in loaded.values())
        lines.append(Text(f"Adapters of {base['base']}: {count} loaded of {base['adapters']}"
                          f" on {len(loaded)} replica(s), {base['slots_per_replica']} slot(s)"
                          " each", style="bold"))  # fmt: skip
        lines.extend(Text(f"  {rid}: {', '.join(names)}") for rid, names in loaded.items())
        lines.extend(Text(f"  not loaded: {name}: {why}", style="red")
                     for name, why in base["not_loaded"].items())  # fmt: skip
    return [*lines, Text("")] if lines else []


@guarded
def apply(
    ctx: typer.Context,
    file: Annotated[Path, typer.Option("-f", "--file", help="YAML or JSON catalog entries.")],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show the diff and the plan only.")]
    = False,
    as_json: JsonOpt = False,
) -> None:
    """Add or change catalog entries from FILE."""
    body = {"document": _read(file), "source": str(file), "dry_run": dry_run}
    result = admin_client(ctx).call("POST", "/apply", body=body)
    if as_json:
        print_json(result)
        return
    console = make_console()
    verb = "would be" if dry_run else "were"
    for name in result["added"]:
        console.print(f"+ {name}  (added)")
    for name in result["changed"]:
        console.print(f"~ {name}  ({', '.join(result['changed_fields'].get(name, []))})")
    for name in result["unchanged"]:
        console.print(f"= {name}  (unchanged)")
    console.print(f"{len(result['added'])} added, {len(result['changed'])} changed "
                  f"({verb} applied)")
    if dry_run and result.get("plan"):
        console.print()
        console.print(plan_view(result["plan"]))


@guarded
def plan(
    ctx: typer.Context,
    what_if: Annotated[Path | None, typer.Option(
        "--what-if", help="Plan as if these entries (YAML/JSON) were added.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """What the scheduler would do now: where models go, what cannot be placed and why."""
    client = admin_client(ctx)
    if what_if is None:
        result = client.call("GET", "/plan")
    else:
        result = client.call("POST", "/plan",
                             body={"document": _read(what_if), "source": str(what_if)})
    if as_json:
        print_json(result)
    else:
        make_console().print(plan_view(result))
