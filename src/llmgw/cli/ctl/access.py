"""Who may use the fleet: ``llmgw ctl keys`` (list, create, set, revoke), ``join-token``,
``admin-token`` and ``gateway-token`` (rotation)."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from llmgw.cli.ctl.client import CtlError, admin_client, follow_admin_token, guarded
from llmgw.cli.ctl.limits import (
    BudgetOpt,
    DayOpt,
    MonthOpt,
    PeriodOpt,
    PriorityOpt,
    RpmOpt,
    TpmOpt,
    limits_body,
    limits_cell,
)
from llmgw.cli.ctl.listing import list_by_default
from llmgw.cli.ctl.render import JsonOpt, local_time, print_answer, print_json

keys_app = typer.Typer(help="API keys: list (default), create, set, revoke.")


list_by_default(
    keys_app, "/keys",
    ("KEY", "NAME", "TEAM", "MODELS", "LIMITS", "EXPIRES", "REVOKED"),
    lambda k: (k["key_id"], k["name"], k.get("team_id") or "-", ",".join(k["models"]) or "all",
               limits_cell(k), local_time(k["expires_at"]), "yes" if k["revoked"] else ""),
    "No API keys.",
    "API keys (never their secrets).",
)


@keys_app.command("create")
@guarded
def key_create(
    ctx: typer.Context,
    name: Annotated[str, typer.Option(help="A label for people.")] = "",
    model: Annotated[list[str] | None, typer.Option(
        "--model", help="A model it may use (repeat; default all).")] = None,
    rpm: RpmOpt = None, tpm: TpmOpt = None, tokens_per_day: DayOpt = None,
    tokens_per_month: MonthOpt = None, budget: BudgetOpt = None, budget_period: PeriodOpt = None,
    priority: PriorityOpt = None,
    team: Annotated[str | None, typer.Option(help="The team (id or name) it belongs to.")
                    ] = None,
    expires_in_days: Annotated[float | None, typer.Option(help="Expire after N days.",
                                                          min=0)] = None,
    as_json: JsonOpt = False,
) -> None:
    """Create an API key; its secret is shown now and never again."""
    body = {"name": name, "models": model or [], "team": team,
            **limits_body(rpm, tpm, tokens_per_day, tokens_per_month, budget, budget_period,
                           priority),
            "expires_at": None if expires_in_days is None
            else time.time() + expires_in_days * 86400}
    created = admin_client(ctx).call("POST", "/keys", body=body)
    if as_json:
        print_json(created)
        return
    typer.echo(f"key {created['key']['key_id']} created. Its secret, shown only this once:")
    typer.echo(created["secret"])


@keys_app.command("set")
@guarded
def key_set(
    ctx: typer.Context,
    key_id: str,
    team: Annotated[str | None, typer.Option(
        help="Move it to this team (id or name); 'none': the operator's.")] = None,
    rpm: RpmOpt = None, tpm: TpmOpt = None, tokens_per_day: DayOpt = None,
    tokens_per_month: MonthOpt = None, budget: BudgetOpt = None, budget_period: PeriodOpt = None,
    priority: PriorityOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Change a key's team or limits (those given; 0 clears a limit)."""
    body = limits_body(rpm, tpm, tokens_per_day, tokens_per_month, budget, budget_period,
                       priority)
    if team is not None:
        body["team"] = None if team == "none" else team
    changed = admin_client(ctx).call("PATCH", f"/keys/{key_id}", body=body)
    print_answer(changed, as_json, f"key {changed['key_id']} (team"
                 f" {changed.get('team_id') or '-'}): {limits_cell(changed)}")


@keys_app.command("revoke")
@guarded
def key_revoke(ctx: typer.Context, key_id: str) -> None:
    """Revoke an API key (gateways refuse it at their next config update)."""
    k = admin_client(ctx).call("DELETE", f"/keys/{key_id}")
    typer.echo(f"key {k['key_id']} revoked")


