"""Teams: made, changed, listed and deleted here; the gateways get them with the keys.

A team bounds its keys: the models a key may use are those both allow, and
a request needs room under the key's limits and the team's. Its name is
unique (people and the console refer to teams by it); its id is what keys
and usage rows carry, so a rename loses no history.
"""

from __future__ import annotations

import time

from llmgw import secrets
from llmgw.control.rows import LIMIT_FIELDS, team_from_row, team_row
from llmgw.control.services.core import Core
from llmgw.errors import NotFoundError, ValidationError
from llmgw.wire import TeamInfo


class Teams:
    def __init__(self, core: Core) -> None:
        self.core = core
        self._teams: dict[str, TeamInfo] = {}

    async def load(self) -> None:
        self._teams = {}
        for row in await self.core.store.list_teams():
            team = team_from_row(row)
            self._teams[team.team_id] = team

    def all(self) -> list[TeamInfo]:
        return sorted(self._teams.values(), key=lambda t: t.name)

    def get(self, team_id: str) -> TeamInfo:
        """By id or by name."""
        team = self._teams.get(team_id) or next(
            (t for t in self._teams.values() if t.name == team_id), None)
        if team is None:
            raise NotFoundError(f"team {team_id!r} does not exist")
        return team

    def find(self, team_id: str) -> TeamInfo | None:
        """By id only, None when there is none (the request path's lookups)."""
        return self._teams.get(team_id)

    async def create(self, team: TeamInfo) -> TeamInfo:
        core = self.core
        core.require_leader()
        self._check_name(team.name, None)
        made = team.model_copy(update={"team_id": secrets.new_id(12)})
        await core.writes.add_team(team_row(made, time.time()))
        self._teams[made.team_id] = made
        await core.event("team", made.team_id, f"team {made.name} ({made.team_id}) created")
        await core.state.bump_routing()
        return made

    async def update(self, team_id: str, changes: dict[str, object]) -> TeamInfo:
        """Set the named fields (name, models, limits); the others stay."""
        core = self.core
        core.require_leader()
        current = self.get(team_id)
        if "name" in changes:
            self._check_name(str(changes["name"]), current.team_id)
        updated = TeamInfo.model_validate({**current.model_dump(), **changes})
        values = {name: getattr(updated, name) for name in changes
                  if name in LIMIT_FIELDS or name in ("name", "models", "weight")}
        if not values:
            return current  # nothing to change
        if not await core.writes.update_team(current.team_id, values):
            raise NotFoundError(f"team {team_id!r} does not exist")
        self._teams[current.team_id] = updated
        await core.event("team", current.team_id, f"team {updated.name} changed: "
                         + ", ".join(sorted(values)))
        await core.state.bump_routing()
        return updated

    async def delete(self, team_id: str, live_keys: int) -> TeamInfo:
        """Delete a team that no live key belongs to (``live_keys``: how many do)."""
        core = self.core
        core.require_leader()
        team = self.get(team_id)
        if live_keys:
            raise ValidationError(
                f"team {team.name} still has {live_keys} live key(s): revoke them or move"
                " them to another team first")
        await core.writes.delete_team(team.team_id)
        del self._teams[team.team_id]
        await core.event("team", team.team_id, f"team {team.name} deleted")
        await core.state.bump_routing()
        return team

    def _check_name(self, name: str, own_id: str | None) -> None:
        if not name.strip():
            raise ValidationError("a team needs a name")
        clash = next((t for t in self._teams.values() if t.name == name), None)
        if clash is not None and clash.team_id != own_id:
            raise ValidationError(f"a team named {name!r} exists already ({clash.team_id})")
