"""Who may do what on the admin API: roles, actions, and the one table between them.

Without roles every person who can open the console holds the admin token,
which can rotate itself, let a machine into the fleet and mint API keys: a
dashboard viewer becomes a fleet owner. Here each admin route names one
:class:`Action`, each :class:`Role` is granted a set of actions, and the
admin route class checks the pair before the route runs.

    action          routes                                   admin operator viewer team_admin
    self            whoami                                     x      x       x       x
    catalog.read    models list/get                            x      x       x       x
    fleet.read      summary, nodes, replicas, plan, events,    x      x       x
                    gateways, addresses
    fleet.operate   cordon/drain/fabrics, replica drain,       x      x
                    models put/delete/apply/unpark, what-if
                    plan, node delete
    usage.read      usage, usage report                        x      x       x       own team
    teams.read      teams list/get                             x      x       x       own team
    teams.write     teams create/update/delete                 x
    keys.read       keys list (no secrets: names, teams,       x      x       x       own team
                    models, limits)
    keys.write      keys create/update/revoke                  x                      own team
    trust           join tokens, token rotations, node         x
                    approval, address release

Teams carry limits and budgets (what a tenant may spend), so only admins
change them; a team admin manages its team's keys within them. Trust stays
with admins alone: a join token or an approval lets a machine
into the fleet (it then receives weights and engine keys), so it is a
credential decision, not a fleet operation. A route missing from the table
is admin-only (fail closed), and a test makes every route choose.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from llmgw.errors import ForbiddenError


class Role(StrEnum):
    ADMIN = "admin"
    OPERATOR = "operator"
    VIEWER = "viewer"
    TEAM_ADMIN = "team_admin"


class Action(StrEnum):
    SELF = "self"
    CATALOG_READ = "catalog.read"
    FLEET_READ = "fleet.read"
    FLEET_OPERATE = "fleet.operate"
    USAGE_READ = "usage.read"
    TEAMS_READ = "teams.read"
    TEAMS_WRITE = "teams.write"
    KEYS_READ = "keys.read"
    KEYS_WRITE = "keys.write"
    TRUST = "trust"


GRANTS: dict[Role, frozenset[Action]] = {
    Role.ADMIN: frozenset(Action),
    Role.OPERATOR: frozenset({Action.SELF, Action.CATALOG_READ, Action.FLEET_READ,
                              Action.FLEET_OPERATE, Action.USAGE_READ, Action.TEAMS_READ,
                              Action.KEYS_READ}),
    Role.VIEWER: frozenset({Action.SELF, Action.CATALOG_READ, Action.FLEET_READ,
                            Action.USAGE_READ, Action.TEAMS_READ, Action.KEYS_READ}),
    Role.TEAM_ADMIN: frozenset({Action.SELF, Action.CATALOG_READ, Action.USAGE_READ,
                                Action.TEAMS_READ, Action.KEYS_READ, Action.KEYS_WRITE}),
}

# Actions a team admin holds only over its own teams' keys and usage.
TEAM_SCOPED = frozenset({Action.USAGE_READ, Action.TEAMS_READ, Action.KEYS_READ,
                         Action.KEYS_WRITE})

# Each admin route, by its name, to the one action it performs.
ROUTE_ACTIONS: dict[str, Action] = {
    "whoami": Action.SELF,
    "list_models": Action.CATALOG_READ,
    "get_model": Action.CATALOG_READ,
    **dict.fromkeys(
        ("get_summary", "list_nodes", "get_node", "list_replicas", "get_replica", "get_plan",
         "list_events", "list_gateways", "list_addresses"),
        Action.FLEET_READ),
    **dict.fromkeys(
        ("cordon", "uncordon", "drain_node", "pin_fabrics", "unpin_fabrics", "delete_node",
         "drain_replica", "put_model", "delete_model", "unpark", "apply", "what_if"),
        Action.FLEET_OPERATE),
    "usage": Action.USAGE_READ,
    "usage_report": Action.USAGE_READ,
    "list_teams": Action.TEAMS_READ,
    "get_team": Action.TEAMS_READ,
    "create_team": Action.TEAMS_WRITE,
    "update_team": Action.TEAMS_WRITE,
    "delete_team": Action.TEAMS_WRITE,
    "list_keys": Action.KEYS_READ,
    "create_key": Action.KEYS_WRITE,
    "update_key": Action.KEYS_WRITE,
    "revoke_key": Action.KEYS_WRITE,
    **dict.fromkeys(
        ("approve_node", "free_address", "rotate_join_token", "rotate_admin_token",
         "rotate_gateway_token", "list_join_tokens", "create_join_token", "revoke_join_token"),
        Action.TRUST),
}

# Who is asked for, in a refusal, per action: the message says what to do.
_HOLDERS = {action: ", ".join(r.value for r in Role if action in GRANTS[r]) for action in Action}


def route_action(route_name: str) -> Action:
    """The action a route performs; a route nobody classified is a trust action."""
    return ROUTE_ACTIONS.get(route_name, Action.TRUST)


@dataclass(frozen=True)
class Principal:
    """The person or program behind an admin request, as the control plane knows it.

    ``teams`` are the teams this principal is team admin of; they bound the
    team-scoped actions only when no fleet-wide role grants the action.
    """

    subject: str
    roles: frozenset[Role]
    teams: frozenset[str] = frozenset()
    via: str = "admin-token"
    name: str = ""

    def may(self, action: Action) -> bool:
        return any(action in GRANTS[role] for role in self.roles)

    def team_scope(self, action: Action) -> frozenset[str] | None:
        """None when the action covers the whole fleet, else the teams it is bounded to."""
        fleet_wide = any(action in GRANTS[role] for role in self.roles
                         if role is not Role.TEAM_ADMIN)
        if fleet_wide or action not in TEAM_SCOPED:
            return None
        return self.teams

    def require(self, action: Action, what: str) -> None:
        if self.may(action):
            return
        held = ", ".join(sorted(r.value for r in self.roles)) or "none"
        raise ForbiddenError(
            f"{what} needs {action.value}, which roles {_HOLDERS[action]} have;"
            f" {self.name or self.subject} has role {held}"
        )


ADMIN_TOKEN = Principal(subject="admin-token", roles=frozenset({Role.ADMIN}),
                        via="admin-token", name="the admin token")
