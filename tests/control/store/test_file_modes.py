"""The data dir and the store's files are their owner's only (issue 29).

The store holds the CA's key, the engine-key seed and catalog secrets. A data
dir made by hand or by an older llmgw under a umask of 022 left them readable
by every local user.
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from llmgw.config import ensure_data_dir, sqlite_url
from llmgw.control.store.repo import Store
from llmgw.errors import ConfigError


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def test_an_existing_data_dir_is_tightened_and_the_store_made_private(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    data.chmod(0o755)
    ensure_data_dir(data)
    assert mode(data) == 0o700
    store = await Store.open(sqlite_url(data))
    try:
        await store.set_setting("probe", "x")  # a write: the WAL and its index exist now
        files = [data / name for name in ("llmgw.db", "llmgw.db-wal", "llmgw.db-shm")]
        assert {f.name: mode(f) for f in files} == {f.name: 0o600 for f in files}
    finally:
        await store.close()


async def test_a_store_others_may_read_is_refused_with_what_to_run(tmp_path: Path) -> None:
    store = await Store.open(sqlite_url(tmp_path))
    await store.close()
    database = tmp_path / "llmgw.db"
    database.chmod(0o644)
    with pytest.raises(ConfigError) as refused:
        await Store.open(sqlite_url(tmp_path))
    assert f"chmod 600 {database}" in str(refused.value) and "644" in str(refused.value)
    database.chmod(0o600)
    await (await Store.open(sqlite_url(tmp_path))).close()
