"""``llmgw ctl backup`` and ``restore`` on SQLite and PostgreSQL.

A store filled through the control plane (the console tests' fleet: nodes
with MIG cards, models, replicas, API keys, join tokens, usage, events) is
backed up while its control plane has it open, restored into a fresh store,
and read back: every table row for row, and the catalog, keys, nodes and
usage as a control plane loads them. pg_dump is watched through a wrapper
on PATH: the database password must reach it in its environment, never on
its command line.
"""

from __future__ import annotations

import os
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import select, text
from sqlalchemy.engine import make_url
from tests.conftest import PG_URL
from tests.console.fleet import build
from tests.control.planekit import opened_plane
from typer.testing import CliRunner, Result

from llmgw.cli.ctl import app
from llmgw.control.plane import ControlPlane
from llmgw.control.store import schema
from llmgw.control.store.repo import Store

PASSWORD = "s3cret-pw-never-on-argv"


@pytest.fixture
def fresh_url(store_url: str, tmp_path: Path) -> Iterator[str]:
    """A second, empty store of the same kind as ``store_url``."""
    if store_url.startswith("sqlite"):
        (tmp_path / "restored").mkdir()
        yield f"sqlite:///{tmp_path / 'restored' / 'llmgw.db'}"
        return
    name = f"llmgw_r_{uuid.uuid4().hex[:12]}"
    admin = make_url(PG_URL).render_as_string(hide_password=False)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        # With a password (trust auth ignores it): it must travel in PGPASSWORD only.
        yield make_url(PG_URL).set(database=name, password=PASSWORD).render_as_string(
            hide_password=False)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def watched_pg_tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """pg_dump and pg_restore wrappers on PATH that log their argv and PGPASSWORD."""
    tools = tmp_path / "bin"
    tools.mkdir()
    log = tmp_path / "pg-calls.log"
    for tool in ("pg_dump", "pg_restore"):
        real = next(p for p in (Path(d) / tool for d in os.environ["PATH"].split(":"))
                    if p.is_file() and os.access(p, os.X_OK))
        wrapper = tools / tool
        wrapper.write_text(
            "#!/bin/sh\n"
            f'printf "%s argv:" {tool} >> "{log}"\n'
            f'for a in "$@"; do printf " [%s]" "$a" >> "{log}"; done\n'
            f'printf " PGPASSWORD=%s\\n" "${{PGPASSWORD-}}" >> "{log}"\n'
            f'exec {real} "$@"\n')
        wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}:{os.environ['PATH']}")
    return log


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def ctl(*args: str) -> Result:
    env: dict[str, str | None] = {"LLMGW_DATABASE_URL": None, "LLMGW_DATA_DIR": None}
    return CliRunner().invoke(app, list(args), env=env)


def ok(result: Result) -> str:
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    return result.stdout


async def every_row(url: str) -> dict[str, list[Any]]:
    store = await Store.open(url, migrate=False)
    try:
        out: dict[str, list[Any]] = {}
        async with store.engine.connect() as conn:
            for table in schema.metadata.sorted_tables:
                rows = (await conn.execute(select(table))).all()
                out[table.name] = sorted((tuple(r) for r in rows), key=repr)
            version = await conn.execute(text("SELECT version_num FROM alembic_version"))
            out["alembic_version"] = [tuple(r) for r in version]
        return out
    finally:
        await store.close()


async def loaded(url: str) -> dict[str, Any]:
    """What a control plane starting on the store sees."""
    store = await Store.open(url, migrate=False)
    try:
        cp = ControlPlane(store)
        await cp.load()
        return {
            "catalog": {n: m.spec.model_dump() for n, m in cp.state.models.items()},
            "keys": sorted((k.model_dump() for k in cp.keys.all()), key=repr),
            "nodes": {n: (r.token_hash, r.fabrics, r.admin_state,
                          r.inventory.model_dump() if r.inventory else None)
                      for n, r in cp.state.nodes.items()},
            "replicas": sorted(cp.state.replicas),
            "usage": await store.query_usage(since=0),
            "join_tokens": sorted(cp.credentials.join_tokens.tokens),
        }
    finally:
        await store.close()


async def test_backup_then_restore_into_a_fresh_store(
    store_url: str, fresh_url: str, tmp_path: Path, watched_pg_tools: Path
) -> None:
    async with opened_plane(store_url) as (cp, creds):
        assert creds.join_token
        await build(cp, creds.join_token)
        # Taken while the control plane has the store open, as on a live fleet.
        out = ok(ctl("backup", str(tmp_path / "llmgw.backup"), "--database-url", store_url))
    backup_file = tmp_path / "llmgw.backup"
    assert stat.S_IMODE(backup_file.stat().st_mode) == 0o600
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".partial")]
    kind = "sqlite" if store_url.startswith("sqlite") else "postgresql"
    assert out.startswith(f"backed up the {kind} store to {backup_file}")

    done = ok(ctl("restore", str(backup_file), "--database-url", fresh_url))
    assert done.startswith(f"restored {backup_file} into the {kind} store")

    before, after = await every_row(store_url), await every_row(fresh_url)
    assert after == before
    assert sum(len(rows) for rows in after.values()) > 100
    restored = await loaded(fresh_url)
    assert restored == await loaded(store_url)
    assert len(restored["catalog"]) >= 4 and len(restored["keys"]) == 2
    assert len(restored["nodes"]) >= 4 and restored["usage"]

    # The restored store is in use now: a second restore is refused, then forced.
    again = ctl("restore", str(backup_file), "--database-url", fresh_url)
    assert again.exit_code == 1 and "holds data" in again.stderr
    assert PASSWORD not in again.stderr
    ok(ctl("restore", str(backup_file), "--database-url", fresh_url, "--force"))
    assert await every_row(fresh_url) == before

    if kind == "postgresql":
        calls = lines(watched_pg_tools)
        assert [c.split()[0] for c in calls] == ["pg_dump", "pg_restore", "pg_restore"]
        for call in calls[1:]:  # the restores went to the store whose URL has a password
            assert PASSWORD not in call.split(" PGPASSWORD=")[0]
            assert call.endswith(f"PGPASSWORD={PASSWORD}")
        assert "[--clean]" in calls[2] and "[--clean]" not in calls[1]


def test_a_backup_of_another_kind_or_no_backup_is_refused(tmp_path: Path) -> None:
    not_a_backup = tmp_path / "notes.txt"
    not_a_backup.write_text("hello")
    result = ctl("restore", str(not_a_backup), "--database-url",
                 f"sqlite:///{tmp_path / 'llmgw.db'}")
    assert result.exit_code == 1 and "not an llmgw backup" in result.stderr
    dump = tmp_path / "pg.backup"
    dump.write_bytes(b"PGDMP\x01\x0e\x00")
    result = ctl("restore", str(dump), "--database-url", f"sqlite:///{tmp_path / 'llmgw.db'}")
    assert result.exit_code == 1
    assert "a PostgreSQL backup and the store at" in result.stderr
    missing = ctl("--data-dir", str(tmp_path / "nowhere"), "backup", str(tmp_path / "b"))
    assert missing.exit_code == 1 and "no store at" in missing.stderr
