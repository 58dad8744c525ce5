"""The gateway's tunables, with the reasoning behind each default.

One frozen dataclass, read once at start-up: nothing on the request path looks
a setting up by name, and a setting cannot change under a request in flight.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from llmgw.errors import ConfigError


def _default_gateway_id() -> str:
    # The control plane merges load reports by gateway id; host + pid is
    # unique per process without any coordination.
    return f"{os.uname().nodename}-{os.getpid()}"


@dataclass(frozen=True)
class GatewaySettings:
    gateway_id: str = field(default_factory=_default_gateway_id)
    # How many worker processes serve this gateway's port (``llmgw gateway
    # --workers N``; 1: this process alone). Each is an enforcement point of
    # its own, lent a share of every key's and team's limits by the control
    # plane (llmgw.allowance), so the workers together never let a key past
    # its limit.
    workers: int = 1

    # Requests: 32 MiB leaves room for base64 images in chat messages while
    # still refusing a body that would make one request hold the process' memory.
    max_body_bytes: int = 32 * 1024 * 1024
    # With no key configured at all the gateway refuses everything; `llmgw up`
    # on a laptop may want to accept anonymous clients instead.
    allow_anonymous: bool = False
    # When set, /metrics answers only `Authorization: Bearer <this>` (metrics
    # name every model and replica and show the traffic). Without one,
    # `metrics_open` decides: the standalone gateway (`llmgw gateway`, the
    # one that faces clients on a shared network) leaves it closed unless
    # its operator passes --open-metrics.
    metrics_token: str | None = None
    metrics_open: bool = True
    # Another credential /metrics takes besides the metrics token: on
    # `serve` and `up`, whose gateway shares its port with the control plane,
    # the admin token (checked against its hash; never held here in clear).
    metrics_admin: Callable[[str], bool] | None = None
    # Environment variables an external model's api_key_env may name besides
    # LLMGW_EXTERNAL_* (llmgw.gateway.external): the operator's choice.
    key_env_allowed: frozenset[str] = frozenset()

    # On-demand models: a cold start of a real engine takes tens of seconds to
    # minutes, so the wait is long; the queue bound keeps a burst of clients
    # from holding thousands of sockets while nothing can serve them.
    queue_length: int = 256
    queue_wait_s: float = 180.0
    # Models whose replicas take a known number of requests at once
    # (ModelRoute.max_concurrency): the rest wait in the gateway's hold queue
    # (llmgw.gateway.admission), ordered by class and fair between teams.
    # A queue is a latency promise: past a minute a client is better told
    # to come back (503) than kept, and the bound on its length keeps a flood
    # from holding thousands of sockets (429).
    hold_queue_length: int = 1024
    hold_wait_s: float = 60.0
    # The share of a model's slots kept for teams with little in flight, so
    # that one team holding every slot cannot make another's first request
    # wait for a whole generation to end (0: none; at least 1 slot otherwise).
    hold_reserve: float = 0.125
    # What a 503 tells a client to wait before trying again.
    retry_after_s: int = 5

    # Failures: a refused or reset connection is tried on up to this many other
    # replicas; after `cooldown_after` consecutive connection failures a replica
    # gets no new request for `cooldown_s` (it may just be restarting).
    retries: int = 2
    cooldown_after: int = 2
    cooldown_s: float = 5.0
    connect_timeout_s: float = 5.0
    # Upper bound on a whole upstream response; long generations are legitimate.
    upstream_timeout_s: float = 900.0

    # External models' URLs (llmgw.gateway.health): probed this often, out of
    # routing after this many failed probes in a row (one slow answer is no
    # outage; a dead URL is out within two intervals, and requests meeting it
    # before then are retried elsewhere), a probe failing after this long.
    health_interval_s: float = 5.0
    health_failures: int = 2
    health_timeout_s: float = 5.0

    # Batching towards the control plane: usage every ~2 s bounds what a crash
    # loses; load every ~1 s keeps idle tracking and scale-up decisions fresh.
    usage_flush_s: float = 2.0
    load_report_s: float = 1.0
    # If the control plane stays away, usage accumulates in memory; this bounds
    # the number of (minute, key, model) rows kept (oldest are dropped).
    usage_max_rows: int = 100_000

    # Prefix routing. Blocks are measured in characters, not tokens: the
    # gateway has no tokenizer, and ~4 characters per token is the usual
    # English estimate. 256 characters ≈ 64 tokens, the block size llm-d uses.
    prefix_block_chars: int = 256
    chars_per_token: float = 4.0
    # Prefix routing picks the replica estimated to start answering soonest
    # (routing.SoonestStart): queued prefill plus the uncached part of the
    # prompt, at the model's prefill speed as measured on its replicas. Until
    # a few streamed answers have measured it, this prior stands in; it only
    # turns the tolerances below into tokens, so the order of magnitude does.
    prefill_tokens_per_s: float = 8192.0
    # A replica holding the prompt's prefix keeps it while its estimate is
    # within this of the soonest replica's: less than a cold prompt's prefill
    # on any engine, so a hit never waits behind another prompt's, and enough
    # to keep a warm group on its replica when that costs a few tens of ms.
    ttft_slack_s: float = 0.05
    # A new prefix (or one whose holders are all too busy) goes where the hash
    # of its first block says among the replicas estimated within this ratio
    # of the soonest: wide, so that gateways seeing different loads still
    # agree on where a prefix lives, and below 1, so a prompt never waits
    # behind a whole prefill of its own size.
    miss_wait_ratio: float = 0.5
    # A holder busy beyond that slack still keeps the prompt while its
    # estimate exceeds the soonest by less than this share of the prefill it
    # holds: a detour computes that prefill a second time, and the copy it
    # leaves evicts another prefix on a replica whose cache is full. Off by
    # default: at 1.0 bench/routing_replay.py's lone hit rate rose 2 points
    # on seeds 0 and 1, but its p90 at 20 req/s on seed 0 went from 0.106 to
    # 0.143 s and the two-gateway gap from 4.3 to 5.9 points.
    prefix_copy_cost: float = 0.0
    # The estimate sees prefill only: a replica with more than this many
    # requests in flight above the least busy one is passed over, so a hot
    # prefix that is always cached cannot pile decode work on one engine.
    load_threshold: float = 8.0
    # Least-loaded routing counts this many uncached prompt tokens still being
    # prefilled as one more request in flight.
    prefill_tokens_per_unit: float = 2048.0
    # Upstream streams always ask for usage (needed for limits and metering);
    # the final usage chunk is removed for clients that did not ask for it.
    inject_stream_usage: bool = True

    def __post_init__(self) -> None:
        for name in _POSITIVE:
            value = getattr(self, name)
            if value <= 0:
                raise ConfigError(f"gateway setting {name} must be > 0, got {value}")
        for name in _NON_NEGATIVE:
            value = getattr(self, name)
            if value < 0:
                raise ConfigError(f"gateway setting {name} must be >= 0, got {value}")


# Checked at start-up, in this order: a zero or negative one would stall or
# disable the gateway (a zero wait, an empty queue) rather than fail loudly.
_POSITIVE = (
    "workers", "max_body_bytes", "queue_length", "queue_wait_s", "hold_queue_length",
    "hold_wait_s", "cooldown_s", "connect_timeout_s",
    "upstream_timeout_s", "health_interval_s", "health_failures", "health_timeout_s",
    "usage_flush_s", "load_report_s", "usage_max_rows", "prefix_block_chars",
    "chars_per_token", "prefill_tokens_per_unit", "prefill_tokens_per_s",
)  # fmt: skip
# Zero means "none" or "off" for these (no retries, no slack).
_NON_NEGATIVE = (
    "retries", "cooldown_after", "retry_after_s", "load_threshold", "ttft_slack_s",
    "miss_wait_ratio", "prefix_copy_cost", "hold_reserve",
)  # fmt: skip
