"""API keys: made, listed and revoked here; the gateways get them with the routing table."""

from __future__ import annotations

import time

from llmgw import secrets
from llmgw.control.rows import key_from_row
from llmgw.control.services.core import Core
from llmgw.errors import NotFoundError
from llmgw.wire import ApiKeyInfo


class ApiKeys:
    def __init__(self, core: Core) -> None:
        self.core = core
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
    ) -> tuple[ApiKeyInfo, str]:
        core = self.core
        core.require_leader()
        secret = secrets.new_secret(secrets.API_KEY_PREFIX)
        info = ApiKeyInfo(
            key_id=secrets.new_id(12),
            name=name,
            secret_hash=secrets.hash_secret(secret),
            models=list(models or []),
            expires_at=expires_at,
            rpm=rpm,
            tpm=tpm,
        )
        await core.writes.add_api_key(
            {
                "id": info.key_id,
                "name": info.name,
                "secret_hash": info.secret_hash,
                "models": info.models,
                "expires_at": info.expires_at,
                "rpm": info.rpm,
                "tpm": info.tpm,
                "revoked": False,
                "created_at": time.time(),
            }
        )
        self._keys[info.key_id] = info
        await core.event("key", info.key_id, f"API key {info.key_id} ({name}) created")
        await core.state.bump_routing()
        return info, secret

    def all(self) -> list[ApiKeyInfo]:
        return list(self._keys.values())

    async def revoke(self, key_id: str) -> None:
        core = self.core
        core.require_leader()
        if key_id not in self._keys or not await core.writes.revoke_api_key(key_id):
            raise NotFoundError(f"API key {key_id!r} does not exist")
        self._keys[key_id] = self._keys[key_id].model_copy(update={"revoked": True})
        await core.event("key", key_id, f"API key {key_id} revoked")
        await core.state.bump_routing()
