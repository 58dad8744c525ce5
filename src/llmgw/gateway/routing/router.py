"""One model's router for one config version: the candidates, and the policy asked among them.

:class:`ModelRouter` is built once per config version and model (by the
snapshot). It decides which replicas may take a request (not excluded, not
cooling down), answers the cases that leave no choice itself, and asks the
model's policy (:mod:`llmgw.gateway.routing.policy`) for the rest; what
the answer later teaches the policy goes through here too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from llmgw import wire
from llmgw.gateway.routing.leastloaded import LeastLoaded
from llmgw.gateway.routing.measured import PrefillSpeed, low_load_share
from llmgw.gateway.routing.policy import UNROUTED, Pick, Policy
from llmgw.gateway.routing.prefix import PrefixPolicy, SoonestStart
from llmgw.gateway.routing.prefixindex import PrefixIndex
from llmgw.gateway.routing.replica import Replica
from llmgw.gateway.routing.roundrobin import RoundRobin


class ModelRouter:
    """Routing state of one model for one config version."""

    __slots__ = ("_counter", "clock", "policy", "publishing", "replicas", "route", "wants_prompt")

    def __init__(
        self,
        route: wire.ModelRoute,
        replicas: list[Replica],
        index: PrefixIndex,
        speed: PrefillSpeed,
        *,
        block_chars: int,
        chars_per_token: float,
        tokens_per_unit: float,
        ttft_slack_s: float,
        wait_ratio: float,
        spread: float,
        gateways: int,
        copy_cost: float = 0.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``gateways``: how many route with this table (the control plane's
        count, this one among them; 0: not known yet); ``clock``: what the queued prefill is
        timed by (Prefill, the prefix policy's estimate), simulated time in
        bench/routing_replay.py."""
        self.route = route
        self.replicas = replicas
        self.clock = clock
        self.policy: Policy
        if route.routing == "round-robin":
            self.policy = RoundRobin()
        elif route.routing == "least-loaded":
            self.policy = LeastLoaded(tokens_per_unit)
        else:
            soonest = SoonestStart(
                block_chars=block_chars,
                chars_per_token=chars_per_token,
                slack_s=ttft_slack_s,
                wait_ratio=wait_ratio,
                spread=spread,
                # Only a count of exactly this one lets it place new prefixes by load.
                lone=gateways == 1,
                low_load_share=low_load_share(gateways),
                copy_cost=copy_cost,
            )
            self.policy = PrefixPolicy(replicas, index, speed, soonest, tokens_per_unit, clock)
        # Whether pick looks at the prompt, so callers render it only then. A
        # lone replica is no choice, and prefix work for it (render, hash,
        # index: ~200 opcodes a request) bought nothing until a second
        # replica appeared. That one starts with an index cold for the
        # prefixes served meanwhile, which costs little: the first replica
        # still holds them and new prompts are placed by hash, as are
        # prefixes the index forgot. The prefill speed is not measured
        # meanwhile either (nothing charges uncached tokens): the estimate
        # settles within a few samples once there is a choice. Zero
        # replicas (an on-demand model asleep) still render: the router
        # built after the wake-up decides.
        # The exception: an engine that computes one request at a time,
        # where the policy's estimate of each prompt's uncached part is what
        # its turns are ordered by (routing/turns.py), and its engine's time
        # dwarfs the gateway's.
        self.wants_prompt = self.policy.reads_prompt and (len(replicas) != 1 or replicas[0].serial)
        # Replicas that publish their KV-cache events (routing.kvfollow):
        # where one of them is followed, a prompt is tokenised before the
        # pick (gateway.kvtokens) and routed on what they really hold.
        self.publishing = [r for r in replicas if r.kv_events] if self.wants_prompt else []
        self._counter = 0

    def candidates(
        self, exclude: Sequence[Replica] = (), *, fallback: bool = True
    ) -> list[Replica]:
        """Replicas that may take a request now: not excluded, not cooling down.

        If every replica is cooling down, all of them are offered again when
        ``fallback`` holds: a request that might fail is better than one
        refused for certain. An on-demand model passes False instead: its
        request waits for a replica (the cooled one's return or a
        replacement) rather than being sent where connections just failed.
        """
        now = 0.0
        out: list[Replica] = []
        for replica in self.replicas:
            if replica in exclude:
                continue
            if replica.cooled_until:
                now = now or time.monotonic()
                if replica.cooled_until > now:
                    continue
            out.append(replica)
        if not out and fallback:
            out = [r for r in self.replicas if r not in exclude]
        return out

    def cooling_ends(self) -> float | None:
        """When (time.monotonic()) the first replica now cooling down may be tried again."""
        now = time.monotonic()
        ends = [r.cooled_until for r in self.replicas if r.cooled_until > now]
        return min(ends) if ends else None

    def pick(
        self, prompt: str | None, exclude: Sequence[Replica] = (), *, fallback: bool = True,
        tokens: Sequence[int] | None = None,
    ) -> Pick | None:
        if not exclude and len(self.replicas) == 1 and not self.wants_prompt:
            # The usual first try at a one-replica model, without candidates'
            # list: the replica unless it cools down and there is no fallback.
            only = self.replicas[0]
            if only.cooled_until and not fallback and only.cooled_until > time.monotonic():
                return None
            self._counter += 1
            return Pick(only, UNROUTED, [], 0.0)
        replicas = self.candidates(exclude, fallback=fallback)
        if not replicas:
            return None
        self._counter += 1
        if len(replicas) == 1 and not self.wants_prompt:
            return Pick(replicas[0], UNROUTED, [], 0.0)
        return self.policy.choose(replicas, prompt, self._counter, tokens)

    def exact_live(self) -> Replica | None:
        """A publishing replica whose events are followed now, the least busy; None: none."""
        best: Replica | None = None
        for replica in self.publishing:
            exact = replica.exact
            if exact is None or not exact.live:
                continue
            if best is None or replica.in_flight < best.in_flight:
                best = replica
        return best

    def metered(
        self, pick: Pick, prompt_tokens: int, cached_tokens: int, computed_s: float | None = None
    ) -> None:
        """What the engine's usage (and its prefill's time) says of a prompt placed by prefix."""
        self.policy.metered(pick, prompt_tokens, cached_tokens, computed_s)

    def measured(self, tokens: float, seconds: float) -> None:
        """A replica answered a prefill of ``tokens`` in ``seconds`` (see PrefillSpeed)."""
        self.policy.measured(tokens, seconds)

    def record(self, pick: Pick) -> None:
        """The pick was sent: its replica is counted as holding the prefix from now on."""
        self.policy.record(pick)
