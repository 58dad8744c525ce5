"""The cold-start benchmark (bench/coldstart.py) once, on the simulated engine.

The bench times each step by wrapping the functions that do it inside
`llmgw up`; a refactor that moved one of them (the control plane's split
into services moved ``demand``; the gateway's own server stopped calling
``Gateway.__call__`` for /v1) broke it without any test noticing. Here it
runs end to end, as a user runs it, and every part must have been timed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
    # The parts add up to the whole (each is a difference of the same clock).
    whole = sum(sim[p] for p in ("control_plane_ms", "agent_ms", "engine_start_ms",
                                 "gateway_hold_ms", "engine_first_token_ms"))  # fmt: skip
    assert abs(whole - sim["total_ms"]) < 1.0, sim
    assert result["llmgw_overhead_ms"] == sim["llmgw_overhead_ms"] > 0
