"""Bulk writes (store/bulk.py): the rows a pass writes read back exactly as
SQLAlchemy's own executemany wrote them, on SQLite and PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy.dialects import sqlite

from llmgw.control.store import schema
from llmgw.control.store.bulk import build_insert
from llmgw.control.store.repo import Store

Row = dict[str, Any]


def replica(rid: str, **changes: Any) -> Row:
    row: Row = {
        "id": rid, "model": "m", "generation": 3,
        "shards": [{"node": "n1", "rank": 0, "device_numbers": [2, 3],
                    "device_uuids": ["GPU-a", "GPU-b"]}],
        "state": "starting", "reason": "why", "port": 8001, "created_at": 10.5,
        "ready_at": None, "last_request_at": 12.25, "in_flight": 2, "draining": True,
    }
    row.update(changes)
    return row


async def _by_sqlalchemy(store: Store, rows: list[Row], epoch: int) -> None:
    """The write as it was before bulk.py: SQLAlchemy's upsert, row dicts."""
    async with store.transaction() as conn:
        await store._execute_upsert(
            conn, schema.replicas, [dict(r, epoch=epoch) for r in rows], ["id"])


async def test_replicas_read_back_as_sqlalchemy_wrote_them(store: Store) -> None:
    epoch = await store.bump_epoch()
    variants: list[Row] = [
        {},
        {"draining": False, "reason": None, "port": None, "ready_at": 11.0},
        {"shards": [], "in_flight": None},
    ]
    ours = [replica(f"b{i}", **v) for i, v in enumerate(variants)]
    theirs = [replica(f"s{i}", **v) for i, v in enumerate(variants)]
    await store.write_replicas(ours, epoch=epoch)
    await _by_sqlalchemy(store, theirs, epoch)
    rows = {r["id"]: r for r in await store.list_replicas()}
    for i in range(len(variants)):
        bulk, reference = dict(rows[f"b{i}"]), dict(rows[f"s{i}"])
        assert bulk.pop("id") == f"b{i}" and reference.pop("id") == f"s{i}"
        assert bulk == reference
        assert type(bulk["draining"]) is type(reference["draining"]) is bool
    assert rows["b0"]["epoch"] == epoch and rows["b0"]["shards"] == ours[0]["shards"]


async def test_an_upsert_replaces_every_column(store: Store) -> None:
    first = await store.bump_epoch()
    await store.write_replicas([replica("r")], epoch=first)
    second = await store.bump_epoch()
    changed = replica("r", state="ready", shards=[], port=None, draining=False, in_flight=0)
    await store.write_replicas([changed], epoch=second)
    (row,) = await store.list_replicas()
    assert row == dict(changed, epoch=second)


async def test_columns_a_row_leaves_out_get_their_defaults(store: Store) -> None:
    # No in_flight (rows from before 0004's column), no generation, no draining.
    row = replica("r")
    for column in ("in_flight", "generation", "draining"):
        del row[column]
    await store.write_replicas([row], events=[{"at": 1.0, "kind": "placed", "message": "m"}])
    (stored,) = await store.list_replicas()
    assert stored["in_flight"] is None and stored["generation"] == 1
    assert stored["draining"] is False and stored["epoch"] == 0
    (event,) = await store.list_events()
    assert event["subject"] == "" and event["data"] == {}


async def test_events_are_numbered_and_keep_their_data(store: Store) -> None:
    events = [
        {"at": float(i), "kind": "placed", "subject": "m", "message": f"placed {i}",
         # Keys that are not strings become strings, as json.dumps makes them.
         "data": {"replica": f"r{i}", "score": 0.5, "none": None, 1: "one"}}
        for i in range(3)
    ]
    await store.write_replicas([], events=events)
    stored = sorted(await store.list_events(), key=lambda e: e["id"])
    assert [e["message"] for e in stored] == ["placed 0", "placed 1", "placed 2"]
    assert len({e["id"] for e in stored}) == 3
    assert stored[2]["data"] == {"replica": "r2", "score": 0.5, "none": None, "1": "one"}


async def test_model_rows_of_a_pass_are_upserted(store: Store) -> None:
    row = {"name": "m", "spec": {"name": "m", "engine": "sim"}, "parked": False, "failures": 0,
           "last_error": None, "node_failures": None, "demand_at": None, "created_at": 1.0,
           "updated_at": 1.0}
    await store.upsert_models([row])
    failed = dict(row, parked=True, failures=3, last_error="boom",
                  node_failures={"n1": {"failures": 3, "last_at": 2.0, "current_run": True}},
                  updated_at=2.0)
    await store.write_replicas([], models=[failed])
    (stored,) = await store.list_models()
    assert stored == failed


def test_a_column_the_table_lacks_is_refused() -> None:
    with pytest.raises(ValueError, match="no column colour"):
        build_insert(schema.replicas, sqlite.dialect(), ("id", "colour"), (), ("id",))
