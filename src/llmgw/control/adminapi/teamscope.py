"""A team admin's reach over keys, teams and usage: its own teams' and nothing else.

The route class has already checked that the caller's roles grant the route's
action (llmgw.control.access.roles); for a team admin whose only grant of it
is team-scoped, these checks bound it to the teams it administers. A team is
named in a role map by its name (``team_admin:research``) or given by the
provider's team claim; either its name or its id matches.
"""

from __future__ import annotations

from fastapi import Request

from llmgw.control.access.roles import Action
from llmgw.control.adminapi.adminroute import principal_of
from llmgw.control.plane import ControlPlane
from llmgw.errors import ForbiddenError


def scope(request: Request, action: Action) -> frozenset[str] | None:
    """None: the whole fleet; else the team names and ids the caller may act on."""
    return principal_of(request).team_scope(action)


def in_scope(cp: ControlPlane, allowed: frozenset[str] | None, team_id: str | None) -> bool:
    if allowed is None:
        return True
    team = cp.teams.find(team_id) if team_id else None
    return team is not None and (team.team_id in allowed or team.name in allowed)


def require(request: Request, cp: ControlPlane, action: Action, team_id: str | None,
            what: str) -> None:
    """Refuse (403) ``action`` on a thing of ``team_id`` (None: the operator's) out of scope."""
    allowed = scope(request, action)
    if in_scope(cp, allowed, team_id):
        return
    team = cp.teams.find(team_id) if team_id else None
    owner = f"team {team.name!r}" if team else "the operator (no team)"
    principal = principal_of(request)
    raise ForbiddenError(
        f"{what}: it belongs to {owner}; {principal.name or principal.subject} is team admin"
        f" of {', '.join(sorted(allowed or ())) or 'no team'} only")
