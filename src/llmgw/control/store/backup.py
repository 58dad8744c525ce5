"""Backing up and restoring the store: SQLite's online backup API, pg_dump and pg_restore.

A backup is taken while ``serve`` runs. SQLite's backup API copies the pages
under a read lock (WAL mode: writers carry on), so the copy is one
consistent moment; ``pg_dump`` reads in one repeatable-read snapshot. The
file holds everything the store holds (catalog, keys' and tokens' hashes,
nodes, usage, events, the engine-key seed and secret env values in the
clear), so it is written owner-only, to a temporary name first and renamed
when complete: a backup that failed half-way never looks like a good one.

A restore is for a store no ``serve`` is using (the control plane works from
memory and would write its old state back): into an empty store by default,
over one that holds data only when forced. SQLite restores through the same
backup API, into the target's own connection, so its WAL and page cache stay
consistent; PostgreSQL through ``pg_restore`` in one transaction, all or
nothing. A backup of an older llmgw restores as it was and is migrated by
the next ``serve`` (Store.open).

``pg_dump``/``pg_restore`` are run with an argument list, never through a
shell, and the database password travels in ``PGPASSWORD`` (or the user's
passfile), never on the command line, where every user of the machine could
read it in ``/proc``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sqlalchemy.engine import make_url

from llmgw.control.store.db import is_sqlite, libpq_conninfo, normalise_url
from llmgw.errors import ConfigError

Kind = Literal["sqlite", "postgresql"]
SQLITE_MAGIC = b"SQLite format 3\x00"
PGDUMP_MAGIC = b"PGDMP"
# A dump of a large usage table takes minutes; a hung server should not hold
# a cron job for ever.
PG_TIMEOUT_S = 3600.0
_BUSY_TIMEOUT_MS = 10_000
# Tables whose rows mean "this store is in use" (alembic_version alone is an
# empty store that a serve once opened).
_DATA_TABLES = ("nodes", "models", "api_keys", "usage", "replicas", "settings")


@dataclass(frozen=True, slots=True)
class Outcome:
    kind: Kind
    path: Path
    bytes: int
    seconds: float
    revision: str | None  # the schema revision the backup holds


def store_kind(url: str) -> Kind:
    return "sqlite" if is_sqlite(normalise_url(url)) else "postgresql"


def file_kind(path: Path) -> Kind:
    try:
        with path.open("rb") as f:
            head = f.read(len(SQLITE_MAGIC))
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    if head.startswith(SQLITE_MAGIC):
        return "sqlite"
    if head.startswith(PGDUMP_MAGIC):
        return "postgresql"
    raise ConfigError(f"{path} is neither an SQLite database nor a pg_dump archive "
                      "(custom format): not an llmgw backup")


# -- backup -------------------------------------------------------------------------


def backup(url: str, dest: Path, *, pg_dump: str | None = None) -> Outcome:
    """Copy the store at ``url`` to ``dest`` (replaced only once the copy is complete)."""
    started = time.monotonic()
    kind = store_kind(url)
    partial = dest.with_name(dest.name + ".partial")
    with contextlib.suppress(FileNotFoundError):
        partial.unlink()
    try:
        if kind == "sqlite":
            revision = _sqlite_backup(_sqlite_path(url), partial)
        else:
            revision = None
            _run_pg(pg_dump or "pg_dump", url, [
                "--format=custom", "--no-owner", "--no-privileges", f"--file={partial}"])
        os.chmod(partial, 0o600)
        os.replace(partial, dest)
    finally:
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
    return Outcome(kind, dest, dest.stat().st_size, time.monotonic() - started, revision)


def _sqlite_path(url: str) -> Path:
    database = make_url(normalise_url(url)).database
    if not database or database == ":memory:":
        raise ConfigError(f"{url}: not an SQLite file")
    return Path(database)


def _sqlite_backup(source: Path, partial: Path) -> str | None:
    if not source.exists():
        raise ConfigError(f"no store at {source}")
    # Owner-only from the first byte: the file holds the store's secrets.
    os.close(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    with _connect(f"file:{source}?mode=ro", uri=True) as src, _connect(str(partial)) as dst:
        src.backup(dst)
        # One self-contained file: the copy has the store's WAL mode in its
        # header, which would leave -wal and -shm files beside it.
        dst.execute("PRAGMA journal_mode=DELETE")
        _check_sqlite(dst, partial)
        return _sqlite_revision(dst)


@contextlib.contextmanager
def _connect(target: str, *, uri: bool = False) -> Iterator[sqlite3.Connection]:
    try:
        conn = sqlite3.connect(target, uri=uri, isolation_level=None)
    except sqlite3.Error as exc:
        raise ConfigError(f"cannot open {target.removeprefix('file:')}: {exc}") from None
    try:
        conn.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")
        yield conn
    except sqlite3.Error as exc:
        raise ConfigError(f"SQLite: {exc}") from None
    finally:
        conn.close()


def _check_sqlite(conn: sqlite3.Connection, path: Path) -> None:
    answer = conn.execute("PRAGMA integrity_check").fetchone()
    if not answer or answer[0] != "ok":
        raise ConfigError(f"{path}: integrity check failed: {answer[0] if answer else '?'}")


def _sqlite_revision(conn: sqlite3.Connection) -> str | None:
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    if "alembic_version" not in tables:
        return None
    row = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    return str(row[0]) if row else None


# -- restore -------------------------------------------------------------------------


def restore(source: Path, url: str, *, force: bool = False,
            pg_restore: str | None = None) -> Outcome:
    """Put the backup ``source`` into the store at ``url``, which must be empty unless forced."""
    started = time.monotonic()
    kind, target = file_kind(source), store_kind(url)
    if kind != target:
        raise ConfigError(f"{source} is a {_name(kind)} backup and the store at "
                          f"{_describe(url)} is {_name(target)}: restore into the same kind")
    if kind == "sqlite":
        revision = _sqlite_restore(source, _sqlite_path(url), force)
    else:
        in_use = _pg_rows(url)
        if in_use and not force:
            raise ConfigError(_in_use(url, in_use))
        _run_pg(pg_restore or "pg_restore", url, [
            "--no-owner", "--no-privileges", "--single-transaction", "--exit-on-error",
            *(["--clean", "--if-exists"] if in_use else []), str(source)])
        revision = _pg_revision(url)
    return Outcome(kind, source, source.stat().st_size, time.monotonic() - started, revision)


def _name(kind: Kind) -> str:
    return "an SQLite" if kind == "sqlite" else "a PostgreSQL"


def _describe(url: str) -> str:
    return make_url(normalise_url(url)).render_as_string(hide_password=True)


def _in_use(url: str, rows: int) -> str:
    return (f"the store at {_describe(url)} holds data ({rows} rows): restore into a fresh "
            "store, or pass --force with every llmgw serve on it stopped")


def _sqlite_restore(source: Path, target: Path, force: bool) -> str | None:
    with _connect(f"file:{source}?mode=ro", uri=True) as src:
        _check_sqlite(src, source)
        revision = _sqlite_revision(src)
        if revision is None:
            raise ConfigError(f"{source} is an SQLite database but not an llmgw store")
        if not target.parent.is_dir():
            raise ConfigError(f"cannot restore to {target}: {target.parent} is not a directory")
        with _connect(str(target)) as dst:
            rows = _sqlite_rows(dst)
            if rows and not force:
                raise ConfigError(_in_use(f"sqlite:///{target}", rows))
            src.backup(dst)
            # The store's own mode (db.py), so a serve started next finds it as it left it.
            dst.execute("PRAGMA journal_mode=WAL")
            _check_sqlite(dst, target)
    os.chmod(target, 0o600)
    return revision


def _sqlite_rows(conn: sqlite3.Connection) -> int:
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    return sum(int(conn.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0])
               for t in _DATA_TABLES if t in tables)


def _pg_rows(url: str) -> int:
    import psycopg

    try:
        with psycopg.connect(libpq_conninfo(url), connect_timeout=10) as conn:
            present = {r[0] for r in conn.execute(
                "SELECT table_name FROM information_schema.tables "
                "WHERE table_schema = current_schema()")}
            total = 0
            for table in _DATA_TABLES:
                if table in present:
                    row = conn.execute(f'SELECT count(*) FROM "{table}"').fetchone()
                    total += int(row[0]) if row else 0
            return total
    except psycopg.Error as exc:
        raise ConfigError(f"cannot read the store at {_describe(url)}: "
                          f"{str(exc).strip().splitlines()[0]}") from None


def _pg_revision(url: str) -> str | None:
    import psycopg

    with psycopg.connect(libpq_conninfo(url), connect_timeout=10) as conn:
        try:
            row = conn.execute("SELECT version_num FROM alembic_version").fetchone()
        except psycopg.Error:
            return None
        return str(row[0]) if row else None


# -- running pg_dump and pg_restore ---------------------------------------------------------


def pg_command(tool: str, url: str, args: list[str]) -> tuple[list[str], dict[str, str]]:
    """The argv and environment for ``tool`` against ``url``: the password only in the env.

    ``--dbname`` takes libpq's connection string (every host of a Patroni
    URL, ``target_session_attrs``, ``sslmode``), with the password removed.
    """
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    params = conninfo_to_dict(libpq_conninfo(url))
    password = params.pop("password", None)
    path = shutil.which(tool)
    if path is None:
        raise ConfigError(f"{tool} is not installed (Debian: apt-get install postgresql-client; "
                          "its major version must be at least the server's)")
    env = dict(os.environ)
    if password is not None:
        env["PGPASSWORD"] = str(password)
    conninfo = make_conninfo("", **{k: str(v) for k, v in params.items()})
    return [path, *args, f"--dbname={conninfo}"], env


def _run_pg(tool: str, url: str, args: list[str]) -> None:
    argv, env = pg_command(tool, url, args)
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True,
                              timeout=PG_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{Path(argv[0]).name} did not finish within {PG_TIMEOUT_S:g} s") \
            from None
    if done.returncode != 0:
        problem = (done.stderr or done.stdout).strip().splitlines()
        raise ConfigError(f"{Path(argv[0]).name} failed (exit {done.returncode}): "
                          + ("; ".join(problem[:3]) or "no message"))
