"""Catalog entries (ctl/admin API -> control plane) and what an engine's API gets wrong."""

from __future__ import annotations

import re
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from llmgw.wire.base import EngineKind, Wire, check_host
from llmgw.wire.inventory import CPU_CLASS
from llmgw.wire.weights import WeightsSource

# Names users type (models, aliases, nodes, fabrics) end up in URLs, log lines
# and engine argv items; keeping them to a plain alphabet means none of them can
# ever be mistaken for an option, a path or a shell word.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}$"
_NAME_RE = re.compile(NAME_PATTERN)


# The OpenAI routes beyond chat, completions and embeddings (which every
# engine serves): an engine serves a route only where its adapter says so
# (EngineDialect.extra_routes), and the gateway answers 404 for a model whose
# engines do not, instead of handing the client the engine's own 404.
ExtraRoute = Literal["/v1/responses", "/v1/rerank", "/v1/score", "/v1/audio/transcriptions"]
EXTRA_ROUTES: tuple[ExtraRoute, ...] = (
    "/v1/responses", "/v1/rerank", "/v1/score", "/v1/audio/transcriptions",
)


class SimParams(Wire):
    """How a simulated engine behaves (see llmgw.sim.engine)."""

    startup_s: float = 0.5
    prefill_tokens_per_s: float = 20000.0
    decode_ms_per_token: float = 10.0
    kv_blocks: int = 2048
    block_tokens: int = 16
    max_running: int = 64
    # cut_stream: a stream ends cleanly after crash_after_tokens tokens with
    # no finish_reason (then [DONE]), as llama_cpp.server's interrupt_requests does.
    fault: Literal[
        "none", "fail_at_start", "crash_mid_stream", "cut_stream", "hang", "slow"
    ] = "none"
    # Dialect switches, to exercise the gateway's mending (EngineDialect):
    # False makes the engine ignore max_completion_tokens / include_usage, as
    # llama_cpp.server does.
    max_completion_tokens: bool = True
    stream_usage: bool = True
    # Multiplies every simulated duration (start-up, prefill, decode): 0.01
    # runs a scenario 100x faster for tests, keeping its ratios.
    time_factor: float = Field(1.0, gt=0)
    # Prompt tokens computed per engine step (vLLM's max-num-batched-tokens).
    prefill_chunk_tokens: int = Field(2048, ge=1)
    # Decode step time = decode_ms_per_token * (1 + alpha * (running - 1)).
    decode_batch_alpha: float = Field(0.01, ge=0)
    # Requests queued beyond this get 503; None: unbounded, as in vLLM.
    max_waiting: int | None = Field(None, ge=0)
    # With fault crash_mid_stream (cut_stream): output tokens sent before the
    # connection drops (the stream ends).
    crash_after_tokens: int = Field(2, ge=0)
    # Seconds after it became ready (times time_factor) when the engine wedges,
    # as a deadlocked one does: running requests stop, and every request,
    # /health included, is accepted and never answered. None: never.
    hang_after_s: float | None = Field(None, ge=0, allow_inf_nan=False)
    # Seconds after it became ready (times time_factor) when the engine stops
    # making progress while its HTTP server answers on, as vLLM stuck inside a
    # CUDA call does: running requests stay running with no more tokens, the
    # token counters in /metrics freeze, /health answers 200. None: never.
    stall_after_s: float | None = Field(None, ge=0, allow_inf_nan=False)
    # The routes of EXTRA_ROUTES the engine serves (and its adapter declares);
    # None: all of them. [] makes an engine that serves only the core routes,
    # to see the gateway's 404 for the others.
    routes: list[ExtraRoute] | None = None
    # LoRA adapters served at once (vLLM's --max-loras); 0: the engine serves
    # none, as vLLM without --enable-lora.
    max_loras: int = Field(0, ge=0, le=1024)
    # The largest adapter rank it takes (vLLM's --max-lora-rank).
    max_lora_rank: int = Field(16, ge=1, le=1024)
    # Seconds to load (read and copy to the device) and unload one adapter.
    lora_load_s: float = Field(0.5, ge=0)
    lora_unload_s: float = Field(0.05, ge=0)
    # Seconds to fall asleep (weights to host RAM) and wake (back to the
    # device); None: the engine cannot sleep, as vLLM without
    # --enable-sleep-mode. Waking is what replaces a cold start (startup_s).
    sleep_s: float | None = Field(None, ge=0)
    wake_s: float = Field(0.3, ge=0)
    # Host RAM the weights take while asleep (the agent counts it).
    weights_mib: int = Field(1024, ge=0)


RoutingPolicy = Literal["prefix", "least-loaded", "round-robin"]

