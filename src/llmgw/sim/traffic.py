"""Demo traffic for ``llmgw up --sim ... --traffic RATE``: a fleet that is being used.

A simulated fleet with no requests shows empty usage charts, routing hit
rates of nothing, and never starts or unloads an on-demand model, so a demo
of the console shows the pages but not what they are for. This sends
requests to the gateway, over HTTP with real API keys (so auth, limits,
routing and usage are the real path), open loop at ``rate`` requests per
second (Poisson arrivals, as users arrive whether or not earlier answers
came back):

* **models**: every model of the catalog that is not parked or external.
  Models that always run (``min_replicas`` > 0) share the traffic all the
  time; an on-demand model gets its share in bursts of :data:`BURST_S`
  seconds, one per cycle of ``BURST_S + idle_timeout_s + QUIET_MARGIN_S``,
  so its replica is started on demand, serves, stays idle past its idle
  timeout and is unloaded, and the cycle repeats (the first burst starts at
  once, the next on-demand model's one burst later);
* **keys**: a few demo keys with fixed weights (:data:`DEMO_KEYS`), so the
  usage page splits by key;
* **prompts**: per model, :data:`GROUPS` system prompts of
  :data:`SYSTEM_TOKENS` tokens that requests share (a few popular, most
  rare), then a fresh question: what prefix routing is for, so the
  routing hit rates show hits;
* **shapes**: mostly streamed chat with usage, some unstreamed, answers of
  8 to 48 tokens.

At most :data:`MAX_IN_FLIGHT` requests are outstanding: a fleet slower than
the rate sheds the excess (counted) instead of piling up connections.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp
import orjson

from llmgw.sim import tokens

log = logging.getLogger(__name__)

BURST_S = 60.0
QUIET_MARGIN_S = 60.0
GROUPS = 6
SYSTEM_TOKENS = 300
MAX_IN_FLIGHT = 256
REPORT_EVERY_S = 30.0
# (name, share of the traffic): the usage page shows three keys of unequal use.
DEMO_KEYS: tuple[tuple[str, float], ...] = (("demo-team-a", 0.5), ("demo-team-b", 0.3),
                                            ("demo-batch", 0.2))  # fmt: skip


@dataclass(frozen=True, slots=True)
class TrafficModel:
    name: str
    on_demand: bool
    idle_timeout_s: float


@dataclass(frozen=True, slots=True)
class TrafficKey:
    name: str
    secret: str
    weight: float


@dataclass(slots=True)
class TrafficStats:
    sent: int = 0
    ok: int = 0
    failed: int = 0
    shed: int = 0


def active_models(
    models: Sequence[TrafficModel], elapsed_s: float, burst_s: float = BURST_S
) -> list[TrafficModel]:
    """The models that get traffic ``elapsed_s`` seconds into the run."""
    active: list[TrafficModel] = []
    waiting = 0
    for model in sorted(models, key=lambda m: m.name):
        if not model.on_demand:
            active.append(model)
            continue
        cycle = burst_s + model.idle_timeout_s + QUIET_MARGIN_S
        offset = waiting * burst_s  # staggered: one on-demand start at a time
        waiting += 1
        if elapsed_s >= offset and (elapsed_s - offset) % cycle < burst_s:
            active.append(model)
    return active


class Traffic:
    """Sends demo requests to ``api_url`` (ending in /v1) until cancelled."""

    def __init__(
        self,
        api_url: str,
        rate: float,
        keys: Sequence[TrafficKey],
        catalog: Callable[[], Sequence[TrafficModel]],
        *,
        seed: int = 0,
        burst_s: float = BURST_S,
    ) -> None:
        if rate <= 0:
            raise ValueError("the traffic rate must be above 0 requests/s")
        if not keys:
            raise ValueError("traffic needs at least one API key")
        self.api_url = api_url.rstrip("/")
        self.rate = rate
        self.keys = list(keys)
        self.catalog = catalog
        self.burst_s = burst_s
        self.stats = TrafficStats()
        self._rng = random.Random(seed)
        self._systems: dict[str, list[str]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def _system(self, model: str) -> str:
        prompts = self._systems.get(model)
        if prompts is None:
            rng = random.Random(f"traffic/{model}")
            prompts = [tokens.random_words(rng, SYSTEM_TOKENS) for _ in range(GROUPS)]
            self._systems[model] = prompts
        # A few popular prompts, most rare (1/1, 1/2, ... weights).
        group = self._rng.choices(range(GROUPS), weights=[1 / (g + 1) for g in range(GROUPS)])[0]
        return prompts[group]

    def request(self, elapsed_s: float) -> tuple[TrafficKey, bytes] | None:
        """The next request's key and body; None when no model gets traffic now."""
        models = active_models(self.catalog(), elapsed_s, self.burst_s)
        if not models:
            return None
        rng = self._rng
        model = rng.choice(models).name
        key = rng.choices(self.keys, weights=[k.weight for k in self.keys])[0]
        stream = rng.random() < 0.85
        body: dict[str, object] = {
            "model": model,
            "messages": [
                {"role": "system", "content": self._system(model)},
                {"role": "user", "content": tokens.random_words(rng, rng.randint(10, 40))},
            ],
            "max_tokens": rng.randint(8, 48),
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        return key, orjson.dumps(body)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        reported = started
        timeout = aiohttp.ClientTimeout(total=600, sock_connect=10)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            try:
                while True:
                    await asyncio.sleep(self._rng.expovariate(self.rate))
                    now = loop.time()
                    if now - reported >= REPORT_EVERY_S:
                        reported = now
                        s = self.stats
                        log.info("traffic: %d sent, %d answered, %d failed, %d shed", s.sent,
                                 s.ok, s.failed, s.shed)  # fmt: skip
                    if len(self._tasks) >= MAX_IN_FLIGHT:
                        self.stats.shed += 1
                        continue
                    chosen = self.request(now - started)
                    if chosen is None:
                        continue
                    task = loop.create_task(self._send(session, *chosen))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
            finally:
                for task in list(self._tasks):
                    task.cancel()
                await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _send(self, session: aiohttp.ClientSession, key: TrafficKey, body: bytes) -> None:
        self.stats.sent += 1
        headers = {"Authorization": f"Bearer {key.secret}", "Content-Type": "application/json"}
        try:
            async with session.post(f"{self.api_url}/chat/completions", data=body,
                                    headers=headers) as resp:  # fmt: skip
                async for _ in resp.content.iter_any():
                    pass
                if resp.status == 200:
                    self.stats.ok += 1
                else:
                    self.stats.failed += 1
        except (aiohttp.ClientError, OSError, TimeoutError):
            self.stats.failed += 1
