"""``llmgw ctl usage --since --until --by --csv`` against a real ``llmgw serve``.

The serve process runs on a SQLite store into which usage rows of known
minutes are written (the way the gateway's batches land there), across UTC
day boundaries and just outside the window; the report must sum them
exactly, the CSV must be the bytes the console downloads, and a key name
that a spreadsheet would run as a formula must come out inert.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from tests.servers import free_port, up_json
from tests.waiting import eventually_sync
from typer.testing import CliRunner, Result

from llmgw.cli.ctl import app
from llmgw.config import sqlite_url
from llmgw.control.store.repo import Store

LLMGW = str(Path(sys.executable).with_name("llmgw"))
FORMULA_NAME = '=HYPERLINK("http://evil.example","click")'
FIELDS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "errors")


def at(text: str) -> int:
    return int(datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp())


@dataclass
class Serve:
    url: str
    token: str
    keys: dict[str, str]  # name -> key id


def usage_rows(a: str, b: str) -> list[dict[str, object]]:
    rows = [
        ("2026-10-31T23:59", a, "m1", 100, 0, 0, 0, 0),  # before --since
        ("2026-11-01T00:00", a, "m1", 3, 30, 12, 5, 0),
        ("2026-11-01T23:59", b, "m2", 2, 20, 8, 0, 1),
        ("2026-11-02T00:00", a, "m1", 1, 10, 4, 0, 0),
        ("2026-11-02T12:30", a, "m2", 4, 40, 16, 10, 2),
        ("2026-11-04T00:00", b, "m2", 100, 0, 0, 0, 0),  # at --until: excluded
    ]
    return [{"minute": at(m), "key_id": k, "model": model, **dict(zip(FIELDS, c, strict=True))}
            for m, k, model, *c in rows]


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    data = tmp_path_factory.mktemp("usage-serve")
    port = free_port()
    log = (data / "serve.log").open("w")
    proc = subprocess.Popen(
        [LLMGW, "serve", "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(data)],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        info = eventually_sync(lambda: up_json(data, proc.poll(), data / "serve.log"), 60,
                               what="serve's up.json", every_s=0.1)  # fmt: skip
        url, token = info["admin_url"], info["admin_token"]
        keys = {}
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"},
                          timeout=10) as api:
            for name in ("team-a", FORMULA_NAME):
                created = api.post("/admin/v1/keys", json={"name": name})
                assert created.status_code == 201, created.text
                keys[name] = created.json()["key"]["key_id"]

        async def write_usage() -> None:
            # Beside the running serve, as its gateway's batches are written.
            store = await Store.open(sqlite_url(data), migrate=False)
            try:
                await store.add_usage(usage_rows(keys["team-a"], keys[FORMULA_NAME]))
            finally:
                await store.close()

        asyncio.run(write_usage())
        yield Serve(url, token, keys)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def ctl(serve: Serve, *args: str) -> Result:
    env: dict[str, str | None] = {"COLUMNS": "200", "LLMGW_DATA_DIR": "/nonexistent-llmgw",
                                  "LLMGW_URL": None, "LLMGW_ADMIN_TOKEN": serve.token}
    return CliRunner().invoke(app, ["--url", serve.url, "usage", *args], env=env)


def ok(result: Result) -> str:
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    return result.stdout


WINDOW = ("--since", "2026-11-01", "--until", "2026-11-04")


def test_csv_by_day_from_the_real_command_is_the_consoles_download(serve: Serve) -> None:
    done = subprocess.run(
        [LLMGW, "ctl", "--url", serve.url, "usage", *WINDOW, "--by", "day", "--csv"],
        capture_output=True, timeout=60,
        env={**os.environ, "LLMGW_ADMIN_TOKEN": serve.token, "COLUMNS": "40"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode() == (
        "day,requests,prompt_tokens,completion_tokens,cached_tokens,errors,spend_usd\r\n"
        "2026-11-01,5,50,20,5,1,0.0\r\n"
        "2026-11-02,5,50,20,10,2,0.0\r\n")
    download = httpx.get(
        f"{serve.url}/admin/v1/usage/report",
        params={"since": at("2026-11-01T00:00"), "until": at("2026-11-04T00:00"), "by": "day",
                "format": "csv"},
        headers={"Authorization": f"Bearer {serve.token}"})
    assert download.content == done.stdout
    assert download.headers["content-type"].startswith("text/csv")
    assert download.headers["content-disposition"] == (
        'attachment; filename="llmgw-usage-20261101T0000Z-20261104T0000Z-by-day.csv"')


def test_csv_by_key_names_keys_and_defuses_formulas(serve: Serve) -> None:
    rows = list(csv.DictReader(io.StringIO(ok(ctl(serve, *WINDOW, "--by", "key", "--csv")))))
    by_id = {r["key_id"]: r for r in rows}
    assert by_id[serve.keys["team-a"]]["key_name"] == "team-a"
    assert by_id[serve.keys["team-a"]]["requests"] == "8"
    formula = by_id[serve.keys[FORMULA_NAME]]
    assert formula["key_name"] == "'" + FORMULA_NAME and formula["errors"] == "1"
    report = json.loads(ok(ctl(serve, *WINDOW, "--by", "key", "--json")))
    assert sum(int(r["requests"]) for r in rows) == report["total"]["requests"] == 10


def test_table_by_day_and_model_with_a_total(serve: Serve) -> None:
    out = ok(ctl(serve, *WINDOW, "--by", "day,model"))
    lines = [line.split() for line in out.splitlines()]
    assert ["2026-11-02", "m2", "4", "40", "16", "10", "2", "0.0000"] in lines
    assert ["total", "10", "100", "40", "15", "3", "0.0000"] in lines
    only = json.loads(ok(ctl(serve, *WINDOW, "--by", "model", "--model", "m1", "--json")))
    assert [(r["model"], r["requests"]) for r in only["rows"]] == [("m1", 4)]


def test_ages_and_unix_seconds(serve: Serve) -> None:
    # Nothing was used in the last week; the window is still honoured.
    assert json.loads(ok(ctl(serve, "--since", "7d", "--by", "day", "--json")))["rows"] == []
    since, until = str(at("2026-11-02T00:00")), str(at("2026-11-02T12:30"))
    data = json.loads(ok(ctl(serve, "--since", since, "--until", until, "--by", "model",
                             "--json")))
    assert [(r["model"], r["requests"]) for r in data["rows"]] == [("m1", 1)]


@pytest.mark.parametrize("args, says", [
    (("--by", "week"), "'week' is not one of team, key, model, day"),
    (("--since", "last tuesday"), "--since 'last tuesday': give a date"),
    (("--since", "2026-11-04", "--until", "2026-11-01"), "until must be after since"),
    (("--by", "day", "--per-minute"), "--per-minute is for the recent view"),
])
def test_mistakes_are_one_line(serve: Serve, args: tuple[str, ...], says: str) -> None:
    result = ctl(serve, *args)
    assert result.exit_code == 1, result.stdout
    assert result.stderr.strip().startswith("llmgw ctl: ") and says in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
