"""The scheduler benchmark (bench/scheduler.py) once, small, with its split.

``--split`` times the pass from empty by wrapping the functions that do
each part (the keeper's refresh, Placer.place, the commit shortfall calls,
Store.write_replicas, decide as the reconciler calls it): a function moved
or renamed would leave its part at zero, or one no longer inside its caller
would make a rest negative, and the figures quoted for issue 16 would stop
meaning what they say; the bench refuses such a split (split_of, fed made-up
timings here). The parts add up to the split's total by construction; what
can disagree is that total and the pass measured without wrappers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tests import benchscripts

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
    # The same pass from empty on the same fleet, once wrapped and once not:
    # a split that timed something else than the pass would disagree.
    assert 0.4 <= parts["total"] / result["full_pass_ms"] <= 2.5, (parts, result)


TIMED = {"snapshot": 0.010, "placement search": 0.050, "commit to snapshot": 0.005,
         "decide": 0.080, "store write": 0.030}  # fmt: skip


def test_the_split_of_a_pass_whose_timed_parts_nest() -> None:
    split = benchscripts.load("scheduler").split_of(TIMED, 0.150)
    assert split == {"snapshot": 10.0, "placement search": 50.0, "commit to snapshot": 5.0,
                     "rest of decide": 15.0, "rows and applying": 40.0, "store write": 30.0,
                     "total": 150.0}  # fmt: skip


@pytest.mark.parametrize("changes, total", [
    ({"placement search": 0.0}, 0.150),  # Placer.place renamed: never timed
    ({"snapshot": 0.040}, 0.150),  # the refresh moved out of decide: more inside than decide
    ({"store write": 0.090}, 0.150),  # the write counted twice (a wrapped call in a wrapped call)
])  # fmt: skip
def test_a_split_that_does_not_hold_is_refused(changes: dict[str, float], total: float) -> None:
    with pytest.raises(ValueError, match="the split does not hold"):
        benchscripts.load("scheduler").split_of({**TIMED, **changes}, total)