# An environment variable's name: what ``api_key_env`` may hold.
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"
_URL_PATH_RE = re.compile(r"^(/[A-Za-z0-9._~!$&'()*+,;=:@%-]*)*$")


def check_external_url(value: str) -> str:
    """``value`` if it is a base URL the gateway can send OpenAI requests to.

    ``http(s)://host[:port][/path prefix]``, without ``/v1`` (the gateway adds
    it, as for every engine). No user info, query or fragment: a URL that
    carried a password would show it in every read of the catalog, and a
    query would be lost when the route's path is appended.
    """
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{value!r} is not an http:// or https:// URL with a host")
    try:
        check_host(parts.hostname)
    except ValueError:
        raise ValueError(f"{value!r}: {parts.hostname!r} is not a host name or address") from None
    if parts.username is not None or parts.password is not None:
        raise ValueError(
            f"{value!r} carries user info: give the key by name in api_key_env instead"
        )
    if parts.query or parts.fragment or value.endswith(("?", "#")):
        raise ValueError(f"{value!r} has a query or fragment: give the base URL only")
    try:
        parts.port  # noqa: B018 (raises on a port out of range)
    except ValueError:
        raise ValueError(f"{value!r} has an invalid port") from None
    if not _URL_PATH_RE.match(parts.path):
        raise ValueError(f"{value!r}: the path may hold only URL characters")
    if parts.path.rstrip("/").endswith("/v1"):
        raise ValueError(
            f"{value!r} ends in /v1: give the base URL without it (the gateway adds /v1/...)"
        )
    return value


class ChatTemplate(Wire):
    """The chat template an engine applies, given so that the gateway can apply it too.

    Where an engine reports no usage in streams, the gateway counts a chat
    prompt by rendering it as the engine does and tokenizing the text with
    the engine's tokenize route. Otherwise it could only ask the engine for
    a one-token copy of the request: a generation, which costs the engine a
    turn and, on llama_cpp.server, one more state in its bounded prompt
    cache, evicting another prompt's.

    ``style``: how the engine renders. ``hf-tokenizer-config`` is
    llama_cpp.server's format of that name: the Jinja template (sandboxed,
    trim_blocks and lstrip_blocks) over the messages with an empty
    assistant turn appended, given ``bos_token`` and ``eos_token``, the
    text tokenized with special tokens and no BOS of the tokenizer's own.
    """

    style: Literal["hf-tokenizer-config"] = "hf-tokenizer-config"
    jinja: str = Field(min_length=1, max_length=262_144)
    bos_token: str = Field(max_length=256)
    eos_token: str = Field(max_length=256)


class EngineDialect(Wire):
    """Where an engine's OpenAI API differs from OpenAI's, as its adapter declares it.

    The gateway owns the OpenAI contract (DESIGN.md §6) and mends these per
    endpoint, so every client sees one API whatever serves it. Without this,
    llama_cpp.server ignores a client's ``max_completion_tokens`` (173 tokens
    generated for a limit of 5) and never sends a stream's usage, so clients
    that ask get none and per-key token limits meter a guess. The defaults
    describe an engine that speaks OpenAI faithfully (vLLM, SGLang).
    """

    # False: the engine ignores ``max_completion_tokens``; the gateway sends
    # the limit as ``max_tokens`` (the smaller one when both are given).
    max_completion_tokens: bool = True
    # False: the engine ignores ``stream_options.include_usage`` and sends no
    # usage in streams; the gateway counts the stream with the engine's own
    # tokenizer and adds the usage chunk itself.
    stream_usage: bool = True
    # The engine's tokenizer route, for counting what it does not report:
    # POST ``{tokenize_field: text}`` answered by ``{"count": n}`` or
    # ``{"tokens": [...]}``. None: it has none (then stream_usage must hold).
    tokenize_path: str | None = Field(None, pattern=r"^/[A-Za-z0-9/_.-]{0,99}$")
    tokenize_field: Literal["input", "content", "prompt"] = "input"
    # False: the engine goes on with a non-streamed request after its client
    # has gone (llama_cpp.server computes one in a worker thread that nothing
    # interrupts, to its token limit); the gateway asks it for a stream,
    # which stops at the next token once the connection closes, and
    # assembles the non-streamed answer the client asked for.
    stops_unstreamed: bool = True
    # The routes of EXTRA_ROUTES the engine serves. None: not declared (an
    # agent older than this field, an external server that declares no
    # dialect): every route is passed on and the server answers for itself.
    extra_routes: list[ExtraRoute] | None = None
    # False: the engine does not serve /v1/embeddings, which every engine
    # otherwise does (llama.cpp computes embeddings only when started for
    # them, and answered a chat model's embedding request with a 500). The
    # gateway answers OpenAI's 404 instead, as for a missing extra route.
    embeddings: bool = True
    # False: the engine's chat knows no "developer" role, OpenAI's new name
    # for "system" (llama_cpp.server refused it with a 500 and its
    # validation error); the gateway sends such messages as "system".
    developer_role: bool = True
    # False: the engine returns no logprobs (llama_cpp.server without
    # --logits_all, as the agent starts it: it failed mid-answer when asked
    # for top_logprobs, and returned none for a bare ``logprobs: true``);
    # the gateway refuses a request for them with 400 naming the field.
    logprobs: bool = True
    # False: the engine returns one choice whatever ``n`` asks
    # (llama_cpp.server ignores it); the gateway refuses n > 1 with 400
    # rather than answer with fewer choices than were asked for.
    choices: bool = True
    # False: the engine computes one request at a time (llama_cpp.server: one
    # lock around the model), and its prompt cache keeps a few whole states.
    # A request sent there waits for every one in flight, its answer's decode
    # included, and a copy of a prefix made elsewhere evicts another prefix
    # there: the gateway's prefix routing claims a prefix for such a replica
    # when it sends the prompt and keeps a holder while a detour would not
    # save a whole prefill of what it holds (gateway/routing/prefix.py).
    concurrent: bool = True
    # The chat template the engine applies, where the gateway can render it
    # as the engine does (ChatTemplate): it counts a stream's chat prompt
    # with the tokenize route instead of a one-token copy of the request.
    # None: not declared (the catalog chose the engine's format, or the
    # engine reports usage itself).
    chat_template: ChatTemplate | None = None
    # The LoRA adapters the engine took at its start and applies per request
    # by number (llama-server: ``--lora`` in this order, each request's
    # ``lora: [{"id", "scale"}]``), by catalog name. The gateway sends a
    # request for one of them with that adapter at scale 1 and every other
    # request with all at 0: a request without the field runs at the start
    # scales on the KV cache its slot kept, made under whichever adapter ran
    # there last (server-context.cpp, launch_slot_with_task). None: the
    # engine loads adapters by name at runtime (vLLM) or serves none.
    lora_ids: dict[str, int] | None = None
    # The engine publishes its KV-cache block events on its node, and its
    # guard relays them behind the engine key on the replica's own address
    # (wire.Endpoint.kv_events). False: it publishes none.
    kv_events: bool = False



