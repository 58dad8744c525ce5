"""What a resource's group does without a subcommand (``llmgw ctl keys``, ``models``,
``join-tokens``): list the resource, as a table or with --json as the API gave it.

Only the path, the columns and the message for an empty list differ from group to group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import typer

from llmgw.cli.ctl.client import admin_client, guarded
from llmgw.cli.ctl.render import JsonOpt, print_listing


def list_by_default(
    app: typer.Typer,
    path: str,
    columns: Sequence[str],
    row: Callable[[dict[str, Any]], Sequence[str]],
    empty: str,
    doc: str,
    order: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] | None = None,
) -> None:
    """Make ``app``'s callback list ``GET path``; ``doc`` is its help, as a docstring is.

    ``order``: the rows' order in the table (the JSON keeps the API's)."""

    def listing(ctx: typer.Context, as_json: JsonOpt = False) -> None:
        if ctx.invoked_subcommand is not None:
            return
        data = admin_client(ctx).call("GET", path)
        rows = order(data) if order is not None and not as_json else data
        print_listing(rows, as_json, columns, row, empty)

    listing.__doc__ = doc
    app.callback(invoke_without_command=True)(guarded(listing))
