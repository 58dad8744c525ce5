"""A verified token's claims to a :class:`Principal`: the provider's groups become roles.

Pure, so the mapping that decides who may do what is tested without a
provider. The claim holding groups may be nested (Keycloak's
``realm_access.roles``) and a list or one string; anything else yields no
groups, never an error that would lock everyone out on a provider's quirk.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmgw.control.access.roles import Principal, Role
from llmgw.control.access.settings import EMAIL_PREFIX, OidcSettings


def claim(claims: Mapping[str, Any], path: str) -> Any:
    """``a.b.c`` looked up through nested objects; a flat name with dots is tried first."""
    if path in claims:
        return claims[path]
    value: Any = claims
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list | tuple):
        return [v for v in value if isinstance(v, str)]
    return []


def principal_from_claims(
    claims: Mapping[str, Any], settings: OidcSettings, via: str
) -> Principal:
    """Roles granted by the rules that match the caller's groups (or verified e-mail)."""
    groups = set(_strings(claim(claims, settings.roles_claim)))
    email = claims.get("email") if isinstance(claims.get("email"), str) else None
    if email and claims.get("email_verified") is not False:
        groups.add(EMAIL_PREFIX + email)
    own_teams = (_strings(claim(claims, settings.team_claim)) if settings.team_claim else [])
    roles: set[Role] = set()
    teams: set[str] = set()
    for rule in settings.rules:
        if rule.group not in groups:
            continue
        if rule.role is Role.TEAM_ADMIN:
            granted = [rule.team] if rule.team else own_teams
            if not granted:
                continue  # a team admin of no team administers nothing
            teams.update(granted)
        roles.add(rule.role)
    subject = str(claims.get("sub", ""))
    name = next((str(claims[k]) for k in ("email", "preferred_username", "name")
                 if isinstance(claims.get(k), str)), subject)
    return Principal(subject=subject, roles=frozenset(roles), teams=frozenset(teams), via=via,
                     name=name)