@guarded
def join_token(
    ctx: typer.Context,
    rotate: Annotated[bool, typer.Option("--rotate", help="Make a new join token.")] = False,
) -> None:
    """Make a new join token for agents (the old one stops working)."""
    secret = _rotated(ctx, rotate, "join tokens are stored only as hashes", "join-token",
                      "join_token")
    typer.echo(admin_client(ctx).join_token_for_agents(secret))


@guarded
def admin_token(
    ctx: typer.Context,
    rotate: Annotated[bool, typer.Option("--rotate", help="Make a new admin token.")] = False,
) -> None:
    """Make a new admin token (the old one stops working; up.json here follows)."""
    secret = _rotated(ctx, rotate, "the admin token is stored only as a hash", "admin-token")
    typer.echo(secret)
    written = follow_admin_token(ctx, secret)
    if written is not None:
        typer.echo(f"(written to {written} as well)", err=True)


@guarded
def gateway_token(
    ctx: typer.Context,
    rotate: Annotated[bool, typer.Option("--rotate", help="Make a new gateway token.")] = False,
) -> None:
    """Make a new gateway token for standalone gateways (the old one stops working)."""
    typer.echo(_rotated(ctx, rotate, "the gateway token is stored only as a hash",
                        "gateway-token"))


def _rotated(ctx: typer.Context, rotate: bool, stored: str, resource: str,
             field: str = "token") -> str:
    """A new secret for ``resource``; without --rotate, why none can be shown."""
    if not rotate:
        raise CtlError(f"{stored} and cannot be shown; make a new one with --rotate")
    return str(admin_client(ctx).call("POST", f"/{resource}/rotate")[field])


join_tokens_app = typer.Typer(help="Join tokens: list (default), create, revoke.")


list_by_default(
    join_tokens_app, "/join-tokens",
    ("ID", "DESCRIPTION", "CREATED", "EXPIRES", "USES", "STATE"),
    lambda t: (t["id"], t["description"], local_time(t["created_at"]),
               local_time(t["expires_at"]) if t["expires_at"] else "never",
               f"{t['uses']}/{t['max_uses'] or 'any'}",
               "usable" if t["usable"] else "revoked" if t["revoked"] else "spent"),
    "No join tokens.",
    "Join tokens (never their secrets): expiry, uses, revoked.",
)


@join_tokens_app.command("create")
@guarded
def join_token_create(
    ctx: typer.Context,
    ttl: Annotated[float | None, typer.Option(
        help="Hours until it stops working (0: never; default: the control plane's).",
        min=0)] = None,
    uses: Annotated[int | None, typer.Option(
        help="How many nodes may register with it (default: any number).", min=1)] = None,
    description: Annotated[str, typer.Option(help="A label for people.")] = "",
    as_json: JsonOpt = False,
) -> None:
    """Make a join token (others keep working); its secret is shown now and never again."""
    body = {"ttl_s": None if ttl is None else ttl * 3600, "uses": uses,
            "description": description}
    client = admin_client(ctx)
    created = client.call("POST", "/join-tokens", body=body)
    created["join_token"] = client.join_token_for_agents(created["join_token"])
    if as_json:
        print_json(created)
        return
    token = created["token"]
    expires = local_time(token["expires_at"]) if token["expires_at"] else "never"
    typer.echo(f"join token {token['id']} created (expires {expires}, uses "
               f"{token['max_uses'] or 'any'}). Its secret, shown only this once:", err=True)
    typer.echo(created["join_token"])


@join_tokens_app.command("revoke")
@guarded
def join_token_revoke(ctx: typer.Context, token_id: str) -> None:
    """Stop a join token from working (registered nodes keep their node tokens)."""
    token = admin_client(ctx).call("DELETE", f"/join-tokens/{token_id}")
    typer.echo(f"join token {token['id']} revoked")
