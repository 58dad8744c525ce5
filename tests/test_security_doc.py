"""docs/security.md's threat model cites tests that exist (issue 29, item 6).

Each row's claim stands on the test it names; a test renamed or deleted
would leave a claim nothing shows any more.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_test_the_threat_model_cites_exists() -> None:
    doc = (ROOT / "docs" / "security.md").read_text()
    table = doc[doc.index("## Threat model"):doc.index("## Ports")]
    cited = set(re.findall(r"`([\w/]+\.py)::(\w+)`", table))
    assert len(cited) >= 25
    missing = [f"{path}::{name}" for path, name in sorted(cited)
               if not (ROOT / "tests" / path).is_file()
               or not re.search(rf"^(async )?def {name}\(", (ROOT / "tests" / path).read_text(),
                                re.MULTILINE)]
    assert missing == []
