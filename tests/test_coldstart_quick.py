"""The cold-start benchmark (bench/coldstart.py) once, on the simulated engine.

The bench times each step by wrapping the functions that do it inside
`llmgw up`; a refactor that moved one of them (the control plane's split
into services moved ``demand``; the gateway's own server stopped calling
``Gateway.__call__`` for /v1) broke it without any test noticing. Here it
runs end to end, as a user runs it, and every part must have been timed.
The parts add up to the whole by construction (differences of one clock);
what can go wrong is a step recorded at the wrong moment, so the engine's
start is held to the simulated engine's own start-up delay, and the parts
are computed from a made-up timeline whose figures are known.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tests import benchscripts

from llmgw.wire.catalog import SimParams

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("control_plane_ms", "agent_ms", "engine_start_ms", "gateway_hold_ms",
         "engine_first_token_ms", "request_to_gateway_ms", "cp_demand_to_placed_ms")  # fmt: skip


def test_the_cold_start_bench_times_every_part_on_the_simulated_engine() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "coldstart.py"), "--runs", "1", "--engines", "sim"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    sim = result["sim"]
    for part in PARTS:
        assert sim[part] is not None and sim[part] >= 0, (part, sim)
    # The simulated engine answers its health check only after its start-up
    # delay: an engine start shorter than that timed the wrong steps.
    assert sim["engine_start_ms"] >= 1000 * SimParams().startup_s, sim
    assert result["llmgw_overhead_ms"] == sim["llmgw_overhead_ms"] > 0


def _timeline(**moved: float) -> list[dict[str, Any]]:
    steps = {"gateway_request": 10.001, "gateway_demand": 10.003, "cp_demand": 10.004,
             "placed": 10.010, "agent_told": 10.020, "spawned": 10.030, "engine_ready": 10.540,
             "agent_ready": 10.545, "routing": 10.550, "gateway_wake": 10.560, **moved}
    extra = {"placed": {"replica": "r1", "model": "m"}, "agent_told": {"replica": "r1"},
             "spawned": {"replica": "r1"}, "engine_ready": {"replica": "r1"},
             "agent_ready": {"replica": "r1"}, "gateway_demand": {"model": "m"},
             "cp_demand": {"model": "m"}, "gateway_wake": {"models": ["m"]}}
    return sorted(({"step": step, "t": t, **extra.get(step, {})} for step, t in steps.items()),
                  key=lambda e: e["t"])


def test_the_parts_of_a_known_timeline() -> None:
    coldstart = benchscripts.load("coldstart")
    got = coldstart.parts(_timeline(), "m", sent=10.000, token=10.600)
    expected = {"control_plane_ms": 17, "agent_ms": 10, "engine_start_ms": 510,
                "gateway_hold_ms": 3 + 20, "engine_first_token_ms": 40, "total_ms": 600,
                "llmgw_overhead_ms": 17 + 10 + 23}  # fmt: skip
    assert {k: round(got[k], 3) for k in expected} == expected


def test_a_step_out_of_order_is_refused() -> None:
    # The engine said ready before its process was started: no figure from that.
    with pytest.raises(SystemExit, match="no engine_ready"):
        benchscripts.load("coldstart").parts(_timeline(engine_ready=10.025), "m",
                                             sent=10.000, token=10.600)
