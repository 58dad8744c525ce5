"""Opening the store: SQLite (embedded default) or PostgreSQL.

SQLite needs two things the driver does not do by itself (DESIGN.md §8): the
stdlib driver's "legacy" transaction handling runs reads outside the
transaction, which silently loses concurrent read-then-write updates, and a
deferred ``BEGIN`` makes a reader that later writes fail at once with
"database is locked". So the driver's own BEGIN is switched off and every
transaction starts with ``BEGIN IMMEDIATE``, queueing writers on the busy
timeout instead of failing them.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from llmgw.errors import ConfigError

SQLITE_BUSY_TIMEOUT_MS = 10_000


def normalise_url(url: str) -> str:
    """Accept the URLs people write and pick the async driver for them."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise ConfigError(f"database URL {url!r} cannot be parsed") from None
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        return str(parsed.set(drivername="sqlite+aiosqlite").render_as_string(False))
    if backend in ("postgresql", "postgres"):
        return parsed.set(drivername="postgresql+psycopg").render_as_string(False)
    raise ConfigError(
        f"database URL scheme {parsed.drivername!r} is not supported: "
        "use sqlite:///path or postgresql://user@host/db"
    )


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def create_engine(url: str, *, pool_size: int = 5) -> AsyncEngine:
    url = normalise_url(url)
    kwargs: dict[str, Any] = {}
    if is_sqlite(url):
        engine = create_async_engine(url, pool_size=pool_size, max_overflow=0)
        _make_sqlite_safe(engine)
        return engine
    kwargs["pool_pre_ping"] = True
    kwargs["connect_args"] = {"connect_timeout": 5}
    return create_async_engine(url, pool_size=pool_size, max_overflow=10, **kwargs)


def _make_sqlite_safe(engine: AsyncEngine) -> None:
    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # no implicit BEGIN from the driver
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")
