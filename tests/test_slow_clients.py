"""One address holding thousands of slow connections locks nobody else out (docs/security.md).

A real ``llmgw serve`` (control plane and gateway on one port) on
127.0.0.1; an attacker on 127.0.0.2 keeps 6,000 unauthenticated connections
going, each sending a byte of a request head every few seconds and opening
again whenever the server closes it. Meanwhile a client on 127.0.0.1 must
get ``/healthz`` and an admin API answer, each within 1 s. Before the
per-address cap, the attacker's connections filled the server's 4,096
slots and everyone else got 503 (checked: with the cap turned off,
``LLMGW_MAX_CONNECTIONS_PER_ADDRESS=0``, this test fails).

The test process holds 6,000 sockets: it raises its own RLIMIT_NOFILE (the
server, with the cap, holds ~600 descriptors).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.servers import ROOT, free_port, stop_group, wait_up_json
from tests.slowclients import Attack, percentile, raise_fd_limit

ATTACKERS = 6000
PROBE_S = 12.0


def _serve(tmp_path: Path, port: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "llmgw.cli.main", "serve", "--host", "127.0.0.1",
             "--port", str(port), "--data-dir", str(tmp_path / "data")],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip


@pytest.mark.slow
async def test_healthz_and_admin_api_answer_while_another_address_holds_6000_slow_connections(
    tmp_path: Path, test_output: Path,
) -> None:
    if raise_fd_limit(ATTACKERS + 1500) < ATTACKERS + 1000:
        pytest.fail("RLIMIT_NOFILE's hard limit is under 7,000: raise it (ulimit -Hn)")
    port = free_port()
    proc = _serve(tmp_path, port, {**os.environ, "PYTHONUNBUFFERED": "1"})
    attack = Attack("127.0.0.2", "127.0.0.1", port, ATTACKERS)
    try:
        info = wait_up_json(proc, tmp_path / "data", tmp_path / "serve.log")
        token = str(info["admin_token"])
        attack.start()
        async with asyncio.timeout(60):
            await attack.all_opened.wait()
        prober = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.slowclients", "127.0.0.1", str(port), token,
            str(PROBE_S), stdout=asyncio.subprocess.PIPE, cwd=ROOT)
        out, _ = await asyncio.wait_for(prober.communicate(), PROBE_S + 30)
        probed = json.loads(out)
        health, admin, statuses = probed["healthz"], probed["admin"], probed["statuses"]
        held = attack.open_now
    finally:
        await attack.stop()
        stop_group(proc)
    figures = {
        "attacking_connections": ATTACKERS, "opened_all_told": attack.opened,
        "closed_by_server": attack.closed_by_server, "open_at_end": held,
        "probes": len(health),
        "healthz_s": {"p50": percentile(health, 0.5), "p99": percentile(health, 0.99),
                      "max": max(health)},
        "admin_s": {"p50": percentile(admin, 0.5), "p99": percentile(admin, 0.99),
                    "max": max(admin)},
    }  # fmt: skip
    (test_output / "slow_clients.json").write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures))
    assert set(statuses) == {200}, f"answers other than 200: {sorted(set(statuses))} {figures}"
    assert max(health) < 1.0 and max(admin) < 1.0, figures
