"""The one interface every routing policy implements, and what a choice is (:class:`Pick`).

A model's catalog entry names its policy (``wire.ModelRoute.routing``); the
router (:mod:`llmgw.gateway.routing.router`) builds it once per config
version and asks it only when there is a choice to make: the candidates
are already narrowed to replicas that may take the request (not excluded,
not cooling down), and a lone candidate is taken without asking a policy
that does not read the prompt.

A policy that reads the prompt (:attr:`Policy.reads_prompt`) also learns
from what happens after its choice: the forwarding loop tells it when the
request was sent (:meth:`Policy.record`), how soon the replica's answer
started (:meth:`Policy.measured`) and what the engine's usage said of the
prompt (:meth:`Policy.metered`).
The others learn nothing, and those calls never reach them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llmgw.gateway.routing.replica import Replica

# Prefix-routing outcomes, as exported in metrics.
HIT = "hit"  # a replica holding the longest cached prefix chosen
MISS = "miss"  # no replica holds any of it: rendezvous on the first block
OVERLOADED = "overloaded"  # a replica holds it, but another was estimated to answer sooner
UNROUTED = "none"  # prefixes not looked at (round-robin, least-loaded, no prompt, one replica)


@dataclass(slots=True)
class Pick:
    replica: Replica
    outcome: str
    hashes: list[int]
    uncached_tokens: float
    # A prompt routed by prefix whose hashes were left for record to compute
    # (None: routed without its prompt, or its hashes are already here).
    prompt: str | None = None
    # Its length, for what the engine's usage says of it (0: not routed by prefix).
    prompt_chars: int = 0

    @property
    def by_prefix(self) -> bool:
        """Whether the pick read the prompt: then its answer is recorded and timed."""
        return bool(self.hashes) or self.prompt is not None


class Policy:
    """How one model's replica is chosen among its candidates.

    Built once per config version and model; long-lived state (a prefix
    index, a measured speed) is handed to it by the snapshot, which carries
    it across versions.
    """

    __slots__ = ()

    # Whether choose looks at the prompt: callers render it only then.
    reads_prompt = False

    def choose(
        self, replicas: Sequence[Replica], prompt: str | None, turn: int,
        tokens: Sequence[int] | None = None,
    ) -> Pick:  # fmt: skip
        """A replica among ``replicas`` (at least one) for a request with ``prompt``.

        ``turn`` counts the model's picks, for a policy that rotates;
        ``tokens``: the prompt as the engines tokenise it, where replicas
        publish their caches (Replica.exact) and it could be had.
        """
        raise NotImplementedError

    def record(self, pick: Pick) -> None:
        """The pick was sent to its replica: the prompt's prefix is counted as its from now on."""

    def measured(self, tokens: float, seconds: float) -> None:
        """A replica answered a prefill of ``tokens`` uncached prompt tokens in ``seconds``."""

    def metered(
        self, pick: Pick, prompt_tokens: int, cached_tokens: int, computed_s: float | None = None
    ) -> None:
        """The engine's count of the pick's prompt tokens, and of those it found cached;
        ``computed_s``: how long its prefill took, where the gateway could time it alone."""
