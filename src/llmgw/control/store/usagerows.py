"""The usage rows' operations: per key, model and minute, added by the gateways' batches
and read by the admin's usage reports and by quotas and budgets (part of the Store)."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

from llmgw.control.store import schema

Row = dict[str, Any]

# The counters usage_report sums, returned as ints whatever type the driver gives a SUM.
_USAGE_COUNTERS = frozenset(
    {"requests", "prompt_tokens", "completion_tokens", "cached_tokens", "errors"})
# Summed beside them, as a float: dollars at the catalog's prices.
_SPEND = "spend_usd"


class UsageRows:
    """The usage table's half of the Store, which gives it its connections."""

    is_sqlite: bool

    def _write(self, epoch: int | None) -> AbstractAsyncContextManager[AsyncConnection]:
        raise NotImplementedError  # the Store's: one fenced transaction

    async def _read(self, statement: Any) -> list[Row]:
        raise NotImplementedError  # the Store's

    async def add_usage(self, rows: Sequence[Row], *, epoch: int | None = None) -> None:
        """Add counts to the per-minute rows, creating them as needed."""
        if not rows:
            return
        counters = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "errors",
                    _SPEND)
        dialect_insert = sqlite.insert if self.is_sqlite else postgresql.insert
        async with self._write(epoch) as conn:
            for row in rows:
                stmt = dialect_insert(schema.usage).values(**row)
                stmt = stmt.on_conflict_do_update(
                    index_elements=["minute", "key_id", "model"],
                    set_={c: getattr(schema.usage.c, c) + stmt.excluded[c] for c in counters},
                )
                await conn.execute(stmt)

    async def query_usage(
        self, *, since: int = 0, key_id: str | None = None, model: str | None = None,
        team_id: str | None = None,
    ) -> list[Row]:
        stmt = select(schema.usage).where(schema.usage.c.minute >= since)
        if key_id:
            stmt = stmt.where(schema.usage.c.key_id == key_id)
        if team_id:
            stmt = stmt.where(schema.usage.c.team_id == team_id)
        if model:
            stmt = stmt.where(schema.usage.c.model == model)
        return await self._read(stmt.order_by(schema.usage.c.minute))

    async def usage_report(
        self, *, since: int, until: int, by: Sequence[str], key_id: str | None = None,
        model: str | None = None, team_id: str | None = None,
    ) -> list[Row]:
        """Usage summed per ``by`` (``key``, ``team``, ``model``, ``day``) over [since, until).

        Summed by the database: a month of per-minute rows of a busy fleet
        is millions of rows, too many to ship to Python to add up. A day is
        the first minute of its UTC day (``day_start``).
        """
        usage = schema.usage.c
        groups: list[Any] = []
        for dimension in by:
            if dimension == "day":
                # minute - minute % 86400: integer arithmetic that SQLite and
                # PostgreSQL both keep integral (``/`` would not on PostgreSQL).
                groups.append((usage.minute - usage.minute % 86400).label("day_start"))
            elif dimension == "key":
                groups.append(usage.key_id)
            elif dimension == "team":
                groups.append(usage.team_id)
            elif dimension == "model":
                groups.append(usage.model)
            else:
                raise ValueError(f"cannot group usage by {dimension!r}")
        counters = [func.sum(getattr(usage, c)).label(c) for c in sorted(_USAGE_COUNTERS)]
        counters.append(func.sum(usage.spend_usd).label(_SPEND))
        stmt = select(*groups, *counters).where(usage.minute >= since, usage.minute < until)
        if key_id:
            stmt = stmt.where(usage.key_id == key_id)
        if team_id:
            stmt = stmt.where(usage.team_id == team_id)
        if model:
            stmt = stmt.where(usage.model == model)
        stmt = stmt.group_by(*groups).order_by(*groups)
        return [{k: (int(v) if k in _USAGE_COUNTERS else float(v or 0) if k == _SPEND else v)
                 for k, v in row.items()}
                for row in await self._read(stmt)]

    async def consumed(self, *, since: int, key_id: str | None = None,
                       team_id: str | None = None) -> tuple[int, float]:
        """Tokens and dollars a key or a team used from minute ``since`` on (quotas, budgets)."""
        usage = schema.usage.c
        stmt = select(func.sum(usage.prompt_tokens + usage.completion_tokens).label("tokens"),
                      func.sum(usage.spend_usd).label("spend")).where(usage.minute >= since)
        stmt = stmt.where(usage.key_id == key_id) if key_id else stmt.where(
            usage.team_id == team_id)
        row = (await self._read(stmt))[0]
        return int(row["tokens"] or 0), float(row["spend"] or 0.0)

    async def prune_usage(self, *, before_minute: int, epoch: int | None = None) -> int:
        """Delete usage rows of minutes before ``before_minute`` (retention)."""
        async with self._write(epoch) as conn:
            result = await conn.execute(
                delete(schema.usage).where(schema.usage.c.minute < before_minute))
            return int(result.rowcount or 0)
