"""The ``--oidc-*`` flags ``serve`` and ``up`` share: single sign-on for the console and admin API.

Declared once here so the two commands cannot drift; parsed and checked by
llmgw.control.access.settings (docs/sso.md). The client secret is never a
flag (command lines are visible to every user of the machine): a file, or
``LLMGW_OIDC_CLIENT_SECRET``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from llmgw.control.access.settings import DEFAULT_SESSION_TTL_S, OidcSettings, oidc_settings

_PANEL = "Single sign-on (docs/sso.md)"

Issuer = Annotated[str | None, typer.Option(
    help="OpenID Connect issuer URL (https://; http only on loopback); turns SSO on.",
    rich_help_panel=_PANEL)]
ClientId = Annotated[str | None, typer.Option(help="This client's id at the provider.",
                                              rich_help_panel=_PANEL)]
SecretFile = Annotated[Path | None, typer.Option(
    help="File holding the client secret (default: $LLMGW_OIDC_CLIENT_SECRET; none: a public"
    " client, PKCE alone).", rich_help_panel=_PANEL)]
RedirectUrl = Annotated[str | None, typer.Option(
    help="The callback registered at the provider: <console URL>/console/auth/callback.",
    rich_help_panel=_PANEL)]
RolesClaim = Annotated[str, typer.Option(
    help="Claim carrying the groups or roles (dots for nested: realm_access.roles).",
    rich_help_panel=_PANEL)]
TeamClaim = Annotated[str | None, typer.Option(
    help="Claim carrying the team(s) of a team_admin rule without :TEAM.",
    rich_help_panel=_PANEL)]
RoleMap = Annotated[str, typer.Option(
    help="GROUP=ROLE,... with ROLE admin, operator, viewer, team_admin or team_admin:TEAM;"
    " GROUP may be email:ADDRESS.", rich_help_panel=_PANEL)]
Audience = Annotated[str | None, typer.Option(
    help="Accept the provider's JWT access tokens with this audience as bearer tokens on the"
    " admin API (must differ from the client id).", rich_help_panel=_PANEL)]
SessionHours = Annotated[float, typer.Option(
    help="How long a console session lasts.", rich_help_panel=_PANEL)]
DEFAULT_SESSION_HOURS = DEFAULT_SESSION_TTL_S / 3600


def settings_from_flags(
    issuer: str | None, client_id: str | None, secret_file: Path | None,
    redirect_url: str | None, roles_claim: str, team_claim: str | None, role_map: str,
    audience: str | None, session_hours: float,
) -> OidcSettings | None:
    return oidc_settings(issuer=issuer, client_id=client_id, redirect_url=redirect_url,
                         secret_file=secret_file, roles_claim=roles_claim,
                         team_claim=team_claim, role_map=role_map, audience=audience,
                         session_hours=session_hours)
