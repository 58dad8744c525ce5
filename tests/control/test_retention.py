"""Events and usage are kept for a configured time, then pruned by the leader (issue 13)."""

from __future__ import annotations

import time

import pytest
from tests.control.planekit import running
from tests.waiting import eventually

from llmgw.control.plane import ControlPlane
from llmgw.control.retention import DAY_S, Retention, prune
from llmgw.control.store import schema
from llmgw.control.store.repo import Store
from llmgw.errors import ConfigError


def _usage(minute: int) -> dict[str, object]:
    return {"minute": minute, "key_id": "k", "model": "m", "requests": 1, "prompt_tokens": 1,
            "completion_tokens": 1, "cached_tokens": 0, "errors": 0}


async def _fill(store: Store, now: float) -> None:
    await store.add_events([
        {"at": now - age * DAY_S, "kind": "node", "subject": "n", "message": f"{age} days",
         "data": {}} for age in (0, 29, 31, 400)])
    await store.add_usage([_usage(int(now - age * DAY_S) // 60 * 60) for age in (0, 399, 401)])


async def test_prune_keeps_what_is_younger_than_the_retention(store: Store) -> None:
    now = time.time()
    await _fill(store, now)
    assert await prune(store, Retention(), now) == (2, 1)
    assert sorted(e["message"] for e in await store.list_events()) == ["0 days", "29 days"]
    assert len(await store.query_usage(since=0)) == 2
    assert await prune(store, Retention(), now) == (0, 0)  # idempotent
    # Zero keeps a table forever.
    assert await prune(store, Retention(events_days=0, usage_days=0), now + 1000 * DAY_S) == (0, 0)
    assert await store.count(schema.events) == 2


def test_retention_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="events_days must be >= 0"):
        Retention(events_days=-1)
    with pytest.raises(ConfigError, match="interval"):
        Retention(every_s=0)


async def test_the_leader_prunes_periodically(cp: ControlPlane) -> None:
    store = cp.store
    await _fill(store, time.time())
    async with running(cp, retention=Retention(events_days=1, every_s=0.1)):
        assert cp.is_leader

        async def pruned() -> bool:
            return len(await store.query_usage(since=0)) == 2

        await eventually(pruned, 5, "the leader's prune")
        messages = {e["message"] for e in await store.list_events()}
        assert "0 days" in messages and "29 days" not in messages and "400 days" not in messages
        assert len(await store.query_usage(since=0)) == 2
