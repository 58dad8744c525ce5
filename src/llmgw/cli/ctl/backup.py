"""``llmgw ctl backup`` / ``restore``: the store to a file and back (llmgw.control.store.backup).

Unlike the other ctl commands these talk to the database, not the admin
API: a restore must work with no control plane running, and a backup needs
nothing a control plane would add. The store is ``--database-url`` (or
``LLMGW_DATABASE_URL``, which keeps a password off the command line), else
the SQLite store in the data dir, as ``serve`` and ``up`` choose it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from llmgw.cli.ctl.client import CtlError, Settings, guarded
from llmgw.config import default_data_dir, sqlite_url
from llmgw.errors import ConfigError

DatabaseOpt = Annotated[str | None, typer.Option(
    envvar="LLMGW_DATABASE_URL",
    help="The store: postgresql://user@host/db (password: PGPASSWORD, ~/.pgpass, or this "
         "variable) or sqlite:///path; default: the data dir's SQLite store.")]


def store_url(ctx: typer.Context, database_url: str | None) -> str:
    if database_url:
        return database_url
    settings: Settings = ctx.obj or Settings()
    return sqlite_url(settings.data_dir or default_data_dir())


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


@guarded
def backup(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="The backup to write (replaced when complete).")],
    database_url: DatabaseOpt = None,
) -> None:
    """Copy the store to FILE while llmgw runs (SQLite's backup API, or pg_dump)."""
    from llmgw.control.store import backup as store_backup

    try:
        done = store_backup.backup(store_url(ctx, database_url), file)
    except ConfigError as exc:
        raise CtlError(str(exc)) from None
    revision = f", schema {done.revision}" if done.revision else ""
    typer.echo(f"backed up the {done.kind} store to {done.path} ({_size(done.bytes)}"
               f"{revision}) in {done.seconds:.1f} s")


@guarded
def restore(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="A backup made by llmgw ctl backup.")],
    database_url: DatabaseOpt = None,
    force: Annotated[bool, typer.Option(
        "--force", help="Replace a store that holds data (stop every llmgw serve on it "
                        "first).")] = False,
) -> None:
    """Put a backup into an empty store (SQLite's backup API, or pg_restore)."""
    from llmgw.control.store import backup as store_backup

    url = store_url(ctx, database_url)
    try:
        done = store_backup.restore(file, url, force=force)
    except ConfigError as exc:
        raise CtlError(str(exc)) from None
    revision = f" (schema {done.revision}; llmgw serve migrates it on start)" \
        if done.revision else ""
    typer.echo(f"restored {done.path} into the {done.kind} store{revision} in "
               f"{done.seconds:.1f} s")