class ExternalSpec(Wire):
    """OpenAI-compatible servers llmgw routes to but does not run.

    A vLLM someone started by hand, an Ollama box, a hosted API: the gateway
    treats each URL as one replica (keys, limits, usage, prefix and load
    routing, retries, cool-down), probes them itself (llmgw.gateway.health)
    and the scheduler places nothing for the model.
    """

    urls: list[str] = Field(min_length=1, max_length=64)
    # The upstream's own name for the model, sent in every request body;
    # None: the catalog name. Answers carry the catalog name back to clients.
    model: str | None = Field(None, min_length=1, max_length=256)
    # The name of the environment variable, on each gateway, holding the
    # upstream's API key (sent as ``Authorization: Bearer``). The name only:
    # the key itself is never in the catalog, the store or any admin read.
    api_key_env: str | None = Field(None, pattern=ENV_NAME_PATTERN)
    # What the upstream's API gets wrong, as for an engine; None: it speaks
    # OpenAI faithfully (vLLM, SGLang, hosted APIs): streams are sent with
    # include_usage and the usage is taken from them.
    dialect: EngineDialect | None = None

    @field_validator("urls")
    @classmethod
    def _urls(cls, value: list[str]) -> list[str]:
        for url in value:
            check_external_url(url)
        if len({url.rstrip("/") for url in value}) != len(value):
            raise ValueError("a URL is listed twice")
        return value

    @field_validator("model")
    @classmethod
    def _upstream_name(cls, value: str | None) -> str | None:
        if value is not None and any(ord(c) < 32 or ord(c) == 127 for c in value):
            raise ValueError("the upstream model name must not hold control characters")
        return value


class AdapterSpec(Wire):
    """What a LoRA adapter is, beside its weights: checked against its base's engine.

    An adapter loaded on an engine whose --max-lora-rank is below its rank
    fails at load time on every replica, for every request that asked for
    it; the catalog refuses it at apply instead (control.catalog).
    """

    rank: int = Field(8, ge=1, le=1024)
    # The adapter's weights on disk, in MiB (what a load reads and the
    # engine's LoRA cache holds); None: not stated.
    size_mib: int | None = Field(None, ge=1, le=1024 * 1024)


class ModelPrice(Wire):
    """What a model's tokens cost, in US dollars per million: what budgets are spent at."""

    input_per_million: float = Field(0.0, ge=0)
    output_per_million: float = Field(0.0, ge=0)

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        return (prompt_tokens * self.input_per_million
                + completion_tokens * self.output_per_million) / 1e6


