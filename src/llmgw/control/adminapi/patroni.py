"""The store's cluster members, as Patroni's REST API reports them.

When the store is a replicated PostgreSQL run by Patroni, the first thing an
operator needs during an incident is which member leads and how far the
others are behind; without it a failover looks like the control plane
hanging. Patroni answers that on ``GET /cluster`` (DESIGN.md §8,
research/store-sched.md §1.1). Debian's 3.0.2 and PyPI's 4.x differ slightly
(replica ``state`` ``running`` vs ``streaming``, extra ``receive_*`` and
``replay_*`` fields, ``quorum_standby``), so the parser reads only the fields
both have and tolerates the rest.

The members are cached briefly and refreshed in the background: Patroni only
updates its lag figures once per HA loop (10 s by default), and the summary
must not wait on a Patroni that has stopped answering.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
import orjson
from pydantic import BaseModel

PATRONI_URL_ENV = "LLMGW_PATRONI_URL"

# Unknown lag: a replica that is restarting ("unknown" in Patroni's answer),
# or a non-leader whose lag Patroni left out. Never 0, which would claim the
# member is caught up.
LAG_UNKNOWN = -1
# Roles that lead: the leader has no lag fields and is by definition 0 behind.
# "master" and "primary" are what older and newer Patronis call it elsewhere
# in their API; accepting them here costs nothing.
LEADER_ROLES = frozenset({"leader", "standby_leader", "master", "primary"})

# Long enough for a loaded Patroni, short enough that the first summary after
# a start does not stall when Patroni is black-holed.
FETCH_TIMEOUT_S = 2.0
# Patroni's own figures move once per HA loop; re-reading more often than
# this only adds load on the member that is already in trouble.
CACHE_TTL_S = 5.0


class StoreMember(BaseModel):
    """One member of a replicated store, as its Patroni reports it."""

    name: str
    host: str
    role: str
    state: str
    # Bytes behind the leader; -1 unknown, 0 for the leader.
    lag: int


@dataclass(frozen=True, slots=True)
class StoreStatus:
    """The members, or why they could not be read; both empty for a single database."""

    members: list[StoreMember]
    error: str | None = None


class PatroniFormatError(ValueError):
    """An answer from Patroni that is not a ``/cluster`` document."""


def patroni_urls_from_env() -> list[str]:
    """``LLMGW_PATRONI_URL``: one URL, or several separated by commas (tried in order)."""
    raw = os.environ.get(PATRONI_URL_ENV, "")
    return [u.strip().rstrip("/") for u in raw.split(",") if u.strip()]


def _lag(member: dict[str, object], role: str) -> int:
    value = member.get("lag")
    if value is None:
        return 0 if role in LEADER_ROLES else LAG_UNKNOWN
    if isinstance(value, bool):  # bool is an int in Python; it is no byte count
        return LAG_UNKNOWN
    if isinstance(value, int):
        return max(0, value)
    if isinstance(value, float):
        return max(0, int(value))
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return LAG_UNKNOWN  # "unknown", or anything else Patroni may invent


def _text(member: dict[str, object], key: str) -> str:
    value = member.get(key)
    return value if isinstance(value, str) else ("" if value is None else str(value))


def parse_cluster(document: object) -> list[StoreMember]:
    """Members of a ``GET /cluster`` answer (Patroni 3.x or 4.x), sorted by name."""
    if not isinstance(document, dict):
        raise PatroniFormatError("answer is not a JSON object")
    raw_members = document.get("members")
    if not isinstance(raw_members, list):
        raise PatroniFormatError("answer has no 'members' list")
    members: list[StoreMember] = []
    for index, item in enumerate(raw_members):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise PatroniFormatError(f"member {index} has no name")
        role = _text(item, "role")
        members.append(
            StoreMember(
                name=item["name"],
                host=_text(item, "host"),
                role=role,
                state=_text(item, "state"),
                lag=_lag(item, role),
            )
        )
    return sorted(members, key=lambda m: m.name)


async def fetch_members(urls: Sequence[str], *, limit_s: float = FETCH_TIMEOUT_S) -> StoreStatus:
    """Ask each Patroni in turn; the first good answer wins, else all the errors."""
    if not urls:
        return StoreStatus(members=[])
    errors: list[str] = []
    client_timeout = aiohttp.ClientTimeout(total=limit_s)
    async with aiohttp.ClientSession(timeout=client_timeout) as session:
        for base in urls:
            url = f"{base.rstrip('/')}/cluster"
            try:
                async with session.get(url) as response:
                    body = await response.read()
                    if response.status != 200:
                        errors.append(f"{url}: HTTP {response.status}")
                        continue
                return StoreStatus(members=parse_cluster(orjson.loads(body)))
            except TimeoutError:
                errors.append(f"{url}: no answer within {limit_s:g} s")
            except aiohttp.ClientError as exc:
                errors.append(f"{url}: {exc or type(exc).__name__}")
            except orjson.JSONDecodeError:
                errors.append(f"{url}: answer is not JSON")
            except PatroniFormatError as exc:
                errors.append(f"{url}: {exc}")
    return StoreStatus(members=[], error="cannot read the store's members from Patroni: "
                       + "; ".join(errors))


class PatroniReader:
    """Cached members: stale-while-revalidate, so a dead Patroni costs one wait, once."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        ttl_s: float = CACHE_TTL_S,
        timeout_s: float = FETCH_TIMEOUT_S,
    ) -> None:
        self.urls = list(urls)
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self._value: StoreStatus | None = None
        self._fetched_at = 0.0
        self._refresh: asyncio.Task[None] | None = None
        self._first = asyncio.Lock()

    async def status(self) -> StoreStatus:
        if not self.urls:
            return StoreStatus(members=[])
        if self._value is None:
            # Nothing to show yet: the first caller waits (bounded by the
            # timeout), the ones arriving meanwhile share its answer.
            async with self._first:
                if self._value is None:
                    await self._fetch()
        elif time.monotonic() - self._fetched_at > self.ttl_s and (
            self._refresh is None or self._refresh.done()
        ):
            self._refresh = asyncio.create_task(self._fetch(), name="patroni-refresh")
        return self._value or StoreStatus(members=[], error="Patroni was not read yet")

    def cached(self) -> StoreStatus | None:
        """The last answer without waiting (None before the first), refreshed behind.

        For /metrics, which is rendered synchronously: it shows what the last
        read found (at most ``ttl_s`` old while Patroni answers) and starts
        the next read when that is stale, never waiting on it.
        """
        if not self.urls:
            return StoreStatus(members=[])
        stale = self._value is None or time.monotonic() - self._fetched_at > self.ttl_s
        if stale and (self._refresh is None or self._refresh.done()):
            self._refresh = asyncio.get_running_loop().create_task(
                self._fetch(), name="patroni-refresh")
        return self._value

    async def _fetch(self) -> None:
        try:
            value = await fetch_members(self.urls, limit_s=self.timeout_s)
        except Exception as exc:  # a bug here must not take the summary down
            value = StoreStatus(members=[], error=f"cannot read Patroni: {exc}")
        self._value, self._fetched_at = value, time.monotonic()

    async def close(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._refresh
