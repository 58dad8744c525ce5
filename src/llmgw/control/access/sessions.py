"""Console sessions and logins in flight, kept server-side under the hash of their cookie.

The browser holds only a random 256-bit value; the control plane keeps its
SHA-256 (llmgw.secrets), so a heap dump or a log line with the table shows
no cookie that would work. Everything a session means (who, which roles,
until when) stays here: a cookie cannot be edited into an admin's, and
signing out or expiry ends it on the server, not just in the browser.

Kept in the process's memory: a restart or a move to another control-plane
instance signs everyone out (they sign in again through the provider, a
redirect away). The tables are bounded; past the bound the oldest entry
goes, so a script hitting the login route cannot grow the heap.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

from llmgw import secrets
from llmgw.control.access.oidc import LoginRequest
from llmgw.control.access.roles import Principal

T = TypeVar("T")

MAX_SESSIONS = 10_000
MAX_PENDING_LOGINS = 1_000
# Long enough to type a password and answer a second factor, short enough
# that an abandoned login's state is not worth stealing.
LOGIN_TTL_S = 600.0


class SecretTable(Generic[T]):
    """Values under the hash of a fresh secret; each entry expires, the table is bounded."""

    def __init__(self, ttl_s: float, limit: int, clock: Callable[[], float] = time.time) -> None:
        self.ttl_s = ttl_s
        self.limit = limit
        self.clock = clock
        self._rows: OrderedDict[str, tuple[float, T]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, value: T) -> tuple[str, float]:
        """A new secret for ``value`` and when it expires; the secret is not kept."""
        now = self.clock()
        self._sweep(now)
        while len(self._rows) >= self.limit:
            self._rows.popitem(last=False)
        secret = secrets.new_secret("")
        expires = now + self.ttl_s
        self._rows[secrets.hash_secret(secret)] = (expires, value)
        return secret, expires

    def get(self, secret: str | None) -> T | None:
        if not secret:
            return None
        key = secrets.hash_secret(secret)
        row = self._rows.get(key)
        if row is None:
            return None
        if row[0] <= self.clock():
            del self._rows[key]
            return None
        return row[1]

    def pop(self, secret: str | None) -> T | None:
        value = self.get(secret)
        if secret:
            self._rows.pop(secrets.hash_secret(secret), None)
        return value

    def _sweep(self, now: float) -> None:
        # Insertion order is expiry order (one TTL per table): stop at the first live one.
        while self._rows:
            key, (expires, _) = next(iter(self._rows.items()))
            if expires > now:
                return
            del self._rows[key]


class SessionStore:
    """The console's sessions and the logins waiting for the provider's answer."""

    def __init__(self, session_ttl_s: float, clock: Callable[[], float] = time.time) -> None:
        self.sessions: SecretTable[Principal] = SecretTable(session_ttl_s, MAX_SESSIONS, clock)
        self.logins: SecretTable[LoginRequest] = SecretTable(LOGIN_TTL_S, MAX_PENDING_LOGINS,
                                                             clock)
