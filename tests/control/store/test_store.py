"""The store on SQLite and PostgreSQL: migrations, round trips, concurrency."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.config import Config
from sqlalchemy import Executable, select, update
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from llmgw.control.plane import ControlPlane
from llmgw.control.rows import model_from_row, model_row, replica_from_row
from llmgw.control.state import NodeFailure
from llmgw.control.store import schema
from llmgw.control.store.db import create_engine, is_sqlite
from llmgw.control.store.migrate import MIGRATIONS, current_revision
from llmgw.control.store.repo import Store
from llmgw.errors import ConfigError, NotLeaderError, ValidationError
from llmgw.wire import AgentRegistration

HEAD = "0008"


async def test_migrates_from_empty_to_head(store: Store) -> None:
    assert await current_revision(store.engine) == HEAD
    for table in schema.metadata.sorted_tables:
        assert await store.count(table) == 0


async def test_opening_twice_keeps_data(store_url: str) -> None:
    first = await Store.open(store_url)
    await first.set_setting("k", "v")
    await first.close()
    second = await Store.open(store_url)
    try:
        assert await second.get_setting("k") == "v"
        assert await current_revision(second.engine) == HEAD
    finally:
        await second.close()


def _owner_only(store_url: str) -> None:
    """A SQLite file made owner-only, as the store must be before llmgw opens it."""
    database = make_url(store_url).database
    if is_sqlite(store_url) and database and not os.path.exists(database):
        os.close(os.open(database, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


@asynccontextmanager
async def raw_engine(store_url: str) -> AsyncIterator[AsyncEngine]:
    """An engine on the store's database, under no Store (no migration on open)."""
    _owner_only(store_url)
    engine = create_engine(store_url)
    try:
        yield engine
    finally:
        await engine.dispose()


