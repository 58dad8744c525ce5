"""Database URLs as operators write them, multi-host (Patroni) ones included."""

from __future__ import annotations

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from llmgw.control.leader import _libpq_url
from llmgw.control.store.db import libpq_conninfo, normalise_url
from llmgw.control.store.repo import Store
from llmgw.errors import ConfigError

PATRONI_URL = ("postgresql://llmgw:s3cret@db1:5432,db2:5433,db3:5434/llmgw"
               "?target_session_attrs=read-write&connect_timeout=2")


def test_libpq_multi_host_form_keeps_every_host_port_and_option() -> None:
    params = conninfo_to_dict(libpq_conninfo(normalise_url(PATRONI_URL)))
    assert params == {"host": "db1,db2,db3", "port": "5432,5433,5434", "dbname": "llmgw",
                      "user": "llmgw", "password": "s3cret",
                      "target_session_attrs": "read-write", "connect_timeout": "2"}


def test_sqlalchemy_multi_host_form_and_hosts_without_ports() -> None:
    spelled = normalise_url("postgresql://u@/db?host=a:1&host=b:2&target_session_attrs=read-write")
    assert conninfo_to_dict(libpq_conninfo(spelled))["port"] == "1,2"
    bare = conninfo_to_dict(libpq_conninfo("postgresql://u@a,b,c/db"))
    assert bare["host"] == "a,b,c" and bare.get("port", "").strip(",") == ""


def test_the_leader_lock_connects_to_every_host_not_the_last() -> None:
    # The election's own connection (not the pool) must follow a failover too.
    params = conninfo_to_dict(_libpq_url(normalise_url(PATRONI_URL)))
    assert (params["host"], params["port"]) == ("db1,db2,db3", "5432,5433,5434")
    assert params["target_session_attrs"] == "read-write"


def test_a_single_host_url_is_unchanged() -> None:
    url = "postgresql://postgres@127.0.0.1:5432/test"
    assert normalise_url(url) == "postgresql+psycopg://postgres@127.0.0.1:5432/test"
    assert conninfo_to_dict(libpq_conninfo(url)) == {
        "host": "127.0.0.1", "port": "5432", "dbname": "test", "user": "postgres"}


def test_hosts_given_twice_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="names hosts twice"):
        normalise_url("postgresql://u@a:1,b:2/db?host=c")


async def test_a_multi_host_url_opens_past_a_dead_host(pg_database_url: str) -> None:
    # The first host refuses connections, as a dead member does: libpq moves on.
    dead = psycopg.conninfo.conninfo_to_dict(libpq_conninfo(pg_database_url))
    host, port = dead["host"], dead["port"]
    url = pg_database_url.replace(f"@{host}:{port}/", f"@{host}:1,{host}:{port}/")
    assert url != pg_database_url
    store = await Store.open(url + "?target_session_attrs=read-write&connect_timeout=2")
    try:
        async with store.engine.connect() as conn:
            assert (await conn.exec_driver_sql("SELECT 1")).scalar() == 1
    finally:
        await store.close()
