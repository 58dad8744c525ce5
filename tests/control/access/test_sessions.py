"""Console sessions: only hashes kept, expiry, a bound on their number."""

from __future__ import annotations

from llmgw import secrets
from llmgw.control.access.roles import ADMIN_TOKEN
from llmgw.control.access.sessions import SecretTable


def test_only_the_hash_is_kept_and_entries_expire() -> None:
    now = [1000.0]
    table: SecretTable[object] = SecretTable(60.0, 10, clock=lambda: now[0])
    secret, expires = table.add(ADMIN_TOKEN)
    assert expires == 1060.0
    assert secret not in repr(table._rows) and secrets.hash_secret(secret) in table._rows
    assert table.get(secret) is ADMIN_TOKEN
    assert table.get(secret + "x") is None and table.get(None) is None
    now[0] = 1060.0
    assert table.get(secret) is None and len(table) == 0


def test_pop_uses_an_entry_once_and_the_table_is_bounded() -> None:
    table: SecretTable[int] = SecretTable(60.0, 3)
    first, _ = table.add(1)
    made = [table.add(n)[0] for n in range(2, 6)]
    assert len(table) == 3 and table.get(first) is None  # the oldest went first
    assert table.pop(made[-1]) == 5 and table.pop(made[-1]) is None
