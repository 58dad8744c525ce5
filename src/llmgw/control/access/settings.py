"""How the control plane is told about its OpenID Connect provider (``--oidc-*``).

Parsed once at start-up and refused there when it cannot work: a role map
that names no known role, or an issuer reached over plain HTTP on another
machine (the provider's keys would come over a channel anyone on the path
can rewrite, and with them every identity), must stop ``serve`` with one
line, not surface as a failed login hours later.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from llmgw.control.access.roles import Role
from llmgw.errors import ConfigError
from llmgw.tls import is_loopback

SECRET_ENV = "LLMGW_OIDC_CLIENT_SECRET"
# A working day: long enough not to interrupt an operator, short enough that
# a person removed from the provider's groups loses the console by tomorrow.
DEFAULT_SESSION_TTL_S = 8 * 3600.0
# Matches the verified e-mail address instead of a group (providers such as
# Google put no groups in their tokens).
EMAIL_PREFIX = "email:"


@dataclass(frozen=True)
class RoleRule:
    """One ``GROUP=ROLE`` of the role map; ``team`` None takes it from the team claim."""

    group: str
    role: Role
    team: str | None = None


@dataclass(frozen=True)
class OidcSettings:
    issuer: str
    client_id: str
    redirect_url: str
    client_secret: str | None = field(default=None, repr=False)
    roles_claim: str = "groups"
    team_claim: str | None = None
    rules: tuple[RoleRule, ...] = ()
    scopes: tuple[str, ...] = ("openid", "profile", "email")
    # The audience a provider's access token must carry to be taken as a bearer
    # token on the admin API (RFC 9068 JWT access tokens); None: none are.
    audience: str | None = None
    session_ttl_s: float = DEFAULT_SESSION_TTL_S
    ca_file: Path | None = None

    @property
    def secure_cookies(self) -> bool:
        return self.redirect_url.startswith("https://")


def parse_role_map(text: str) -> tuple[RoleRule, ...]:
    """``admins=admin,ops=operator,team-a-leads=team_admin:team-a`` as rules."""
    rules: list[RoleRule] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        group, sep, target = item.rpartition("=")
        if not sep or not group.strip():
            raise ConfigError(f"--oidc-role-map entry {item!r} is not GROUP=ROLE")
        role_name, _, team = target.strip().partition(":")
        try:
            role = Role(role_name)
        except ValueError:
            known = ", ".join(r.value for r in Role)
            raise ConfigError(f"--oidc-role-map entry {item!r}: role {role_name!r} is not one of "
                              f"{known}") from None
        if team and role is not Role.TEAM_ADMIN:
            raise ConfigError(f"--oidc-role-map entry {item!r}: only team_admin takes a team")
        rules.append(RoleRule(group.strip(), role, team or None))
    return tuple(rules)


def _check_url(flag: str, url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme == "https" or (parts.scheme == "http" and is_loopback(parts.hostname or "")):
        return url.rstrip("/") if flag == "--oidc-issuer" else url
    raise ConfigError(f"{flag} {url!r} must be https:// (plain http only on loopback)")


def client_secret_from(file: Path | None) -> str | None:
    """The client secret from a file (first line) or ``LLMGW_OIDC_CLIENT_SECRET``.

    Never a flag: command lines are readable by every user of the machine.
    """
    if file is not None:
        try:
            return file.read_text().strip() or None
        except OSError as exc:
            raise ConfigError(f"--oidc-client-secret-file: {exc}") from None
    return os.environ.get(SECRET_ENV) or None


def oidc_settings(
    *, issuer: str | None, client_id: str | None, redirect_url: str | None,
    secret_file: Path | None = None, roles_claim: str = "groups", team_claim: str | None = None,
    role_map: str = "", audience: str | None = None,
    session_hours: float = DEFAULT_SESSION_TTL_S / 3600, ca_file: Path | None = None,
) -> OidcSettings | None:
    """Settings from the CLI's flags; None when no issuer is given (SSO off)."""
    if not issuer:
        if client_id or redirect_url or role_map:
            raise ConfigError("--oidc-client-id, --oidc-redirect-url and --oidc-role-map need "
                              "--oidc-issuer")
        return None
    if not client_id or not redirect_url:
        raise ConfigError("--oidc-issuer needs --oidc-client-id and --oidc-redirect-url")
    rules = parse_role_map(role_map)
    if not rules:
        raise ConfigError("--oidc-role-map is empty: nobody signing in would have a role")
    if team_claim is None and any(r.role is Role.TEAM_ADMIN and r.team is None for r in rules):
        raise ConfigError("a team_admin rule without :TEAM needs --oidc-team-claim")
    if audience is not None and audience == client_id:
        # An ID token's audience is the client id: one equal to the API's
        # would let an ID token pass as an access token.
        raise ConfigError("--oidc-audience must differ from --oidc-client-id")
    if session_hours <= 0:
        raise ConfigError("--session-hours must be positive")
    return OidcSettings(
        issuer=_check_url("--oidc-issuer", issuer), client_id=client_id,
        redirect_url=_check_url("--oidc-redirect-url", redirect_url),
        client_secret=client_secret_from(secret_file), roles_claim=roles_claim,
        team_claim=team_claim, rules=rules, audience=audience,
        session_ttl_s=session_hours * 3600, ca_file=ca_file,
    )
