"""bench/tenancy.py: the worst sliding minute it reports, and its quick run's last line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tests import benchscripts

ROOT = Path(__file__).resolve().parent.parent


def test_the_worst_minute_is_the_most_in_any_60_s() -> None:
    worst_minute = benchscripts.load("tenancy").worst_minute
    assert worst_minute([]) == 0
    assert worst_minute([0.0, 59.9, 60.0, 119.95]) == 2  # [0, 60) holds 0 and 59.9
    assert worst_minute([10.0 + i for i in range(60)] + [69.5, 70.0]) == 61


@pytest.mark.slow
def test_a_quick_run_holds_the_bound_and_says_so_on_its_last_line() -> None:
    # The isolation half is bench/isolation.py's, tested with it.
    done = subprocess.run([sys.executable, "bench/tenancy.py", "--quick", "--no-isolation"],
                          cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 0, done.stdout + done.stderr
    assert last["verdict"] == "pass" and 0 < last["over_admission_ratio"] <= 1.1
    assert last["worst_minute_admitted"] <= 66 and last["gateways"] == 2
    assert last["workers_per_gateway"] == 2 and last["isolation_ttft_p90_ratio"] is None
    assert last["over_admission_verdict"] == "pass"
