"""What the gateway measures of a model's replicas: prefill speed, characters per token, idle share.

Only the prefix policy reads these (its tolerances are seconds, turned into
tokens of prefill at the measured speed; its index's capacities are tokens,
its blocks characters). Each is a running estimate that a wrong sample
moves only a little.
"""

from __future__ import annotations

import math

# Prefill-speed measurement. A sample below this many tokens is mostly network
# and a decode step, not prefill, and would read as a slow engine.
MIN_SAMPLE_TOKENS = 256.0
# The first samples are averaged as they come (geometric mean), so a wrong
# prior is gone after a handful of requests; after that a sample moves the
# estimate by SAMPLE_WEIGHT of the way in log terms, and counts as at most a
# factor of SAMPLE_CLAMP off: a sample is wrong whenever the gateway's guess
# of the cached part was (another gateway warmed the engine, the engine
# evicted early), and such outliers must not swing every later choice.
SETTLING_SAMPLES = 4
SAMPLE_WEIGHT = 0.1
SAMPLE_CLAMP = 4.0

# Characters per token, learnt from the engines' prompt token counts (the
# gateway cuts prompts by characters, the engines count tokens): counted
# over about the last CHARS_WINDOW_TOKENS prompt tokens (the index's
# capacities follow: llmgw.gateway.routing.prefix).
CHARS_WINDOW_TOKENS = 262_144.0

# Low load, for the prefix policy's idle-first rule: on average over about
# the last 1/IDLE_SHARE_WEIGHT picks, at least this share of the replicas
# had nothing in flight. Averaged because the share at one pick swings with
# every Poisson burst: read at the pick, "half the replicas idle" switched
# the rule off in a burst at 4 req/s on 8 replicas (cold prompts then
# prefilled next to another's decode, 11-25 ms slower, where round-robin
# co-locates none) and on in a lull under load (second copies of prefixes
# when gateways' views differ, which is what costs hits). bench/routing.py's
# lowest rate keeps ~0.64 of the replicas idle on average; its next one
# keeps ~0.3, and two gateways sharing it each see ~0.6 from their own
# requests: a lower threshold detours their prefixes there too and widens
# their hit-rate gap (the replay's 12 seeds: 0.5 gives a mean gap of 6.0
# points, 0.6 gives 4.0, the per-pick rule 3.2).
IDLE_SHARE_WEIGHT = 1.0 / 32.0
LOW_LOAD_IDLE_SHARE = 0.6


def low_load_share(gateways: int) -> float:
    """The average idle share at which a gateway among ``gateways`` deems the load low.

    Each of N gateways sees only its own requests in flight, so about the
    N-th root of the idle share a lone one would see: the test is on
    (share) ** N, which is the share seen to the N-th root of the threshold.
    Without it, two gateways on bench/routing.py read 0.6-0.68 of the
    replicas idle at 8-12 req/s, detoured new prefixes there where each
    placed them apart, and their hit-rate gap was over 5 points on 3 of the
    replay's 12 seeds (at most 3.5 with it).
    """
    # 0: the control plane cannot tell yet, taken as several (as for placement).
    return math.pow(LOW_LOAD_IDLE_SHARE, 1.0 / (gateways if gateways > 0 else 2))


class PrefillSpeed:
    """A model's measured prefill speed (prompt tokens per second), from its replicas,
    and its measured characters per token.

    One estimate per model, not per replica: replicas of a model mostly run
    on alike hardware, each replica would see an eighth of the samples, and
    with per-replica estimates their noise -- not their load -- decided
    between idle replicas, so two gateways stopped agreeing on where new
    prefixes go. What it is for is turning queued prefill into seconds,
    which is what the policy's tolerances are in.
    """

    __slots__ = ("chars_per_token", "prompt_chars", "prompt_tokens", "samples", "tokens_per_s")

    def __init__(self, prior: float, chars_per_token: float = 4.0) -> None:
        self.tokens_per_s = prior
        self.samples = 0
        # The prior until an engine has counted a prompt's tokens.
        self.chars_per_token = chars_per_token
        self.prompt_chars = 0.0
        self.prompt_tokens = 0.0

    def counted(self, chars: int, tokens: int) -> None:
        """Fold in one prompt: ``chars`` characters that the engine counted as ``tokens``."""
        if chars <= 0 or tokens <= 0:
            return
        self.prompt_chars += chars
        self.prompt_tokens += tokens
        self.chars_per_token = self.prompt_chars / self.prompt_tokens
        if self.prompt_tokens > CHARS_WINDOW_TOKENS:
            self.prompt_chars *= 0.5
            self.prompt_tokens *= 0.5

    def observe(self, tokens: float, seconds: float) -> None:
        """Fold in one prefill: ``tokens`` uncached prompt tokens answered in ``seconds``.

        Only a prefill that queued behind none of this gateway's others on
        its replica is a sample (the caller checks), so the time is its own.
        """
        if tokens < MIN_SAMPLE_TOKENS or seconds <= 0.0:
            return
        ratio = tokens / seconds / self.tokens_per_s
        self.samples += 1
        if self.samples <= SETTLING_SAMPLES:
            # The first replaces the prior; the next ones make a geometric mean.
            self.tokens_per_s *= ratio ** (1.0 / self.samples)
        else:
            ratio = min(max(ratio, 1.0 / SAMPLE_CLAMP), SAMPLE_CLAMP)
            self.tokens_per_s *= ratio**SAMPLE_WEIGHT


class IdleShare:
    """The share of a model's replicas with nothing in flight, averaged over this gateway's picks.

    Starts at 1 (a gateway that has sent nothing sees every replica idle);
    each pick moves it IDLE_SHARE_WEIGHT of the way to the share at that pick.
    """

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 1.0

    def observe(self, idle: int, count: int) -> float:
        """Fold in one pick's share (``idle`` of ``count`` replicas); the average after it."""
        self.value += IDLE_SHARE_WEIGHT * (idle / count - self.value)
        return self.value
