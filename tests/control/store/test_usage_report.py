"""Store.usage_report: sums per key, model and UTC day, on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from llmgw.control.store.repo import Store


def at(text: str) -> int:
    return int(datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp())


ROWS = [
    # minute, key, model, requests, prompt, completion, cached, errors
    ("2026-10-31T23:59", "ka", "m1", 100, 0, 0, 0, 0),  # before the window
    ("2026-11-01T00:00", "ka", "m1", 3, 30, 12, 5, 0),
    ("2026-11-01T23:59", "kb", "m2", 2, 20, 8, 0, 1),
    ("2026-11-02T00:00", "ka", "m1", 1, 10, 4, 0, 0),
    ("2026-11-02T12:30", "ka", "m2", 4, 40, 16, 10, 2),
    ("2026-11-04T00:00", "kb", "m2", 100, 0, 0, 0, 0),  # at `until`: excluded
]
FIELDS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "errors")


async def fill(store: Store) -> None:
    await store.add_usage([
        {"minute": at(m), "key_id": k, "model": model,
         **dict(zip(FIELDS, counts, strict=True))}
        for m, k, model, *counts in ROWS
    ])


@pytest.mark.parametrize("by, expected", [
    (["day"], [
        {"day_start": at("2026-11-01T00:00"), "requests": 5, "prompt_tokens": 50,
         "completion_tokens": 20, "cached_tokens": 5, "errors": 1},
        {"day_start": at("2026-11-02T00:00"), "requests": 5, "prompt_tokens": 50,
         "completion_tokens": 20, "cached_tokens": 10, "errors": 2},
    ]),
    (["key"], [
        {"key_id": "ka", "requests": 8, "prompt_tokens": 80, "completion_tokens": 32,
         "cached_tokens": 15, "errors": 2},
        {"key_id": "kb", "requests": 2, "prompt_tokens": 20, "completion_tokens": 8,
         "cached_tokens": 0, "errors": 1},
    ]),
    (["day", "model"], [
        {"day_start": at("2026-11-01T00:00"), "model": "m1", "requests": 3, "prompt_tokens": 30,
         "completion_tokens": 12, "cached_tokens": 5, "errors": 0},
        {"day_start": at("2026-11-01T00:00"), "model": "m2", "requests": 2, "prompt_tokens": 20,
         "completion_tokens": 8, "cached_tokens": 0, "errors": 1},
        {"day_start": at("2026-11-02T00:00"), "model": "m1", "requests": 1, "prompt_tokens": 10,
         "completion_tokens": 4, "cached_tokens": 0, "errors": 0},
        {"day_start": at("2026-11-02T00:00"), "model": "m2", "requests": 4, "prompt_tokens": 40,
         "completion_tokens": 16, "cached_tokens": 10, "errors": 2},
    ]),
])
async def test_sums_by_day_key_and_model_within_the_window(
    store: Store, by: list[str], expected: list[dict[str, int | str]]
) -> None:
    await fill(store)
    rows = await store.usage_report(since=at("2026-11-01T00:00"), until=at("2026-11-04T00:00"),
                                    by=by)
    assert all(row.pop("spend_usd") == 0.0 for row in rows)  # no prices here
    assert rows == expected
    assert all(type(v) is int for row in rows for k, v in row.items() if k in FIELDS)


async def test_filters_by_key_and_model(store: Store) -> None:
    await fill(store)
    rows = await store.usage_report(since=0, until=at("2027-01-01T00:00"), by=["model"],
                                    key_id="ka", model="m2")
    assert rows[0].pop("spend_usd") == 0.0
    assert rows == [{"model": "m2", "requests": 4, "prompt_tokens": 40,
                     "completion_tokens": 16, "cached_tokens": 10, "errors": 2}]
