"""The store's operations: everything the control plane reads or writes.

The control plane works from memory and uses this module to make its state
durable: rows are written in batches inside one transaction, and nothing here
holds state between calls except the engine. Outside errors are turned into
StoreError once, here.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from sqlalchemy import Table, bindparam, delete, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError, OperationalError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from llmgw.control.store import schema
from llmgw.control.store.bulk import BulkWriter
from llmgw.control.store.db import create_engine, is_sqlite, normalise_url
from llmgw.control.store.migrate import upgrade_to_head
from llmgw.control.store.sqlitefile import check_sqlite_place
from llmgw.control.store.stats import WriteStats
from llmgw.control.store.usagerows import Row as Row
from llmgw.control.store.usagerows import UsageRows
from llmgw.errors import ConfigError, NotLeaderError, StoreError

EPOCH_KEY = "leader_epoch"
# The leader's advertised URL, written with the epoch it took (bump_epoch).
LEADER_URL_KEY = "leader_url"


class Store(UsageRows):
    def __init__(self, engine: AsyncEngine, url: str) -> None:
        self.engine = engine
        self.url = url
        self.is_sqlite = is_sqlite(url)
        self._upserts: dict[tuple[str, tuple[str, ...]], Any] = {}
        # The reconcile pass's rows, past SQLAlchemy's per-row work (bulk.py).
        self._bulk = BulkWriter()
        # Every write transaction, timed and counted (the control plane's /metrics).
        self.write_stats = WriteStats()

    # -- opening -----------------------------------------------------------

    @classmethod
    async def open(cls, url: str, *, migrate: bool = True, pool_size: int = 5) -> Store:
        """Connect, prove the store answers, and bring its schema to head.

        Any failure here is a configuration problem for a person to fix, so it
        becomes a one-line ConfigError naming the store.
        """
        url = normalise_url(url)
        where = _describe(url)
        if is_sqlite(url):
            check_sqlite_place(where)
        engine = create_engine(url, pool_size=pool_size)
        store = cls(engine, url)
        try:
            async with engine.connect() as conn:
                await conn.exec_driver_sql("SELECT 1")
            if migrate:
                await upgrade_to_head(engine)
        except (OperationalError, DBAPIError, OSError) as exc:
            await engine.dispose()
            raise ConfigError(f"cannot open the store at {where}: {_first_line(exc)}") from None
        return store

    async def close(self) -> None:
        await self.engine.dispose()

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncConnection]:
        """One write transaction (BEGIN IMMEDIATE on SQLite, see db.py).

        Every write passes here, so here it is timed and its failures counted
        (``write_stats``: the control plane's metrics).
        """
        started, outcome = time.perf_counter(), "aborted"
        try:
            async with self.engine.begin() as conn:
                yield conn
            outcome = "ok"
        except NotLeaderError:
            outcome = "stale_epoch"
            raise
        except SQLAlchemyError as exc:
            outcome = "error"
            raise StoreError(f"store write failed: {_first_line(exc)}") from exc
        finally:
            self.write_stats.record(time.perf_counter() - started, outcome)

    async def _read(self, statement: Any) -> list[Row]:
        try:
            async with self.engine.connect() as conn:
                result = await conn.execute(statement)
                rows = [dict(r._mapping) for r in result]
                await conn.rollback()
                return rows
        except SQLAlchemyError as exc:
            raise StoreError(f"store read failed: {_first_line(exc)}") from exc

    def _upsert_statement(self, table: Table, keys: Sequence[str]) -> Any:
        """INSERT ... ON CONFLICT DO UPDATE, executed with the rows as parameters.

        Rows go in as an executemany parameter list, not a multi-VALUES
        statement: compiling a VALUES clause of 2,000 rows took SQLAlchemy
        ~0.7 s, the same statement executed with a parameter list ~0.05 s.
        """
        cache_key = (table.name, tuple(keys))
        stmt = self._upserts.get(cache_key)
        if stmt is None:
            dialect_insert = sqlite.insert if self.is_sqlite else postgresql.insert
            base = dialect_insert(table)
            updates = {c.name: base.excluded[c.name] for c in table.columns if c.name not in keys}
            stmt = self._upserts[cache_key] = base.on_conflict_do_update(
                index_elements=list(keys), set_=updates
            )
        return stmt

    async def _execute_upsert(
        self, conn: AsyncConnection, table: Table, rows: Sequence[Row], keys: Sequence[str]
    ) -> None:
        if not rows:
            return
        # Callers pass whole rows (every column), so one compiled statement
        # serves the whole list and an update never resets a column it skipped.
        await conn.execute(self._upsert_statement(table, keys), list(rows))

    async def _update_by_id(
        self, table: Table, row_id: str, values: Row, epoch: int | None
    ) -> bool:
        """Set ``values`` (columns) on ``table``'s row ``row_id``; False: no such row."""
        async with self._write(epoch) as conn:
            result = await conn.execute(
                update(table).where(table.c.id == row_id).values(**values))
            return bool(result.rowcount)

    # -- settings and leader epoch -------------------------------------------

    async def get_setting(self, key: str) -> str | None:
        rows = await self._read(select(schema.settings.c.value).where(schema.settings.c.key == key))
        return rows[0]["value"] if rows else None

    async def set_setting(self, key: str, value: str, *, epoch: int | None = None) -> None:
        async with self._write(epoch) as conn:
            row = {"key": key, "value": value}
            await self._execute_upsert(conn, schema.settings, [row], ["key"])

    async def set_setting_if_absent(self, key: str, value: str) -> bool:
        """Write ``key`` only if nothing is there; True when this call wrote it."""
        async with self.transaction() as conn:
            existing = await conn.execute(
                select(schema.settings.c.value).where(schema.settings.c.key == key)
            )
            if existing.first() is not None:
                return False
            await conn.execute(schema.settings.insert().values(key=key, value=value))
            return True

    async def bump_epoch(self, leader_url: str | None = None) -> int:
        """A new leader takes the next epoch; writes under an older one fail.

        ``leader_url`` is recorded in the same transaction (empty when not
        given), so the URL that standbys hand out never belongs to an older
        epoch than the current one.
        """
        async with self.transaction() as conn:
            current = await self._epoch(conn, lock=True)
            new = current + 1
            rows = [{"key": EPOCH_KEY, "value": str(new)},
                    {"key": LEADER_URL_KEY, "value": leader_url or ""}]
            await self._execute_upsert(conn, schema.settings, rows, ["key"])
            return new

    async def _epoch(self, conn: AsyncConnection, *, lock: bool = False) -> int:
        stmt = select(schema.settings.c.value).where(schema.settings.c.key == EPOCH_KEY)
        if lock and not self.is_sqlite:
            stmt = stmt.with_for_update()
        row = (await conn.execute(stmt)).first()
        return int(row[0]) if row else 0

    @asynccontextmanager
    async def fenced(self, epoch: int) -> AsyncIterator[AsyncConnection]:
        """A write transaction that commits only if ``epoch`` is still current.

        The epoch row is read with a share lock (PostgreSQL) or under the
        write lock BEGIN IMMEDIATE already holds (SQLite), so a new leader's
        bump and a deposed leader's late write cannot interleave.
        """
        async with self.transaction() as conn:
            stmt = select(schema.settings.c.value).where(schema.settings.c.key == EPOCH_KEY)
            if not self.is_sqlite:
                stmt = stmt.with_for_update(read=True)
            row = (await conn.execute(stmt)).first()
            current = int(row[0]) if row else 0
            if current != epoch:
                raise NotLeaderError(f"leader epoch {epoch} is stale (current {current})")
            yield conn

    # -- nodes and gpus ------------------------------------------------------

    async def upsert_nodes(self, rows: Sequence[Row], *, epoch: int | None = None) -> None:
        if not rows:
            return
        async with self._write(epoch) as conn:
            await self._execute_upsert(conn, schema.nodes, rows, ["name"])

    async def touch_nodes(
        self, last_seen: dict[str, float], *, epoch: int | None = None
    ) -> None:
        """Record heartbeats in one statement per batch, not one per report.

        One executemany, as touch_replicas: a statement per node was 10,000
        statements (each through SQLAlchemy's execute) every 5 s at 10,000
        nodes, in the process that answers their reports.
        """
        if not last_seen:
            return
        stmt = (
            update(schema.nodes)
            .where(schema.nodes.c.name == bindparam("node"))
            .values(last_seen=bindparam("at"))
        )
        params = [{"node": name, "at": at} for name, at in last_seen.items()]
        async with self._write(epoch) as conn:
            await conn.execute(stmt, params)

    async def replace_gpus(
        self, node: str, rows: Sequence[Row], *, epoch: int | None = None
    ) -> None:
        async with self._write(epoch) as conn:
            await conn.execute(delete(schema.gpus).where(schema.gpus.c.node == node))
            if rows:
                await conn.execute(schema.gpus.insert(), [dict(r, node=node) for r in rows])

    async def delete_node(self, name: str, *, epoch: int | None = None) -> None:
        async with self._write(epoch) as conn:
            await conn.execute(delete(schema.gpus).where(schema.gpus.c.node == name))
            await conn.execute(delete(schema.nodes).where(schema.nodes.c.name == name))
            # Deleting a node is an admin's act: its addresses are free again.
            await conn.execute(
                delete(schema.address_claims).where(schema.address_claims.c.node == name))

    # -- addresses bound to nodes ----------------------------------------------

    async def claim_address(
        self, address: str, node: str, at: float, *, epoch: int | None = None
    ) -> str:
        """The node ``address`` belongs to: ``node`` if it was free (then bound to it)."""
        claims = schema.address_claims
        async with self._write(epoch) as conn:
            found = (await conn.execute(
                select(claims.c.node).where(claims.c.address == address))).first()
            if found is not None:
                return str(found[0])
            await conn.execute(claims.insert().values(address=address, node=node, claimed_at=at))
            return node

    async def free_address(self, address: str, *, epoch: int | None = None) -> str | None:
        """Unbind ``address``; the node it was bound to, None when it was not."""
        claims = schema.address_claims
        async with self._write(epoch) as conn:
            found = (await conn.execute(
                select(claims.c.node).where(claims.c.address == address))).first()
            if found is None:
                return None
            await conn.execute(delete(claims).where(claims.c.address == address))
            return str(found[0])

    async def list_address_claims(self) -> list[Row]:
        claims = schema.address_claims
        return await self._read(select(claims).order_by(claims.c.address))

    async def list_nodes(self) -> list[Row]:
        return await self._read(select(schema.nodes).order_by(schema.nodes.c.name))

    async def list_gpus(self, node: str | None = None) -> list[Row]:
        stmt = select(schema.gpus).order_by(schema.gpus.c.node, schema.gpus.c.number)
        if node is not None:
            stmt = stmt.where(schema.gpus.c.node == node)
        return await self._read(stmt)

    # -- models ----------------------------------------------------------------

    async def upsert_models(self, rows: Sequence[Row], *, epoch: int | None = None) -> None:
        if not rows:
            return
        async with self._write(epoch) as conn:
            await self._execute_upsert(conn, schema.models, rows, ["name"])

    async def delete_models(self, names: Iterable[str], *, epoch: int | None = None) -> None:
        names = list(names)
        if not names:
            return
        async with self._write(epoch) as conn:
            await conn.execute(delete(schema.models).where(schema.models.c.name.in_(names)))

    async def list_models(self) -> list[Row]:
        return await self._read(select(schema.models).order_by(schema.models.c.name))

    # -- replicas --------------------------------------------------------------

    async def write_replicas(
        self,
        upserts: Sequence[Row],
        deletes: Iterable[str] = (),
        *,
        epoch: int | None = None,
        events: Sequence[Row] = (),
        models: Sequence[Row] = (),
    ) -> None:
        """Apply one reconcile pass's replica and model changes and events atomically.

        Rows go to the driver as tuples (bulk.py): a pass from empty at
        10,000 nodes writes ~10,000 replicas and as many events, and
        SQLAlchemy's per-row work on them was most of the write.
        """
        deletes = list(deletes)
        if not upserts and not deletes and not events and not models:
            return
        bulk = self._bulk
        async with self._write(epoch) as conn:
            if upserts:
                await bulk.insert(
                    conn, schema.replicas, upserts, conflict=["id"], constants={"epoch": epoch or 0}
                )
            if deletes:
                await conn.execute(delete(schema.replicas).where(schema.replicas.c.id.in_(deletes)))
            if models:
                await bulk.insert(conn, schema.models, models, conflict=["name"])
            if events:
                await bulk.insert(conn, schema.events, events)

    async def touch_replicas(
        self, activity: dict[str, tuple[int, float | None]], *, epoch: int | None = None
    ) -> None:
        """Store replicas' use (requests in flight, last used) in one batch."""
        if not activity:
            return
        stmt = (
            update(schema.replicas)
            .where(schema.replicas.c.id == bindparam("rid"))
            .values(in_flight=bindparam("n"), last_request_at=bindparam("at"))
        )
        params = [{"rid": rid, "n": n, "at": at} for rid, (n, at) in activity.items()]
        async with self._write(epoch) as conn:
            await conn.execute(stmt, params)

    async def list_replicas(self) -> list[Row]:
        return await self._read(select(schema.replicas).order_by(schema.replicas.c.id))

    @asynccontextmanager
    async def _write(self, epoch: int | None) -> AsyncIterator[AsyncConnection]:
        """Fenced when given the writer's epoch (llmgw.control.writes gives it always)."""
        if epoch is None:
            async with self.transaction() as conn:
                yield conn
        else:
            async with self.fenced(epoch) as conn:
                yield conn

    # -- events ----------------------------------------------------------------

    async def add_events(self, rows: Sequence[Row], *, epoch: int | None = None) -> None:
        if not rows:
            return
        async with self._write(epoch) as conn:
            await conn.execute(schema.events.insert(), list(rows))

    async def list_events(
        self,
        *,
        since_id: int = 0,
        kind: str | None = None,
        subject: str | None = None,
        limit: int = 200,
    ) -> list[Row]:
        stmt = select(schema.events).where(schema.events.c.id > since_id)
        if kind:
            stmt = stmt.where(schema.events.c.kind == kind)
        if subject:
            stmt = stmt.where(schema.events.c.subject == subject)
        stmt = stmt.order_by(schema.events.c.id.desc()).limit(limit)
        return await self._read(stmt)

    async def prune_events(self, *, before_at: float, epoch: int | None = None) -> int:
        """Delete events older than ``before_at`` (retention); how many went."""
        async with self._write(epoch) as conn:
            result = await conn.execute(
                delete(schema.events).where(schema.events.c.at < before_at))
            return int(result.rowcount or 0)

    # -- API keys --------------------------------------------------------------

    async def add_api_key(self, row: Row, *, epoch: int | None = None) -> None:
        async with self._write(epoch) as conn:
            await conn.execute(schema.api_keys.insert().values(**row))

    async def list_api_keys(self) -> list[Row]:
        return await self._read(select(schema.api_keys).order_by(schema.api_keys.c.created_at))

    async def update_api_key(self, key_id: str, values: Row, *, epoch: int | None = None
                             ) -> bool:
        """Change a key's team or limits (``values``: columns to set); False: no such key."""
        return await self._update_by_id(schema.api_keys, key_id, values, epoch)

    # -- teams -------------------------------------------------------------------

    async def add_team(self, row: Row, *, epoch: int | None = None) -> None:
        async with self._write(epoch) as conn:
            await conn.execute(schema.teams.insert().values(**row))

    async def update_team(self, team_id: str, values: Row, *, epoch: int | None = None) -> bool:
        return await self._update_by_id(schema.teams, team_id, values, epoch)

    async def delete_team(self, team_id: str, *, epoch: int | None = None) -> bool:
        async with self._write(epoch) as conn:
            result = await conn.execute(delete(schema.teams).where(schema.teams.c.id == team_id))
            return bool(result.rowcount)

    async def list_teams(self) -> list[Row]:
        return await self._read(select(schema.teams).order_by(schema.teams.c.name))

    async def revoke_api_key(self, key_id: str, *, epoch: int | None = None) -> bool:
        return await self._update_by_id(schema.api_keys, key_id, {"revoked": True}, epoch)

    async def count(self, table: Table) -> int:
        rows = await self._read(select(func.count()).select_from(table))
        return int(next(iter(rows[0].values())))


def _describe(url: str) -> str:
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        return str(parsed.database)
    return parsed.render_as_string(hide_password=True)


def _first_line(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None) or exc
    text = str(orig).strip().splitlines()
    return text[0] if text else type(orig).__name__
