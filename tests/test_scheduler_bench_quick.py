"""The scheduler benchmark (bench/scheduler.py) once, small, with its split.

``--split`` times the pass from empty by wrapping the functions that do
each part (the keeper's refresh, Placer.place, the commit shortfall calls,
Store.write_replicas, decide as the reconciler calls it): a function moved
or renamed would leave its part at zero, or the parts not adding up, and
the figures quoted for issue 16 would stop meaning what they say.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("snapshot", "placement search", "commit to snapshot", "rest of decide",
         "rows and applying", "store write")  # fmt: skip


def test_the_scheduler_bench_times_every_part_of_a_pass_from_empty() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "scheduler.py"), "--quick", "--split",
         "--steady-passes", "1"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["placements_per_s"] > 0
    parts = result["full_pass_parts_ms"]
    for part in PARTS:
        assert parts[part] > 0, (part, parts)
    assert abs(sum(parts[p] for p in PARTS) - parts["total"]) < 0.5, parts
