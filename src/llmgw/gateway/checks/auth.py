"""API keys on the request path: lookup by hash, allowed models, expiry, rpm/tpm.

The key table is rebuilt once per config version; the limiter state of a key
(its buckets) is carried from one table to the next by key id, so a config
update does not hand every key a fresh minute of requests.

Limits are token buckets rather than per-minute windows: a fixed window lets a
client send twice its rpm across a minute boundary, and a bucket costs the same
two float operations. Tokens are only known after the answer, so the tpm bucket
admits a request while it is not in debt and is charged afterwards; a large
answer can push it negative, which delays the next requests accordingly.

A gateway served by N worker processes (``llmgw gateway --workers N``) gives
each worker 1/N of every key's limits (``share``): the workers hold no state
in common, and a client's connections land on any of them, so a key's
requests across all of them stay within its limit, whatever the spread. The
price is that a client whose connections all land on one worker gets 1/N of
its limit; refusals still name the key's whole limit.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

from llmgw import wire
from llmgw.gateway.replies import ApiError


class Bucket:
    """A token bucket holding at most ``capacity``, refilled at capacity per minute.

    ``share``: the bucket holds 1/share of ``per_minute`` (one of that many
    gateway workers); ``limit`` stays the key's whole limit, for messages.
    """

    __slots__ = ("capacity", "level", "limit", "rate", "stamp")

    def __init__(self, per_minute: int, share: int = 1) -> None:
        self.limit = per_minute
        self.capacity = per_minute / share
        self.rate = self.capacity / 60.0
        self.level = self.capacity
        self.stamp = time.monotonic()

    def resize(self, per_minute: int, share: int = 1) -> None:
        self.limit = per_minute
        self.capacity = per_minute / share
        self.rate = self.capacity / 60.0
        self.level = min(self.level, self.capacity)

    def _refill(self, now: float) -> None:
        level = self.level + (now - self.stamp) * self.rate
        self.level = level if level < self.capacity else self.capacity
        self.stamp = now

    def take(self, amount: float, now: float) -> float:
        """Take ``amount`` if available: 0.0, else the seconds until it would be."""
        self._refill(now)
        if self.level >= amount:
            self.level -= amount
            return 0.0
        return (amount - self.level) / self.rate if self.rate > 0 else 60.0

    def admit(self, now: float) -> float:
        """0.0 while not in debt (the charge comes later), else seconds until out of debt."""
        self._refill(now)
        if self.level > 0:
            return 0.0
        return (1.0 - self.level) / self.rate if self.rate > 0 else 60.0

    def charge(self, amount: float) -> None:
        self.level -= amount


class KeyRecord:
    """One key as the request path needs it."""

    __slots__ = ("allowed", "expires_at", "key_id", "revoked", "rpm", "tpm")

    def __init__(self, info: wire.ApiKeyInfo, previous: KeyRecord | None, share: int = 1) -> None:
        self.key_id = info.key_id
        self.revoked = info.revoked
        self.expires_at = info.expires_at
        self.allowed: frozenset[str] | None = frozenset(info.models) if info.models else None
        self.rpm: Bucket | None = _carry(info.rpm, previous.rpm if previous else None, share)
        self.tpm: Bucket | None = _carry(info.tpm, previous.tpm if previous else None, share)

    def may_use(self, route: wire.ModelRoute) -> bool:
        allowed = self.allowed
        if allowed is None or route.name in allowed:
            return True
        return any(alias in allowed for alias in route.aliases)


def _carry(limit: int | None, previous: Bucket | None, share: int) -> Bucket | None:
    if limit is None or limit <= 0:
        return None
    if previous is None:
        return Bucket(limit, share)
    previous.resize(limit, share)
    return previous


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

ANONYMOUS = wire.ApiKeyInfo(key_id="anonymous", name="anonymous", secret_hash="")


class KeyTable:
    """Keys of one config version, by secret hash (limits: 1/``share`` each, see above)."""

    def __init__(
        self, keys: list[wire.ApiKeyInfo], previous: KeyTable | None, share: int = 1
    ) -> None:
        before = previous.by_id if previous else {}
        self.by_id: dict[str, KeyRecord] = {}
        self.by_hash: dict[str, KeyRecord] = {}
        for info in keys:
            record = KeyRecord(info, before.get(info.key_id), share)
            self.by_id[info.key_id] = record
            self.by_hash[info.secret_hash] = record
        self.anonymous = KeyRecord(ANONYMOUS, before.get(ANONYMOUS.key_id), share)
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


def limit(record: KeyRecord, now: float) -> Refusal | None:
    """Per-minute limits; takes one request from the rpm bucket when admitted."""
    tpm = record.tpm
    if tpm is not None:
        wait = tpm.admit(now)
        if wait:
            return Refusal(
                429,
                "rate_limit_exceeded",
                "tokens",
                f"Rate limit reached on tokens per minute (TPM): limit {tpm.limit}."
                f" Please try again in {wait:.1f}s.",
                wait,
            )
    rpm = record.rpm
    if rpm is not None:
        wait = rpm.take(1.0, now)
        if wait:
            return Refusal(
                429,
                "rate_limit_exceeded",
                "requests",
                f"Rate limit reached on requests per minute (RPM): limit {rpm.limit}."
                f" Please try again in {wait:.1f}s.",
                wait,
            )
    return None
