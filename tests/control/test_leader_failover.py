"""Leader failover between two `llmgw serve` processes on one PostgreSQL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from tests.servers import free_port, stop_group
from tests.waiting import eventually_sync


def start_serve(tmp_path: Path, name: str, database_url: str) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmgw.cli.main", "serve", "--host", "127.0.0.1",
         "--port", str(port), "--data-dir", str(tmp_path / name), "--database-url", database_url],
        stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    return proc, f"http://127.0.0.1:{port}"


def health(url: str) -> dict[str, object] | None:
    try:
        answer = httpx.get(f"{url}/healthz", timeout=1)
    except httpx.HTTPError:
        return None
    return dict(answer.json()) if answer.status_code == 200 else None


def test_standby_takes_over_when_the_leader_dies(tmp_path: Path, pg_database_url: str) -> None:
    first, first_url = start_serve(tmp_path, "first", pg_database_url)
    second: subprocess.Popen[str] | None = None
    try:
        eventually_sync(lambda: (health(first_url) or {}).get("leader") is True, 30,
                        "the first instance to lead", every_s=0.2,
                        note=lambda: (tmp_path / "first.log").read_text())
        second, second_url = start_serve(tmp_path, "second", pg_database_url)
        eventually_sync(lambda: health(second_url), 30, "the second instance to answer",
                        every_s=0.2)
        # A while answering beside a live leader: it must not have taken over.
        time.sleep(1.5)
        # Hot standby: up and answering, but not reconciling.
        assert (health(second_url) or {}).get("leader") is False
        epoch_before = int((health(first_url) or {})["epoch"])  # type: ignore[call-overload]

        os.killpg(first.pid, signal.SIGKILL)
        first.wait(10)
        started = time.monotonic()
        eventually_sync(lambda: (health(second_url) or {}).get("leader") is True, 20,
                        "the standby to take over", every_s=0.2,
                        note=lambda: (tmp_path / "second.log").read_text())
        took = time.monotonic() - started
        state = health(second_url) or {}
        assert int(state["epoch"]) > epoch_before  # type: ignore[call-overload]
        assert took < 15
    finally:
        for proc in (first, second):
            if proc is not None:
                stop_group(proc)
