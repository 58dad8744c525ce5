"""``llmgw ctl``: the admin API from a terminal.

Tables for people, ``--json`` for scripts (the admin API's own JSON, as it
came), ``--watch`` where a screen that refreshes saves re-typing.

This package assembles the typer app; each module owns one part:
``client`` (where to connect, with what token, and one-line errors),
``render`` (tables, ``--json``, ``--watch``), and the commands by subject:
``status``, ``nodes``, ``models``, ``catalog`` (apply, plan), ``replicas``,
``events``, ``gateways``, ``access`` (keys, join token), ``usage``, and ``backup`` (backup and
restore, which talk to the store itself).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from llmgw.cli.ctl import (
    access,
    backup,
    catalog,
    events,
    gateways,
    models,
    nodes,
    replicas,
    status,
    teams,
    usage,
)
from llmgw.cli.ctl.client import Settings
from llmgw.cli.secretfile import pick_secret
from llmgw.errors import ConfigError

app = typer.Typer(
    name="ctl",
    help=(
        "Operate a running llmgw: fleet status, nodes, models, replicas, keys, usage;"
        " back up and restore its store.\n\n"
        "With a leader and standbys, give every instance: --url http://cp1:8080,http://cp2:8080"
        " (or LLMGW_URL). Reads come from the first that answers; a write a standby refuses"
        " goes to the leader it names, or to the next URL."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
ctl = app


@app.callback()
def main(
    ctx: typer.Context,
    url: Annotated[str | None, typer.Option(
        envvar="LLMGW_URL",
        help="Control plane base URL, e.g. http://127.0.0.1:8080; several comma-separated "
             "(leader and standbys).")] = None,
    token: Annotated[str | None, typer.Option(
        envvar="LLMGW_ADMIN_TOKEN", help="The admin token; prefer --token-file.")] = None,
    token_file: Annotated[Path | None, typer.Option(
        envvar="LLMGW_ADMIN_TOKEN_FILE",
        help="A file holding the admin token (keeps it off the command line).")] = None,
    data_dir: Annotated[Path | None, typer.Option(
        envvar="LLMGW_DATA_DIR", help="Where up.json is (default: llmgw's data dir).")] = None,
    ca_file: Annotated[Path | None, typer.Option(
        envvar="LLMGW_CA_FILE",
        help="The fleet's CA to check an https:// control plane against (default: up.json's"
             " ca_file on the control plane's machine).")] = None,
    insecure_http: Annotated[bool, typer.Option(
        help="Allow a plain http:// control plane on another machine.")] = False,
) -> None:
    try:
        token = pick_secret(token, token_file, "admin token", "--token")
    except ConfigError as exc:
        typer.echo(f"llmgw ctl: {exc}", err=True)
        raise typer.Exit(1) from None
    ctx.obj = Settings(url=url, token=token, data_dir=data_dir, ca_file=ca_file,
                       insecure_http=insecure_http)


# Every command is registered here, in one place, because the order they are
# added in is the order ``llmgw ctl --help`` lists them (typer lists commands,
# then groups, each as added); decorators spread over the modules would make
# that order depend on import order, which the import sorter rewrites.
app.command()(status.status)
app.add_typer(nodes.nodes_app, name="nodes")
app.command()(nodes.cordon)
app.command()(nodes.uncordon)
app.command()(nodes.drain)
app.add_typer(models.models_app, name="models")
app.command()(models.unpark)
app.command()(catalog.apply)
app.command()(catalog.plan)
app.add_typer(replicas.replicas_app, name="replicas")
app.command()(events.events)
app.command()(gateways.gateways)
app.add_typer(access.keys_app, name="keys")
app.add_typer(teams.teams_app, name="teams")
app.command()(usage.usage)
app.command("join-token")(access.join_token)
app.add_typer(access.join_tokens_app, name="join-tokens")
app.command("admin-token")(access.admin_token)
app.command("gateway-token")(access.gateway_token)
app.command()(backup.backup)
app.command()(backup.restore)

__all__ = ["app", "ctl"]
