"""What the store holds before and after a fault, read straight from PostgreSQL.

Rows are compared by identity, not counted: a fault that lost one row while
another was written would look whole by count. Catalog entries and API keys
acknowledged by the admin API during the fault must be there afterwards too
(:class:`AdminWriter` makes them); events are the control plane's own
writes, so those present before the fault must still be there. Usage is
additive per (minute, key, model): what the gateway answered for the load's
key must be in the usage rows, less at most one flush interval's worth.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import psycopg

from chaoskit.admin import Admin


@dataclass(frozen=True)
class Rows:
    models: frozenset[str]
    keys: frozenset[str]
    events: frozenset[int]
    usage: Counter[str]  # key id -> requests counted

    @staticmethod
    def read(database_url: str, timeout_s: float = 60.0) -> Rows:
        """One consistent read (a failover may be under way: retried until it answers)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with psycopg.connect(database_url, connect_timeout=3) as conn, conn.transaction():
                    models = frozenset(r[0] for r in conn.execute("SELECT name FROM models"))
                    keys = frozenset(r[0] for r in conn.execute("SELECT id FROM api_keys"))
                    events = frozenset(r[0] for r in conn.execute("SELECT id FROM events"))
                    usage: Counter[str] = Counter()
                    for key_id, requests in conn.execute(
                        "SELECT key_id, SUM(requests) FROM usage GROUP BY key_id"
                    ):
                        usage[key_id] = int(requests)
                return Rows(models, keys, events, usage)
            except psycopg.Error:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)


@dataclass
class Lost:
    catalog: int
    keys: int
    events: int
    usage: int  # requests answered to the load's key and missing from usage
    usage_extra: int  # requests counted twice (a retried delivery)

    def as_json(self) -> dict[str, int]:
        return {"catalog": self.catalog, "keys": self.keys, "events": self.events,
                "usage": self.usage, "usage_extra": self.usage_extra}


def lost(before: Rows, after: Rows, writer: AdminWriter, key_id: str, answered: int) -> Lost:
    counted = after.usage[key_id] - before.usage[key_id]
    return Lost(
        catalog=len((before.models | set(writer.models)) - after.models),
        keys=len((before.keys | set(writer.keys)) - after.keys),
        events=len(before.events - after.events),
        usage=max(0, answered - counted),
        usage_extra=max(0, counted - answered),
    )


async def settled_usage(database_url: str, key_id: str, expected: int,
                        timeout_s: float = 20.0) -> Rows:
    """The rows once the gateway's last usage batch is in (or ``timeout_s`` passed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = await asyncio.to_thread(Rows.read, database_url)
        if rows.usage[key_id] >= expected or time.monotonic() > deadline:
            return rows
        await asyncio.sleep(0.5)


@dataclass
class AdminWriter:
    """Admin writes during a fault: a catalog entry every ``every_s``, an API key every fifth.

    The entries are on-demand models nobody asks for (nothing is started for
    them); whatever the API acknowledged is committed and must survive.
    """

    admin: Admin
    prefix: str
    every_s: float = 1.0
    models: list[str] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    refused: Counter[str] = field(default_factory=Counter)
    _task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        index = 0
        while True:
            index += 1
            name = f"{self.prefix}-{index}"
            try:
                if index % 5 == 0:
                    answer = await self.admin.call("POST", "/keys", {"name": name}, retry_s=0)
                    if answer.status_code == 201:
                        self.keys.append(answer.json()["key"]["key_id"])
                else:
                    spec = {"name": name, "engine": "sim", "min_replicas": 0, "max_replicas": 1}
                    answer = await self.admin.call("PUT", f"/models/{name}", spec, retry_s=0)
                    if answer.status_code == 200:
                        self.models.append(name)
                if answer.status_code not in (200, 201):
                    self.refused[str(answer.status_code)] += 1
            except httpx.HTTPError as exc:
                self.refused[type(exc).__name__] += 1
            await asyncio.sleep(self.every_s)

    async def clean_up(self) -> None:
        """Remove the entries it made, so the catalog does not grow fault after fault."""
        for name in self.models:
            await self.admin.call("DELETE", f"/models/{name}", None)