class ModelSpec(Wire):
    """One catalog entry (DESIGN.md §3). Field-level shape is checked here;
    cross-field rules (MIG limits, gpus = tp x pp, ...) in control.catalog."""

    name: str
    aliases: list[str] = Field(default_factory=list)
    engine: EngineKind
    weights: WeightsSource = Field(default_factory=WeightsSource)
    gpu_classes: list[str] = Field(default_factory=lambda: [CPU_CLASS], min_length=1)
    gpus: int = Field(1, ge=1, le=1024)
    tp: int = Field(1, ge=1, le=1024)
    pp: int = Field(1, ge=1, le=1024)
    nodes: int = Field(1, ge=1, le=256)
    min_replicas: int = Field(1, ge=0, le=10000)
    max_replicas: int = Field(1, ge=0, le=10000)
    idle_timeout_s: float = Field(900.0, ge=0)
    start_timeout_s: float = Field(600.0, gt=0)
    engine_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    # Names in env whose values are secrets: never shown by a read of the
    # catalog (llmgw.control.secretenv; names like *TOKEN* are secret anyway).
    secret_env: list[str] = Field(default_factory=list)
    routing: RoutingPolicy = "prefix"
    # Host RAM one replica's engine may use (per node), in MiB: the budget
    # the agent enforces and, for CPU replicas, what placement charges a
    # node's RAM. None: estimated from the engine, weights and context
    # (llmgw.memory.default_need_mib).
    memory_mib: int | None = Field(None, ge=64, le=16 * 1024 * 1024)
    # Tokens of KV cache one replica holds; sizes the gateway's prefix index.
    kv_capacity_tokens: int = Field(32768, ge=16)
    # vLLM replicas publish their KV-cache block events and the gateway
    # routes on what each really holds (gateway.routing.kvcache) rather than
    # on its estimate. The events carry the token ids of every prompt the
    # replica caches: they stay on the node (an ipc socket) and reach the
    # gateway only through the replica's engine guard, with its engine key
    # and TLS (agent.kvrelay). Off by default: following costs the gateway
    # a /tokenize per request and the guard a relay.
    kv_events: bool = False
    # Most tokens one answer may generate; the gateway applies it (sets
    # max_tokens when the client gave no limit, lowers a larger one). None: no
    # cap, and a client that sets no limit lets the engine run to its context.
    max_output_tokens: int | None = Field(None, ge=1)
    # What its tokens cost; None: free (budgets are not spent on it).
    price: ModelPrice | None = None
    # Requests one replica runs at once; the gateway holds the rest in its
    # queue, ordered by priority class and fair between teams
    # (llmgw.gateway.admission). None: the engine's own setting where the
    # catalog states one (llmgw.control.concurrency), else no cap, and the
    # engine queues whatever it is sent, first come first served.
    max_concurrency: int | None = Field(None, ge=1, le=1_000_000)
    sim: SimParams | None = None
    # Existing servers to route to instead of an engine to run (engine
    # ``external``, which is also what an entry with this and no engine gets).
    external: ExternalSpec | None = None
    # A LoRA adapter of the model named here (its base): it takes no devices
    # of its own and is loaded on replicas of its base (control.adapters).
    # Clients name the adapter; /v1/models lists it with this as ``parent``.
    base: str | None = None
    adapter: AdapterSpec | None = None

    @model_validator(mode="before")
    @classmethod
    def _external_engine(cls, data: object) -> object:
        # ``engine: external`` would only repeat what ``external:`` says.
        if isinstance(data, dict) and data.get("external") is not None and "engine" not in data:
            return {**data, "engine": EngineKind.EXTERNAL.value}
        return data

    @model_validator(mode="after")
    def _adapter_block(self) -> ModelSpec:
        # ``base:`` alone makes an adapter of the default rank; an adapter
        # block without a base would be a setting nothing reads.
        if self.base is not None and self.adapter is None:
            self.adapter = AdapterSpec()
        if self.adapter is not None and self.base is None:
            raise ValueError("'adapter' applies only to a LoRA adapter: name its 'base' model")
        if self.base is not None and not _NAME_RE.match(self.base):
            raise ValueError(f"base {self.base!r} is not a valid model name")
        return self

    @field_validator("name", "aliases")
    @classmethod
    def _plain_names(cls, value: str | list[str]) -> str | list[str]:
        for item in [value] if isinstance(value, str) else value:
            if not _NAME_RE.match(item):
                raise ValueError(
                    f"{item!r} is not a valid name: use letters, digits and . _ : / @ + -,"
                    " starting with a letter or digit"
                )
        return value

    @property
    def on_demand(self) -> bool:
        return self.min_replicas == 0

    @property
    def is_adapter(self) -> bool:
        return self.base is not None
