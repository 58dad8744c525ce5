"""The simulated engine's scheduler: a FIFO queue, continuous batching, chunked prefill.

It reproduces the behaviour routing depends on, after vLLM's v1 scheduler:

- Requests wait in FIFO order and are admitted while fewer than
  ``max_running`` run *and* the KV cache can hold the prompt plus the whole
  answer (reserved up front, so nothing is ever preempted; a busy engine
  therefore queues a little earlier than vLLM, which preempts instead).
- The engine advances in steps. One step computes up to
  ``prefill_chunk_tokens`` uncached prompt tokens (FIFO across the requests
  still in prefill) and one output token for every request already decoding.
  Its duration is ``prefill_tokens / prefill_tokens_per_s`` plus, when anything
  decodes, ``decode_ms_per_token * (1 + decode_batch_alpha * (running - 1))``.
  Long prefills thus slow everyone's inter-token time, as on a real GPU.
- A prompt's cached prefix is skipped, which is how a cache hit cuts time to
  first token; the first output token appears when a prompt's prefill ends.

Durations are scaled by ``time_factor`` (and by 10 for the ``slow`` fault).
One asyncio task per engine drives it; request handlers only wait on events,
which keeps dozens of engines on one core.
"""

from __future__ import annotations

import asyncio
import bisect
import enum
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from llmgw.errors import LlmgwError, ValidationError
from llmgw.sim import tokens
from llmgw.sim.deadline import sleep_until
from llmgw.sim.kv import Allocation, KVCache
from llmgw.wire import SimParams

SLOW_FACTOR = 10.0
# Once the process falls behind the simulated clock by more than this (a busy
# CPU), the clock is reset instead of caught up: catching up would emit a burst
# of steps back to back and make latencies look better than they were.
_MAX_LAG_S = 0.05

# TTFT buckets (seconds), close to vLLM's so dashboards built for it read right.
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip


class QueueFullError(LlmgwError):
    """The waiting queue is at ``max_waiting``: the caller should retry later."""


class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"
    ABORTED = "aborted"


@dataclass(eq=False)
class SimRequest:
    prompt_tokens: int
    hashes: list[bytes]
    max_tokens: int
    arrived_at: float
    phase: Phase = Phase.WAITING
    alloc: Allocation | None = None
    cached_tokens: int = 0
    prefill_left: int = 0
    produced: int = 0
    first_token_at: float | None = None
    # Set whenever produced or phase changes; the HTTP handler clears it.
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def finished(self) -> bool:
        return self.phase in (Phase.DONE, Phase.ABORTED)

    async def progress(self) -> AsyncIterator[int]:
        """``produced`` after each change the core makes, for a handler that streams it.

        Ends with the request: once DONE (its last count yielded first) or
        ABORTED (nothing more; ``phase`` tells which).
        """
        while True:
            await self.changed.wait()
            self.changed.clear()
            if self.phase is Phase.ABORTED:
                return
            yield self.produced
            if self.phase is Phase.DONE:
                return


@dataclass(frozen=True)
class Step:
    """One engine step: who decodes a token, who prefills how much, and for how long."""

    decoding: list[SimRequest]
    plan: list[tuple[SimRequest, int]]
    seconds: float  # time_factor applied


@dataclass
class CoreCounters:
    """Monotonic totals, exported as Prometheus counters."""

    prefix_queries: int = 0  # prompt tokens looked up in the cache
    prefix_hits: int = 0  # of which found cached
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: int = 0
    aborted: int = 0
    ttft_sum: float = 0.0
    ttft_count: int = 0
    ttft_buckets: list[int] = field(default_factory=lambda: [0] * (len(TTFT_BUCKETS) + 1))

    def observe_ttft(self, seconds: float) -> None:
        self.ttft_sum += seconds
        self.ttft_count += 1
        self.ttft_buckets[bisect.bisect_left(TTFT_BUCKETS, seconds)] += 1


