"""``llmgw ctl events``: what the control plane did and why."""

from __future__ import annotations

from typing import Annotated

import typer

from llmgw.cli.ctl.client import admin_client, guarded
from llmgw.cli.ctl.render import JsonOpt, local_time, print_listing


@guarded
def events(
    ctx: typer.Context,
    kind: Annotated[str | None, typer.Option(help="e.g. placed, failed, parked, drain")] = None,
    subject: Annotated[str | None, typer.Option(help="A model, replica or node.")] = None,
    since: Annotated[int, typer.Option(help="Only events after this id.", min=0)] = 0,
    limit: Annotated[int, typer.Option(help="At most this many (the latest).", min=1,
                                       max=1000)] = 50,
    as_json: JsonOpt = False,
) -> None:
    """What the control plane did and why, oldest first."""
    data = admin_client(ctx).call("GET", "/events", params={"kind": kind, "subject": subject,
                                                            "since": since, "limit": limit})
    print_listing(
        data, as_json, ("ID", "TIME", "KIND", "SUBJECT", "MESSAGE"),
        lambda e: (str(e["id"]), local_time(e["at"]), e["kind"], e["subject"], e["message"]),
        "No events.",
    )
