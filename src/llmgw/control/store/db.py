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

from typing import Any, cast
from urllib.parse import quote, urlsplit, urlunsplit

import orjson
from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from llmgw.errors import ConfigError

SQLITE_BUSY_TIMEOUT_MS = 10_000


def normalise_url(url: str) -> str:
    """Accept the URLs people write and pick the async driver for them."""
    url = _hosts_to_query(url)
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


def _hosts_to_query(url: str) -> str:
    """libpq's multi-host form, ``postgresql://u@h1:5432,h2:5433/db``, as SQLAlchemy's.

    It is how Patroni users write their URL (and what docs/install.md
    shows), but SQLAlchemy's parser reads everything after the last colon of
    the host list as one port and fails; its own spelling of the same list is
    ``?host=h1:5432&host=h2:5433``, which its PostgreSQL dialects hand to
    libpq as ``host=h1,h2 port=5432,5433``.
    """
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if "," not in hosts:
        return url
    if "host=" in parts.query:
        raise ConfigError(f"database URL {url!r} names hosts twice (before the path and "
                          "in host=); give them in one place")
    query = "&".join([*(f"host={quote(h, safe=':')}" for h in hosts.split(",") if h),
                      *([parts.query] if parts.query else [])])
    return urlunsplit(parts._replace(netloc=userinfo + at, query=query))


def libpq_conninfo(url: str) -> str:
    """The libpq connection string for ``url``, every host of a multi-host URL included.

    For connections made with psycopg directly (the leader's lock), which
    must reach the same hosts, in the same order and with the same options
    (``target_session_attrs=read-write``), as the engine's pool; rendering
    the URL back as a string would keep only the last of several ``host=``.
    """
    from psycopg.conninfo import make_conninfo
    from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg

    # The dialect's own translation, so this can never disagree with the pool
    # (its module is untyped, hence the cast).
    dialect = cast(Any, PGDialect_psycopg)()
    _, params = dialect.create_connect_args(make_url(normalise_url(url)))
    return make_conninfo("", **{key: str(value) for key, value in params.items()})


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def create_engine(url: str, *, pool_size: int = 5) -> AsyncEngine:
    url = normalise_url(url)
    # JSON columns (a replica's shards, an event's data) through orjson: the
    # standard library's encoder was a third of writing a 10,000-replica
    # pass, one row at a time. Readers parse either the same.
    kwargs: dict[str, Any] = {"json_serializer": json_text}
    if is_sqlite(url):
        engine = create_async_engine(url, pool_size=pool_size, max_overflow=0, **kwargs)
        _make_sqlite_safe(engine)
        return engine
    kwargs["pool_pre_ping"] = True
    kwargs["connect_args"] = {"connect_timeout": 5}
    return create_async_engine(url, pool_size=pool_size, max_overflow=10, **kwargs)


def json_text(value: Any) -> str:
    # Keys that are not strings become strings, as the standard library's do.
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()


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