class EngineCore:
    def __init__(self, params: SimParams, clock: Callable[[], float] | None = None) -> None:
        check_params(params)
        self.params = params
        self.kv = KVCache(params.kv_blocks, params.block_tokens)
        self.counters = CoreCounters()
        self.scale = params.time_factor * (SLOW_FACTOR if params.fault == "slow" else 1.0)
        self._clock = clock
        self._waiting: deque[SimRequest] = deque()
        self._prefilling: list[SimRequest] = []
        self._decoding: list[SimRequest] = []
        self._wake = asyncio.Event()

    # -- views ---------------------------------------------------------------

    @property
    def running(self) -> int:
        return len(self._prefilling) + len(self._decoding)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def now(self) -> float:
        # time.monotonic, not the loop's clock: uvloop's counts whole
        # milliseconds (see llmgw.sim.deadline).
        return self._clock() if self._clock else time.monotonic()

    # -- requests ------------------------------------------------------------

    def submit(self, prompt: bytes, max_tokens: int, salt: bytes = b"") -> SimRequest:
        """Queue a request; raises ValidationError if it can never fit, or QueueFullError.

        ``salt``: the LoRA adapter it is for (tokens.block_hashes), b"" for the base."""
        block = self.params.block_tokens
        n_prompt = max(1, tokens.count_bytes_tokens(len(prompt)))
        need = -(-(n_prompt + max_tokens) // block)
        if need > self.kv.capacity:
            raise ValidationError(
                f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) needs {need} KV blocks;"
                f" this engine holds {self.kv.capacity} blocks of {block} tokens",
                field="max_tokens",
            )
        limit = self.params.max_waiting
        if limit is not None and len(self._waiting) >= limit:
            raise QueueFullError(f"{len(self._waiting)} requests already waiting (max {limit})")
        req = SimRequest(
            prompt_tokens=n_prompt,
            hashes=tokens.block_hashes(prompt, block, salt=salt),
            max_tokens=max_tokens,
            arrived_at=self.now(),
        )
        self._waiting.append(req)
        self._wake.set()
        return req

    def abort(self, req: SimRequest) -> None:
        """Drop a request in any phase (client gone, server stopping); frees its blocks."""
        if req.finished:
            return
        if req.phase is Phase.WAITING:
            self._waiting.remove(req)
        elif req.phase is Phase.PREFILL:
            self._prefilling.remove(req)
        else:
            self._decoding.remove(req)
        if req.alloc is not None:
            self.kv.release(req.alloc)
        req.phase = Phase.ABORTED
        self.counters.aborted += 1
        req.changed.set()
        self._wake.set()

    # -- the step loop -------------------------------------------------------

    async def run(self) -> None:
        """Drive the engine until cancelled."""
        deadline = self.now()
        while True:
            step = self.next_step()
            if step is None:
                self._wake.clear()
                await self._wake.wait()
                deadline = self.now()
                continue
            deadline += step.seconds
            now = self.now()
            if deadline < now - _MAX_LAG_S:
                deadline = now
            await sleep_until(deadline)
            self.finish(step)

    def next_step(self) -> Step | None:
        """Admit what fits and plan the next step; None when there is nothing to do.

        :meth:`run` sleeps the step's duration and then calls :meth:`finish`;
        a replay with a clock of its own (bench/routing_replay.py) advances
        its clock instead, which is what makes it deterministic.
        """
        p = self.params
        self._admit()
        if not self._prefilling and not self._decoding:
            return None
        decoding = list(self._decoding)
        plan: list[tuple[SimRequest, int]] = []
        budget = p.prefill_chunk_tokens
        for req in self._prefilling:
            if budget == 0:
                break
            take = min(req.prefill_left, budget)
            plan.append((req, take))
            budget -= take
        seconds = (p.prefill_chunk_tokens - budget) / p.prefill_tokens_per_s
        if decoding:
            batch = 1.0 + p.decode_batch_alpha * (self.running - 1)
            seconds += p.decode_ms_per_token / 1000.0 * batch
        return Step(decoding, plan, seconds * self.scale)

    def finish(self, step: Step) -> None:
        """Apply a step planned by :meth:`next_step` once its time has passed."""
        self._apply(step.decoding, step.plan)

    def _apply(self, decoding: list[SimRequest], plan: list[tuple[SimRequest, int]]) -> None:
        now = self.now()
        for req in decoding:
            if req.phase is not Phase.DECODE:
                continue  # aborted during the step
            req.produced += 1
            self.counters.generation_tokens += 1
            if req.produced >= req.max_tokens:
                self._finish(req)
            req.changed.set()
        for req, take in plan:
            if req.phase is not Phase.PREFILL:
                continue
            req.prefill_left -= take
            if req.prefill_left > 0:
                continue
            if req.alloc is not None:
                self.kv.commit(req.alloc, req.hashes)
            self._prefilling.remove(req)
            req.phase = Phase.DECODE
            req.produced = 1
            req.first_token_at = now
            self.counters.generation_tokens += 1
            self.counters.observe_ttft(now - req.arrived_at)
            self._decoding.append(req)
            if req.produced >= req.max_tokens:
                self._finish(req)
            req.changed.set()

    def _admit(self) -> None:
        block = self.params.block_tokens
        while self._waiting and self.running < self.params.max_running:
            req = self._waiting[0]
            total = -(-(req.prompt_tokens + req.max_tokens) // block)
            # At least the last prompt token is computed: it yields the first output.
            alloc = self.kv.allocate(req.hashes, total, max_hit=(req.prompt_tokens - 1) // block)
            if alloc is None:
                return  # strict FIFO: the head waits for room, nobody overtakes it
            self._waiting.popleft()
            req.alloc = alloc
            req.cached_tokens = alloc.hit_blocks * block
            req.prefill_left = req.prompt_tokens - req.cached_tokens
            req.phase = Phase.PREFILL
            self.counters.prefix_queries += req.prompt_tokens
            self.counters.prefix_hits += req.cached_tokens
            self.counters.prompt_tokens += req.prompt_tokens
            self._prefilling.append(req)

    def _finish(self, req: SimRequest) -> None:
        self._decoding.remove(req)
        if req.alloc is not None:
            self.kv.release(req.alloc)
        req.phase = Phase.DONE
        self.counters.finished += 1


def check_params(params: SimParams) -> None:
    """Refuse parameters the model cannot run with, naming the field.

    SimParams' original fields carry no bounds on the wire, so they are
    checked here, where a zero would otherwise divide or deadlock.
    """
    positive = {
        "prefill_tokens_per_s": params.prefill_tokens_per_s,
        "kv_blocks": params.kv_blocks,
        "block_tokens": params.block_tokens,
        "max_running": params.max_running,
    }
    for name, value in positive.items():
        if value <= 0:
            raise ValidationError(f"sim.{name} must be > 0, got {value}", field=name)
    for name, value in {
        "startup_s": params.startup_s,
        "decode_ms_per_token": params.decode_ms_per_token,
    }.items():
        if value < 0:
            raise ValidationError(f"sim.{name} must be >= 0, got {value}", field=name)
    for name, after in (
        ("hang_after_s", params.hang_after_s),
        ("stall_after_s", params.stall_after_s),
    ):
        if after is not None and params.fault == "fail_at_start":
            raise ValidationError(
                f"sim.{name}: an engine with fault fail_at_start is never ready,"
                " so it cannot hang or stall after ready",
                field=name,
            )
