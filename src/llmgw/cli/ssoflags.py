"""The ``--oidc-*`` flags ``serve`` and ``up`` share: single sign-on for the console and admin API.

Declared once here (``with_sso_flags`` adds them to a command) so the two
commands cannot drift; parsed and checked by
llmgw.control.access.settings (docs/sso.md). The client secret is never a
flag (command lines are visible to every user of the machine): a file, or
``LLMGW_OIDC_CLIENT_SECRET``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, TypeVar, get_type_hints

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
R = TypeVar("R")


@dataclass(frozen=True)
class SsoFlags:
    """The flags as given, each field one of them under its parameter's name;
    ``settings()`` checks them together."""

    oidc_issuer: Issuer = None
    oidc_client_id: ClientId = None
    oidc_client_secret_file: SecretFile = None
    oidc_redirect_url: RedirectUrl = None
    oidc_roles_claim: RolesClaim = "groups"
    oidc_team_claim: TeamClaim = None
    oidc_role_map: RoleMap = ""
    oidc_audience: Audience = None
    session_hours: SessionHours = DEFAULT_SESSION_HOURS

    def settings(self) -> OidcSettings | None:
        """The SSO settings they make (None: SSO off); ConfigError when they do not fit."""
        return oidc_settings(
            issuer=self.oidc_issuer, client_id=self.oidc_client_id,
            redirect_url=self.oidc_redirect_url, secret_file=self.oidc_client_secret_file,
            roles_claim=self.oidc_roles_claim, team_claim=self.oidc_team_claim,
            role_map=self.oidc_role_map, audience=self.oidc_audience,
            session_hours=self.session_hours,
        )


def with_sso_flags(command: Callable[..., R]) -> Callable[..., R]:
    """``command`` with SsoFlags's fields added to its flags, given to it as one ``sso``
    argument (an SsoFlags) in their place.

    Typer reads a command's flags from its signature and has no way to share a group
    of them: the signature typer reads here is the command's own, ``sso`` left out,
    with the fields added at its end; the call takes them out again.
    """
    own = inspect.signature(command, eval_str=True)
    annotations = get_type_hints(SsoFlags, include_extras=True)
    names = [field.name for field in dataclasses.fields(SsoFlags)]
    parameters = [p for p in own.parameters.values() if p.name != "sso"] + [
        inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=field.default,
                          annotation=annotations[field.name])
        for field in dataclasses.fields(SsoFlags)
    ]

    @functools.wraps(command)
    def with_flags(**given: Any) -> R:
        sso = SsoFlags(**{name: given.pop(name) for name in names})
        return command(**given, sso=sso)

    # What typer reads: inspect.signature() and get_type_hints() of the command.
    with_flags.__signature__ = own.replace(parameters=parameters)  # type: ignore[attr-defined]
    with_flags.__annotations__ = {p.name: p.annotation for p in parameters}
    return with_flags
