"""The fleet's shared secrets: the admin and gateway tokens and the join tokens.

Only their hashes are stored; a plaintext exists in the answer that made it
and nowhere else. Node tokens are the nodes' (services.nodes), API keys
their own resource (services.keys).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from llmgw import secrets
from llmgw.control.jointokens import DEFAULT_TTL_S as DEFAULT_JOIN_TTL_S
from llmgw.control.jointokens import SETTING as JOIN_TOKENS
from llmgw.control.jointokens import JoinToken, JoinTokens
from llmgw.control.services.core import Core
from llmgw.control.services.keys import ApiKeys

ADMIN_HASH = "admin_token_hash"
JOIN_HASH = "join_token_hash"
GATEWAY_HASH = "gateway_token_hash"


@dataclass
class NewCredentials:
    """Secrets created on first start; shown once, stored only as hashes."""

    admin_token: str | None = None
    join_token: str | None = None
    gateway_token: str | None = None
    api_key: str | None = None
    api_key_id: str | None = None


class Credentials:
    def __init__(self, core: Core, keys: ApiKeys) -> None:
        self.core = core
        self.keys = keys
        self._admin_hash: str | None = None
        self._gateway_hash: str | None = None
        # Gateway tokens this process made for gateways it runs itself
        # (``llmgw up --gateway-workers``): held in memory only, so they stop
        # working when the process stops and no operator ever handles them.
        self._process_gateway_hashes: set[str] = set()
        self.join_tokens = JoinTokens()
        # The expiry of join tokens made without one (the first one, rotations).
        self.join_token_ttl_s: float | None = DEFAULT_JOIN_TTL_S

    async def load(self) -> None:
        store = self.core.store
        self._admin_hash = await store.get_setting(ADMIN_HASH)
        self._gateway_hash = await store.get_setting(GATEWAY_HASH)
        await self._load_join_tokens()

    async def ensure(self, *, first_api_key: bool = True) -> NewCredentials:
        """Create whatever credential is missing; return the new plaintexts."""
        store = self.core.store
        created = NewCredentials()
        for key, prefix, attr in (
            (ADMIN_HASH, secrets.ADMIN_PREFIX, "admin_token"),
            (GATEWAY_HASH, secrets.GATEWAY_PREFIX, "gateway_token"),
        ):
            secret = secrets.new_secret(prefix)
            if await store.set_setting_if_absent(key, secrets.hash_secret(secret)):
                setattr(created, attr, secret)
        if first_api_key and not await store.list_api_keys():
            info, secret = await self.keys.create(name="first key")
            created.api_key, created.api_key_id = secret, info.key_id
        self._admin_hash = await store.get_setting(ADMIN_HASH)
        await self._load_join_tokens()
        if not self.join_tokens.tokens:
            fresh = JoinTokens()
            _, secret = fresh.create(self.join_token_ttl_s, description="first")
            if await store.set_setting_if_absent(JOIN_TOKENS, fresh.dump()):
                created.join_token = secret
            await self._load_join_tokens()
        self._gateway_hash = await store.get_setting(GATEWAY_HASH)
        return created

    async def _load_join_tokens(self) -> None:
        store = self.core.store
        self.join_tokens = JoinTokens.parse(
            await store.get_setting(JOIN_TOKENS), await store.get_setting(JOIN_HASH)
        )

    async def save_join_tokens(self) -> None:
        await self.core.writes.set_setting(JOIN_TOKENS, self.join_tokens.dump())

    async def rotate_join_token(self) -> str:
        """Revoke every join token and make one new one (default expiry)."""
        self.core.require_leader()
        self.join_tokens.revoke_all()
        token, secret = self.join_tokens.create(self.join_token_ttl_s, description="rotated")
        await self.save_join_tokens()
        await self.core.event("credentials", "join-token",
                              f"join tokens rotated: all revoked, {token.id} made")
        return secret

    async def rotate_token(self, kind: Literal["admin", "gateway"]) -> str:
        """A new admin or gateway token; the old one stops working at once.

        At once on this instance; a standby reads the new hash with its next
        refresh (every few seconds). Gateways holding the old gateway token
        keep serving the routes they know and fail to sync until given the
        new one, so rotate it with the new token ready to hand out.
        """
        self.core.require_leader()
        prefix, setting = ((secrets.ADMIN_PREFIX, ADMIN_HASH) if kind == "admin"
                           else (secrets.GATEWAY_PREFIX, GATEWAY_HASH))
        secret = secrets.new_secret(prefix)
        digest = secrets.hash_secret(secret)
        await self.core.writes.set_setting(setting, digest)
        if kind == "admin":
            self._admin_hash = digest
        else:
            self._gateway_hash = digest
        await self.core.event("credentials", f"{kind}-token", f"{kind} token rotated")
        return secret

    async def create_join_token(
        self, *, ttl_s: float | None, max_uses: int | None = None, description: str = ""
    ) -> tuple[JoinToken, str]:
        """One more join token; the secret is in the answer and nowhere else."""
        self.core.require_leader()
        token, secret = self.join_tokens.create(ttl_s, max_uses, description)
        await self.save_join_tokens()
        await self.core.event("credentials", "join-token", f"join token {token.id} made")
        return token, secret

    async def revoke_join_token(self, token_id: str) -> JoinToken:
        self.core.require_leader()
        token = self.join_tokens.revoke(token_id)
        await self.save_join_tokens()
        await self.core.event("credentials", "join-token", f"join token {token_id} revoked")
        return token

    def is_admin(self, token: str | None) -> bool:
        return bool(token and self._admin_hash and secrets.matches(token, self._admin_hash))

    def process_gateway_token(self) -> str:
        """A gateway token good only while this process runs (never stored)."""
        secret = secrets.new_secret(secrets.GATEWAY_PREFIX)
        self._process_gateway_hashes.add(secrets.hash_secret(secret))
        return secret

    def is_gateway(self, token: str | None) -> bool:
        # The admin token may act as a gateway too: an operator running a
        # standalone gateway by hand should not need a second secret.
        if token and self._gateway_hash and secrets.matches(token, self._gateway_hash):
            return True
        if token and self._process_gateway_hashes and (
            secrets.hash_secret(token) in self._process_gateway_hashes
        ):
            return True
        return self.is_admin(token)
