"""Fixtures shared by the whole suite: stores on SQLite and PostgreSQL.

PostgreSQL tests use the server at LLMGW_TEST_PG_URL (the Makefile starts
it when it is down) and get a database of their own, dropped afterwards, so
runs never see each other's rows.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url

PG_URL = os.environ.get("LLMGW_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")


@pytest.fixture
def test_output() -> Path:
    path = Path(os.environ.get("LLMGW_TEST_OUTPUT", "test-output"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def pg_database_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test."""
    name = f"llmgw_t_{uuid.uuid4().hex[:12]}"
    admin = make_url(PG_URL)
    with psycopg.connect(admin.render_as_string(hide_password=False), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield admin.set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(admin.render_as_string(hide_password=False), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The same test against the embedded store and PostgreSQL."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'llmgw.db'}"
    else:
        yield request.getfixturevalue("pg_database_url")


@pytest.fixture
async def store(store_url: str) -> AsyncIterator[object]:
    from llmgw.control.store.repo import Store

    opened = await Store.open(store_url)
    try:
        yield opened
    finally:
        await opened.close()
