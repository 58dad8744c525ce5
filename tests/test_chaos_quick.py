"""The chaos suite's CI subset: a few faults of bench/chaos.py, run as `make chaos` runs them.

Real processes on loopback (serve leader and standby on PostgreSQL, a
standalone gateway, agents with simulated and llama.cpp engines), steady
load with the official openai client. Each fault must pass the suite's own
verdict (bench/chaoskit/verdict.py: every failure explained by a replica it
killed, the fleet whole again, answers after the fault, no store row lost),
which the suite's exit code says. The whole suite (Patroni, the 30 s graces of node loss
and a stopped agent, a leader's outage watched for a grace, a full disk)
is too long for CI: `make chaos`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tests.conftest import PG_URL

pytestmark = [pytest.mark.slow, pytest.mark.timeout(660)]

ROOT = Path(__file__).resolve().parent.parent
FAULTS = ["engine_kill", "agent_restart", "slow_clients"]


def test_faults_cost_no_unexcused_request_and_no_row(test_output: Path) -> None:
    log = test_output / "chaos-quick.log"
    with log.open("wb") as out:
        done = subprocess.run(
            [sys.executable, str(ROOT / "bench" / "chaos.py"), "--quick",
             "--faults", ",".join(FAULTS), "--pg-url", PG_URL],
            stdout=out, stderr=subprocess.STDOUT, timeout=600, cwd=ROOT,
        )
    text = log.read_text()
    assert done.returncode == 0, text[-4000:]
    result = json.loads(text.strip().splitlines()[-1])
    figures = result["faults"]
    assert result["ok"] and sorted(figures) == sorted(FAULTS), text[-4000:]
    for name, fault in figures.items():
        assert fault["ok"] and "skipped" not in fault, (name, fault, text[-4000:])
        assert fault["sent"] > 50, (name, fault)
        assert fault["failed_unexcused"] == 0, (name, fault, text[-4000:])
        assert fault["recovery_s"] is not None, (name, fault, text[-4000:])
        assert fault["rows_lost"] == {"catalog": 0, "keys": 0, "events": 0, "usage": 0,
                                      "usage_extra": 0}, (name, fault)
    # Nothing killed mid-answer there: not one request may fail.
    for name in ("agent_restart", "slow_clients"):
        assert figures[name]["failed"] == 0, (name, figures[name], text[-4000:])
