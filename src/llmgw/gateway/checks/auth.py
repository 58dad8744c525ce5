"""API keys on the request path: lookup by hash, allowed models (the key's and its team's), expiry.

The key table is rebuilt once per config version. Limits (RPM, TPM, quotas,
budgets) are the key's and its team's, counted fleet-wide by
llmgw.gateway.tenancy from this table's records.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

from llmgw import wire
from llmgw.gateway.replies import ApiError


def _has_limits(limits: wire.TenantLimits) -> bool:
    return any(limits.limit_of(kind) is not None for kind in wire.LIMIT_KINDS)


class KeyRecord:
    """One key as the request path needs it."""

    __slots__ = ("allowed", "expires_at", "key_id", "limits", "rank", "revoked", "team",
                 "team_allowed", "team_limited", "tenant", "weight")  # fmt: skip

    def __init__(self, info: wire.ApiKeyInfo, team: wire.TeamInfo | None = None) -> None:
        self.key_id = info.key_id
        self.revoked = info.revoked
        self.expires_at = info.expires_at
        self.allowed: frozenset[str] | None = frozenset(info.models) if info.models else None
        # None: no limit of its own (the team's may still hold).
        self.limits: wire.TenantLimits | None = info if _has_limits(info) else None
        self.team = team
        self.team_allowed: frozenset[str] | None = (
            frozenset(team.models) if team is not None and team.models else None)
        self.team_limited = team is not None and _has_limits(team)
        # Its place in a saturated model's hold queue (llmgw.gateway.admission):
        # the class's rank (0 first), and who it shares its class with fairly
        # and at what weight: its team, or the key itself for a key of none.
        self.rank = _RANKS[info.priority or (team.priority if team is not None else None)
                           or "standard"]
        self.tenant = f"team:{team.team_id}" if team is not None else f"key:{info.key_id}"
        self.weight = team.weight if team is not None else 1.0

    def may_use(self, route: wire.ModelRoute) -> bool:
        return _allows(self.allowed, route) and _allows(self.team_allowed, route)


def _allows(allowed: frozenset[str] | None, route: wire.ModelRoute) -> bool:
    if allowed is None or route.name in allowed:
        return True
    return any(alias in allowed for alias in route.aliases)


@dataclass(frozen=True, slots=True)
class Refusal:
    status: int
    code: str
    kind: str
    message: str
    retry_after_s: float | None = None

    def error(self) -> ApiError:
        """The refusal as the client gets it (OpenAI's shape)."""
        return ApiError(self.status, self.message, kind=self.kind, code=self.code,
                        retry_after=self.retry_after_s)  # fmt: skip


_HEADER_CACHE = 10_000
_RANKS = {name: rank for rank, name in enumerate(wire.PRIORITY_CLASSES)}

ANONYMOUS = wire.ApiKeyInfo(key_id="anonymous", name="anonymous", secret_hash="")


class KeyTable:
    """Keys of one config version, by secret hash, each with its team."""

    def __init__(self, keys: Sequence[wire.ApiKeyInfo],
                 teams: Sequence[wire.TeamInfo] = ()) -> None:
        by_team = {team.team_id: team for team in teams}
        self.by_id: dict[str, KeyRecord] = {}
        self.by_hash: dict[str, KeyRecord] = {}
        for info in keys:
            # A key whose team is gone is refused every model rather than
            # let out from under the team's limits.
            team = by_team.get(info.team_id) if info.team_id else None
            record = KeyRecord(info, team)
            if info.team_id and team is None:
                record.allowed = frozenset()
            self.by_id[info.key_id] = record
            self.by_hash[info.secret_hash] = record
        self.anonymous = KeyRecord(ANONYMOUS)
        self.by_id[ANONYMOUS.key_id] = self.anonymous
        # Raw Authorization header -> key, for keys already seen in this
        # version: skips decoding and hashing on every request. Only valid keys
        # enter, so made-up keys cannot grow it; the bound covers the rest.
        self.by_header: dict[bytes, KeyRecord] = {}

    def lookup(self, secret: str) -> KeyRecord | None:
        return self.by_hash.get(hashlib.sha256(secret.encode("utf-8")).hexdigest())

    def remember(self, header: bytes, record: KeyRecord) -> None:
        if len(self.by_header) >= _HEADER_CACHE:
            self.by_header.clear()
        self.by_header[header] = record


def authenticate(keys: KeyTable, allow_anonymous: bool, raw: bytes | None) -> KeyRecord:
    """The key of a request's Authorization header (``raw``: its value, None: none sent)."""
    if raw is None:
        if allow_anonymous:
            return keys.anonymous
        raise ApiError(
            401,
            "You didn't provide an API key. Send it as 'Authorization: Bearer sk-llmgw-...'.",
            code="invalid_api_key",
        )
    record = keys.by_header.get(raw)
    if record is None:
        scheme, _, token = raw.decode("latin-1").partition(" ")
        token = token.strip()
        record = keys.lookup(token) if scheme.lower() == "bearer" and token else None
        if record is None:
            shown = f"{token[:8]}****{token[-4:]}" if len(token) > 16 else "****"
            raise ApiError(401, f"Incorrect API key provided: {shown}.", code="invalid_api_key")
        keys.remember(raw, record)
    refusal = authorize(record)
    if refusal is not None:
        raise refusal.error()
    return record


def authorize(record: KeyRecord) -> Refusal | None:
    """Checks that do not depend on the model: revoked, expired."""
    if record.revoked:
        return Refusal(401, "invalid_api_key", "invalid_request_error", "This API key was revoked.")
    if record.expires_at is not None and record.expires_at <= time.time():
        return Refusal(401, "invalid_api_key", "invalid_request_error", "This API key has expired.")
    return None
