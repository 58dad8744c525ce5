"""No asyncio.wait_for in llmgw: asyncio.timeout instead.

On Python 3.11 (the oldest llmgw runs on), wait_for returns normally when
the awaited thing completes in the loop turn that cancels the waiter: the
cancel is lost. In a loop that runs until stopped, the loop then goes round
again and the stop waits on it for ever. It hung a reconcile loop
(tests/control/test_wakeup_cancel.py), the leader election's liveness
query (a serve on PostgreSQL ignoring SIGTERM) and the gateways' config
watch (tests/control/test_watch_cancel.py). ``asyncio.timeout`` keeps the
cancel.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "llmgw"


def test_no_module_calls_asyncio_wait_for() -> None:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "wait_for"
                and isinstance(node.value, ast.Name)
                and node.value.id == "asyncio"
            ) or (
                isinstance(node, ast.ImportFrom)
                and node.module == "asyncio"
                and any(alias.name == "wait_for" for alias in node.names)
            ):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert found == [], f"asyncio.wait_for (use asyncio.timeout): {found}"
