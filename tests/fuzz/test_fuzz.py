"""Each fuzz target for a few seconds (bench/fuzz.py runs them longer): nothing found.

``LLMGW_FUZZ_SECONDS`` sets the time per target (default 5: about 100 s for
all of them on two cores, servers' start included). A finding fails with its first examples.
"""

from __future__ import annotations

import os

import pytest
from tests.fuzz.runner import Target, run
from tests.fuzz.targets import ALL

SECONDS = float(os.environ.get("LLMGW_FUZZ_SECONDS", "5"))


@pytest.mark.parametrize("target", ALL, ids=[t.name for t in ALL])
def test_fuzz_target_finds_nothing(target: Target) -> None:
    stats = run(target, SECONDS)
    assert stats.cases > 0, f"{target.name} ran no case"
    assert stats.clean, f"{target.name}: {stats.as_dict()}"
