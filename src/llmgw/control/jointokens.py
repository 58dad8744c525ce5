"""Join tokens: what a new agent presents, once, to register its node.

A join token that never expires and works any number of times is a standing
invitation: whoever copies it from a shell history, a provisioning script or
a journal can register nodes (and, with them, claim replicas and serve
weights) for as long as the fleet lives. So each token has an expiry (a
default TTL, set with ``llmgw serve --join-token-ttl``), may be limited to a
number of uses (one for a single machine), and can be revoked by id; only
its hash is stored.

The tokens live as one JSON document under the ``join_tokens`` setting: a
handful of rows that change only when an operator acts or a limited token is
used, and no schema migration for a list this small. A store written before
join tokens had ids holds a single hash under ``join_token_hash``; it is
taken in as token ``legacy`` with no expiry, and goes away with the first
rotation.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import orjson

from llmgw import secrets
from llmgw.errors import AuthError, NotFoundError, ValidationError

SETTING = "join_tokens"
LEGACY_SETTING = "join_token_hash"
# A day, as kubeadm's bootstrap tokens: long enough to provision a batch of
# machines from one token, short enough that a leaked one soon stops working.
DEFAULT_TTL_S = 24 * 3600.0
# Revoked and expired tokens are kept this long (for `ctl join-tokens`), then
# dropped so the document stays small.
KEEP_DEAD_S = 7 * 24 * 3600.0


@dataclass
class JoinToken:
    id: str
    hash: str
    created_at: float
    expires_at: float | None = None  # None: never
    max_uses: int | None = None  # None: any number
    uses: int = 0
    revoked: bool = False
    description: str = ""

    def refusal(self, now: float, *, retry: bool = False) -> str | None:
        """Why this token cannot register a node now, or None if it can."""
        if self.revoked:
            return f"join token {self.id} was revoked"
        if self.expires_at is not None and now >= self.expires_at:
            return f"join token {self.id} expired"
        if not retry and self.max_uses is not None and self.uses >= self.max_uses:
            return f"join token {self.id} was already used {self.uses} time(s)"
        return None

    def view(self, now: float) -> dict[str, Any]:
        """What an operator may see: everything but the hash."""
        out = asdict(self)
        del out["hash"]
        out["usable"] = self.refusal(now) is None
        return out


class JoinTokens:
    """The control plane's join tokens, in memory, with their JSON form."""

    def __init__(self, tokens: list[JoinToken] | None = None) -> None:
        self.tokens: dict[str, JoinToken] = {t.id: t for t in tokens or []}

    @classmethod
    def parse(cls, document: str | None, legacy_hash: str | None) -> JoinTokens:
        if document:
            return cls([JoinToken(**item) for item in orjson.loads(document)])
        if legacy_hash:
            return cls([JoinToken(id="legacy", hash=legacy_hash, created_at=0.0)])
        return cls()

    def dump(self) -> str:
        return orjson.dumps([asdict(t) for t in self.tokens.values()]).decode()

    def create(
        self, ttl_s: float | None, max_uses: int | None = None, description: str = ""
    ) -> tuple[JoinToken, str]:
        """A new token; its secret is returned here and never stored."""
        if ttl_s is not None and ttl_s <= 0:
            raise ValidationError("a join token's ttl must be > 0 seconds (or none)", field="ttl_s")
        if max_uses is not None and max_uses < 1:
            raise ValidationError("a join token's uses must be >= 1 (or none)", field="uses")
        now = time.time()
        self._drop_dead(now)
        secret = secrets.new_secret(secrets.JOIN_PREFIX)
        token = JoinToken(
            id=secrets.new_id(8),
            hash=secrets.hash_secret(secret),
            created_at=now,
            expires_at=None if ttl_s is None else now + ttl_s,
            max_uses=max_uses,
            description=description,
        )
        self.tokens[token.id] = token
        return token, secret

    def find(self, secret: str) -> JoinToken | None:
        return next((t for t in self.tokens.values() if secrets.matches(secret, t.hash)), None)

    def check(self, secret: str, now: float, *, retry: bool = False) -> JoinToken:
        """The token ``secret`` is, if it may register a node now; AuthError otherwise.

        ``retry``: the registration is a node's own agent registering again
        (its answer was lost), which a token used up by that very node's
        first registration must not refuse. The refusal names the token's id
        (never the secret), so an operator can tell an expired token from a
        mistyped one.
        """
        token = self.find(secret)
        if token is None:
            raise AuthError("invalid join token")
        why = token.refusal(now, retry=retry)
        if why is not None:
            raise AuthError(f"{why}; make a new one: llmgw ctl join-tokens create")
        return token

    def revoke(self, token_id: str) -> JoinToken:
        token = self.tokens.get(token_id)
        if token is None:
            raise NotFoundError(f"join token {token_id!r} does not exist")
        token.revoked = True
        return token

    def revoke_all(self) -> None:
        for token in self.tokens.values():
            token.revoked = True

    def _drop_dead(self, now: float) -> None:
        for token_id, token in list(self.tokens.items()):
            end = token.expires_at if token.expires_at is not None else token.created_at
            if token.refusal(now) is not None and now - end > KEEP_DEAD_S:
                del self.tokens[token_id]
