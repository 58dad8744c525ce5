"""Per-replica engine keys: the gateway, and nothing else, talks to an engine.

Each replica's key is HMAC-SHA256 of its id under one fleet-wide seed, so it is
known the moment the replica is placed (before its engine starts), every
control-plane instance derives the same one (a standby that takes over hands
out the keys its predecessor did), and it survives restarts of the control
plane and of the agent (which adopts its running engines under the keys they
were started with) without a column per replica. Keys of different replicas
are unrelated to whoever holds one of them: learning a replica's key from its
node tells nothing about another node's engines.

The seed is stored in the clear (``settings``), unlike the credentials the
control plane checks, which it stores as hashes: the control plane must hand
each key out (to the node that starts the engine, to the gateways that call
it), so it needs what makes them. Whoever reads the store can therefore reach
every engine; the catalog's ``env`` values (``HF_TOKEN``) are stored the same
way for the same reason (docs/security.md).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets as _random

from llmgw.control.store.repo import Store

SETTING = "engine_key_seed"
# Derived keys kept at most (a fleet's replicas, with room to spare).
_KEPT = 200_000


class EngineKeys:
    """Derives each replica's engine key from the fleet's seed."""

    __slots__ = ("_keys", "_seed")

    def __init__(self, seed: bytes | None = None) -> None:
        # Without a stored seed (a control plane that never loaded its store:
        # tests, benchmarks) keys are still random, for this process's life.
        self._seed = seed if seed is not None else _random.token_bytes(32)
        # Keys already derived, by replica id: every agent report's answer and
        # every routing table carries them, and an HMAC each time was a tenth
        # of answering a report. Holding them is no more than holding the seed.
        self._keys: dict[str, str] = {}

    @classmethod
    async def load(cls, store: Store) -> EngineKeys:
        """The stored seed, made on first use (the first instance to write it wins)."""
        fresh = _random.token_bytes(32).hex()
        await store.set_setting_if_absent(SETTING, fresh)
        stored = await store.get_setting(SETTING)
        return cls(bytes.fromhex(stored or fresh))

    def key(self, replica_id: str) -> str:
        """The engine key of ``replica_id``: 43 URL-safe characters (256 bits)."""
        found = self._keys.get(replica_id)
        if found is None:
            if len(self._keys) >= _KEPT:
                self._keys.clear()
            mac = hmac.new(self._seed, b"llmgw-engine-key\x00" + replica_id.encode(),
                           hashlib.sha256)
            found = base64.urlsafe_b64encode(mac.digest()).rstrip(b"=").decode("ascii")
            self._keys[replica_id] = found
        return found
