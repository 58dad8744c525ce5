"""``llmgw ctl gateways``: which gateways follow the control plane, and how they place prefixes.

The count decides how gateways place a new prompt prefix (docs/gateway.md):
a gateway told it is alone places by load, and a second one that an operator
forgot about turns that into placement by hash for both. The line above the
table says which applies; the table says who is counted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import typer

from llmgw.cli.ctl.client import admin_client, guarded
from llmgw.cli.ctl.render import JsonOpt, make_console, print_json, print_listing


@guarded
def gateways(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """The gateways reporting their load, and how they place new prompt prefixes."""
    answer = admin_client(ctx).call("GET", "/gateways")
    if as_json:
        print_json(answer)
        return
    make_console().print(headline(answer))
    print_listing(
        answer["gateways"], False, ("ID", "LAST REPORT", "IN FLIGHT", "WAITING"),
        lambda g: (g["id"], f"{g['last_report_s']:.1f} s ago", str(g["in_flight"]),
                   waiting(g["waiting"])),
        "No gateway is reporting its load to this instance.",
    )


def headline(answer: Mapping[str, Any]) -> str:
    """The count the routing table carries, and how gateways place new prefixes with it."""
    if not answer["leader"]:
        # A standby hears no reports; its empty list says nothing about the fleet.
        return ("This instance is a standby: gateways report to the leader "
                "(give the leader's URL with --url).")
    count = answer["count"]
    if count == 0:
        # Gateways treat "not known yet" as several.
        return "count settling (new prefixes placed by hash)"
    who = "1 gateway routes" if count == 1 else f"{count} gateways route"
    return f"{who} (new prefixes placed {answer['placement']})"


def waiting(per_model: Mapping[str, int]) -> str:
    """``3 (chat 2, code 1)``: requests waiting for a replica, in all and per model."""
    nonzero = {model: n for model, n in sorted(per_model.items()) if n}
    if not nonzero:
        return "0"
    return f"{sum(nonzero.values())} (" + ", ".join(f"{m} {n}" for m, n in nonzero.items()) + ")"
