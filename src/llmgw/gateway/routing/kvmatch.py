"""A prompt matched against the replicas' exact caches (routing.kvcache), in the estimate's units.

The prefix policy weighs holders in blocks of characters (the estimated
index's unit); replicas whose KV-cache events are followed hold token
blocks. :func:`exact_matches` puts the exact holdings into the estimate's
``matched`` so that one SoonestStart weighs both kinds alike.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmgw.gateway.routing.kvcache import token_block_hashes
from llmgw.gateway.routing.replica import Replica


def exact_matches(
    replicas: Sequence[Replica], matched: dict[str, int], tokens: Sequence[int],
    per_block: float, first_block: int, now: float,
) -> dict[str, int]:  # fmt: skip
    """``matched`` with each followed replica's entry read from its events instead.

    A replica's exact depth (full token blocks it holds from the first) is
    turned into blocks of characters at ``per_block`` (the measured
    characters per token over the characters of a block). Replicas whose
    events are not live keep the estimate, and so does a replica computing
    a prompt with this ``first_block`` (the index's) at ``now``
    (Replica.claims) where the estimate says it holds more: its engine
    publishes the blocks once computed, and until then the events read as
    if nobody held the prefix. A second prompt of a group sent meanwhile
    then went elsewhere and computed it again (bench/routing_real.py
    --engine vllm), where the estimate sends it to the replica computing it.
    """
    keys: dict[int, list[int]] = {}  # per block size, computed once
    for replica in replicas:
        exact = replica.exact
        if exact is None or not exact.live:
            continue
        blocks = 0
        if exact.blocks:  # (its block size unknown until it stores one)
            size = exact.block_size
            hashes = keys.get(size)
            if hashes is None:
                # The last token is always computed (vLLM's hit stops before it).
                hashes = keys[size] = token_block_hashes(tokens[: len(tokens) - 1], size)
            depth = exact.depth(hashes)
            if depth:
                blocks = max(1, round(depth * size * per_block))
        if replica.claims and replica.claims.get(first_block, 0.0) > now:
            blocks = max(blocks, matched.get(replica.replica_id, 0))
        if blocks:
            matched[replica.replica_id] = blocks
        else:
            matched.pop(replica.replica_id, None)
    return matched
