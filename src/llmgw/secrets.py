"""Credentials: how they are made, shown once, and stored only as hashes.

Five kinds, never interchangeable (each route accepts one kind): the admin
token (operators), the join token (a new agent registers once), node tokens (an
agent speaks for its own node only), gateway tokens (a standalone gateway
reads routes and writes usage) and API keys (clients of /v1). Agent keys are
made by the agent, not the control plane: a per-data-dir secret that lets an
agent whose registration answer was lost register its node again.

Secrets are 256 random bits, so a single SHA-256 is enough to store them:
slow password hashes protect guessable secrets, and these are not guessable;
a fast hash keeps the gateway's per-request key check cheap.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets as _random

ADMIN_PREFIX = "llmgw-admin-"
JOIN_PREFIX = "llmgw-join-"
NODE_PREFIX = "llmgw-node-"
GATEWAY_PREFIX = "llmgw-gw-"
API_KEY_PREFIX = "sk-llmgw-"
AGENT_KEY_PREFIX = "llmgw-agent-key-"


def new_secret(prefix: str) -> str:
    return prefix + _random.token_urlsafe(32)


def new_id(length: int = 12) -> str:
    return _random.token_hex(length // 2)


def hash_secret(secret: str) -> str:
    # surrogatepass: a str with lone surrogates (argv bytes that were not
    # UTF-8) hashes to what no real secret hashes to, instead of raising
    # UnicodeEncodeError out of a token check (found by bench/fuzz.py).
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def matches(secret: str, stored_hash: str) -> bool:
    return hmac.compare_digest(hash_secret(secret), stored_hash)


def bearer(header_value: str | None) -> str | None:
    """The token of an ``Authorization: Bearer …`` header, or None."""
    if not header_value:
        return None
    scheme, _, token = header_value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
