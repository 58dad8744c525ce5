"""API keys: made, changed, listed and revoked here; the gateways get them with the routing
table."""

from __future__ import annotations

import time

from llmgw import secrets
from llmgw.control.rows import LIMIT_FIELDS, key_from_row, limits_row
from llmgw.control.services.core import Core
from llmgw.control.services.teams import Teams
from llmgw.errors import NotFoundError
from llmgw.wire import ApiKeyInfo, TenantLimits

# What a key's update may change; its secret, name and expiry stay as made.
KEY_CHANGES = frozenset({"team_id", "models", *LIMIT_FIELDS})


class ApiKeys:
    def __init__(self, core: Core, teams: Teams) -> None:
        self.core = core
        self.teams = teams
        self._keys: dict[str, ApiKeyInfo] = {}

    async def load(self) -> None:
        self._keys = {}
        for row in await self.core.store.list_api_keys():
            info = key_from_row(row)
            self._keys[info.key_id] = info

    async def create(
        self,
        *,
        name: str = "",
        models: list[str] | None = None,
        expires_at: float | None = None,
        rpm: int | None = None,
        tpm: int | None = None,
        team_id: str | None = None,
        limits: TenantLimits | None = None,
    ) -> tuple[ApiKeyInfo, str]:
        """A new key; ``limits`` (when given) are all its limits, else ``rpm``/``tpm``."""
        core = self.core
        core.require_leader()
        team = self.teams.get(team_id).team_id if team_id else None
        secret = secrets.new_secret(secrets.API_KEY_PREFIX)
        bounds = limits or TenantLimits(rpm=rpm, tpm=tpm)
        info = ApiKeyInfo(
            key_id=secrets.new_id(12),
            name=name,
            secret_hash=secrets.hash_secret(secret),
            models=list(models or []),
            expires_at=expires_at,
            team_id=team,
            **bounds.model_dump(),
        )
        await core.writes.add_api_key(
            {
                "id": info.key_id,
                "name": info.name,
                "secret_hash": info.secret_hash,
                "models": info.models,
                "expires_at": info.expires_at,
                **limits_row(info),
                "team_id": info.team_id,
                "revoked": False,
                "created_at": time.time(),
            }
        )
        self._keys[info.key_id] = info
        where = f" in team {team}" if team else ""
        await core.event("key", info.key_id, f"API key {info.key_id} ({name}) created{where}")
        await core.state.bump_routing()
        return info, secret

    def all(self) -> list[ApiKeyInfo]:
        return list(self._keys.values())

    def get(self, key_id: str) -> ApiKeyInfo:
        info = self._keys.get(key_id)
        if info is None:
            raise NotFoundError(f"API key {key_id!r} does not exist")
        return info

    def find(self, key_id: str) -> ApiKeyInfo | None:
        return self._keys.get(key_id)

    def live_in_team(self, team_id: str) -> int:
        return sum(1 for k in self._keys.values() if k.team_id == team_id and not k.revoked)

    async def update(self, key_id: str, changes: dict[str, object]) -> ApiKeyInfo:
        """Move a key to another team (None: the operator's) or change its models or limits."""
        core = self.core
        core.require_leader()
        current = self.get(key_id)
        changes = {k: v for k, v in changes.items() if k in KEY_CHANGES}
        if changes.get("team_id"):
            changes["team_id"] = self.teams.get(str(changes["team_id"])).team_id
        updated = ApiKeyInfo.model_validate({**current.model_dump(), **changes})
        values = {name: getattr(updated, name) for name in changes}
        if not values:
            return current  # nothing to change
        if not await core.writes.update_api_key(key_id, values):
            raise NotFoundError(f"API key {key_id!r} does not exist")
        self._keys[key_id] = updated
        await core.event("key", key_id, f"API key {key_id} changed: " + ", ".join(sorted(values)))
        await core.state.bump_routing()
        return updated

    async def revoke(self, key_id: str) -> None:
        core = self.core
        core.require_leader()
        if key_id not in self._keys or not await core.writes.revoke_api_key(key_id):
            raise NotFoundError(f"API key {key_id!r} does not exist")
        self._keys[key_id] = self._keys[key_id].model_copy(update={"revoked": True})
        await core.event("key", key_id, f"API key {key_id} revoked")
        await core.state.bump_routing()