async def migrate_to(store_url: str, revision: str, *, down: bool = False) -> None:
    """Put a store's schema at ``revision``, as an older llmgw would have left it."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    move = command.downgrade if down else command.upgrade
    async with raw_engine(store_url) as engine, engine.connect() as conn:
        def run(sync_conn: Any) -> None:
            config.attributes["connection"] = sync_conn
            move(config, revision)

        await conn.run_sync(run)
        await conn.commit()


async def written_by_release(store_url: str, revision: str, *inserts: Executable) -> None:
    """A store at ``revision`` holding the rows a control plane of that release wrote."""
    await migrate_to(store_url, revision)
    async with raw_engine(store_url) as engine, engine.begin() as conn:
        for insert in inserts:
            await conn.execute(insert)


async def test_a_store_of_the_previous_release_upgrades_and_keeps_its_rows(
    store_url: str,
) -> None:
    # A node written by a control plane from before agent keys (revision 0001).
    await written_by_release(
        store_url, "0001",
        # Only the columns given are written: agent_key_hash does not exist yet.
        schema.nodes.insert().values(
            name="n1", admin_state="cordoned", token_hash="t" * 64, address="10.0.0.1",
            agent_port=None, fabrics=["ib-a"], inventory=None, weights=[],
            registered_at=1.0, last_seen=2.0,
        ),
        schema.gpus.insert().values(
            node="n1", number=0, uuid="GPU-0", gpu_class="h100-80g", healthy=True,
            placeable=True, reason=None, memory_total_mib=81559,
        ),
    )

    store = await Store.open(store_url)  # what `llmgw serve` does at start
    try:
        assert await current_revision(store.engine) == HEAD
        (node,) = await store.list_nodes()
        assert (node["name"], node["admin_state"], node["token_hash"]) == (
            "n1", "cordoned", "t" * 64)
        assert node["agent_key_hash"] is None  # registered before agent keys: the old rule
        # gpus references nodes with ON DELETE CASCADE: a migration that
        # rebuilt nodes would have emptied it.
        assert [g["uuid"] for g in await store.list_gpus("n1")] == ["GPU-0"]
        # Its agent cannot prove it is the one that registered: refused as before.
        cp = ControlPlane(store)
        await cp.load()
        join = (await cp.ensure_credentials(first_api_key=False)).join_token
        assert join
        with pytest.raises(ValidationError, match="before agents sent an agent key"):
            await cp.nodes.register(AgentRegistration(node="n1", join_token=join,
                                                agent_key="llmgw-agent-key-" + "k" * 43))
        await store.upsert_nodes([dict(node, agent_key_hash="k" * 64)])
        assert (await store.list_nodes())[0]["agent_key_hash"] == "k" * 64
    finally:
        await store.close()
    # And back: the downgrade drops the column and nothing else.
    await migrate_to(store_url, "0001", down=True)
    async with raw_engine(store_url) as engine:
        async with engine.connect() as conn:
            rows = (await conn.exec_driver_sql("SELECT * FROM nodes")).mappings().all()
        assert [r["name"] for r in rows] == ["n1"] and "agent_key_hash" not in rows[0]
        async with engine.connect() as conn:
            gpus = (await conn.exec_driver_sql("SELECT uuid FROM gpus")).all()
        assert [g[0] for g in gpus] == ["GPU-0"]


async def test_a_models_failures_by_node_survive_an_upgrade_and_a_round_trip(
    store_url: str,
) -> None:
    # A model row written before failures by node existed (revision 0002).
    await written_by_release(store_url, "0002", schema.models.insert().values(
        name="m", spec={"name": "m", "engine": "sim"}, parked=False, failures=2,
        last_error="boom", demand_at=None, created_at=1.0, updated_at=1.0,
    ))
    store = await Store.open(store_url)
    try:
        (row,) = await store.list_models()
        record = model_from_row(row)
        assert (record.failures, record.node_failures) == (2, {})  # none known: none avoided
        record.node_failures = {"n1": NodeFailure(2, 5.5), "n2": NodeFailure(1, 3.0, False)}
        await store.upsert_models([model_row(record)])
        (row,) = await store.list_models()
        assert model_from_row(row).node_failures == record.node_failures
    finally:
        await store.close()
    await migrate_to(store_url, "0002", down=True)


async def test_a_replicas_use_survives_an_upgrade_and_is_stored_in_one_batch(
    store_url: str,
) -> None:
    # A replica row written before requests in flight were stored (revision 0003).
    await written_by_release(store_url, "0003", schema.replicas.insert().values(
        id="r1", model="m", generation=1, shards=[], state="ready", reason=None,
        port=21000, created_at=1.0, ready_at=2.0, last_request_at=3.0, draining=False,
    ))
    store = await Store.open(store_url)
    try:
        (row,) = await store.list_replicas()
        assert replica_from_row(row).in_flight == 0  # none stored: none in flight
        await store.touch_replicas({"r1": (3, 50.0), "gone": (1, 9.0)})
        (row,) = await store.list_replicas()  # an unknown id adds no row
        assert (replica_from_row(row).in_flight, row["last_request_at"]) == (3, 50.0)
        assert row["state"] == "ready" and row["port"] == 21000  # the rest untouched
    finally:
        await store.close()
    await migrate_to(store_url, "0003", down=True)


async def test_heartbeats_are_written_in_one_batch(store: Store) -> None:
    def node(name: str) -> dict[str, Any]:
        return {"name": name, "admin_state": "ready", "token_hash": None,
                "agent_key_hash": None, "address": "10.0.0.1", "agent_port": None,
                "fabrics": [], "inventory": None, "weights": [], "registered_at": 1.0,
                "last_seen": 1.0}

    await store.upsert_nodes([node("n1"), node("n2"), node("n3")])
    # A node deleted since its heartbeat was noted changes nothing.
    await store.touch_nodes({"n1": 5.0, "n3": 7.0, "gone": 9.0})
    seen = {n["name"]: n["last_seen"] for n in await store.list_nodes()}
    assert seen == {"n1": 5.0, "n2": 1.0, "n3": 7.0}


async def test_round_trips(store: Store) -> None:
    now = time.time()
    await store.upsert_nodes([{
        "name": "n1", "admin_state": "ready", "token_hash": None, "agent_key_hash": None,
        "address": "10.0.0.1",
        "agent_port": None, "fabrics": ["ib-a"], "inventory": {"hostname": "n1"},
        "weights": [], "registered_at": now, "last_seen": now,
    }])
    await store.replace_gpus("n1", [{
        "number": 1001, "uuid": "MIG-x", "gpu_class": "a100-80g-mig-3g.40gb", "healthy": True,
        "placeable": True, "reason": None, "memory_total_mib": 40000,
    }])
    await store.upsert_models([{
        "name": "m", "spec": {"name": "m", "engine": "sim"}, "parked": False, "failures": 0,
        "last_error": None, "demand_at": None, "created_at": now, "updated_at": now,
    }])
    await store.write_replicas(
        [{"id": "r1", "model": "m", "generation": 1, "shards": [{"node": "n1"}],
          "state": "starting", "reason": None, "port": None, "created_at": now,
          "ready_at": None, "last_request_at": None, "draining": False}],
        events=[{"at": now, "kind": "placed", "subject": "m", "message": "placed r1", "data": {}}],
    )
    nodes = await store.list_nodes()
    assert nodes[0]["fabrics"] == ["ib-a"] and nodes[0]["inventory"] == {"hostname": "n1"}
    gpus = await store.list_gpus("n1")
    assert [g["number"] for g in gpus] == [1001]
    assert (await store.list_replicas())[0]["shards"] == [{"node": "n1"}]
    events = await store.list_events()
    assert events[0]["message"] == "placed r1"
    await store.write_replicas([], ["r1"])
    assert await store.list_replicas() == []
    await store.delete_node("n1")
    assert await store.list_gpus() == []


async def test_usage_adds_up_per_minute(store: Store) -> None:
    row = {"minute": 60, "key_id": "k", "model": "m", "requests": 1, "prompt_tokens": 10,
           "completion_tokens": 5, "cached_tokens": 2, "errors": 0}
    await store.add_usage([row, row])
    await store.add_usage([row])
    usage = await store.query_usage()
    assert len(usage) == 1
    assert usage[0]["requests"] == 3 and usage[0]["prompt_tokens"] == 30


async def test_concurrent_read_then_write_loses_nothing(store: Store) -> None:
    """16 tasks incrementing one counter by read-then-write: every update lands.

    The failure this guards against: SQLite's default driver transactions
    raise nothing and silently drop most of these updates, and a deferred
    BEGIN fails them with "database is locked".
    """
    await store.set_setting("counter", "0")
    per_task = 15

    async def bump() -> None:
        for _ in range(per_task):
            async with store.transaction() as conn:
                stmt = select(schema.settings.c.value).where(schema.settings.c.key == "counter")
                if not store.is_sqlite:
                    stmt = stmt.with_for_update()
                value = int((await conn.execute(stmt)).scalar_one())
                await asyncio.sleep(0)
                await conn.execute(
                    update(schema.settings)
                    .where(schema.settings.c.key == "counter")
                    .values(value=str(value + 1))
                )

    await asyncio.gather(*(bump() for _ in range(16)))
    assert await store.get_setting("counter") == str(16 * per_task)


async def test_stale_leader_epoch_is_refused(store: Store) -> None:
    first = await store.bump_epoch()
    second = await store.bump_epoch()
    assert second == first + 1
    with pytest.raises(NotLeaderError):
        await store.write_replicas(
            [{"id": "r", "model": "m", "generation": 1, "shards": [], "state": "starting",
              "reason": None, "port": None, "created_at": 0.0, "ready_at": None,
              "last_request_at": None, "draining": False}],
            epoch=first,
        )
    assert await store.list_replicas() == []
    await store.write_replicas(
        [{"id": "r", "model": "m", "generation": 1, "shards": [], "state": "starting",
          "reason": None, "port": None, "created_at": 0.0, "ready_at": None,
          "last_request_at": None, "draining": False}],
        epoch=second,
    )
    assert len(await store.list_replicas()) == 1


async def test_unknown_scheme_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="scheme 'mysql' is not supported"):
        await Store.open("mysql://localhost/x")


async def test_unreachable_postgres_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="cannot open the store"):
        await Store.open("postgresql://postgres@127.0.0.1:1/none")


async def test_sqlite_in_unwritable_place_is_a_config_error(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    target = locked / "sub" / "x.db"
    with pytest.raises(ConfigError):
        await Store.open(f"sqlite:///{target}")
