"""llama.cpp: the ``llama-server`` binary when installed, else ``python -m llama_cpp.server``.

The two speak different dialects (``--alias`` vs ``--model_alias``, ``/health``
vs ``/v1/models`` for readiness: ``llama_cpp.server`` answers 404 on
``/health``), so the adapter decides once, at construction, which one this
node has and builds for it.

Chat templates come from the model: a GGUF that carries one
(``tokenizer.chat_template``) is started with no template flag, and both
servers apply it. Some GGUF files carry none (the starter Gemma 3 270M
among them), and both servers then fall back to a format that garbles the
model's turns or drops its system messages (llama_cpp.server's ``gemma``
format discards them; current llama-server takes ``--chat-template gemma``
as the template's text). For such a file of a family llmgw knows (by its
``general.architecture``), the agent supplies the family's official template
(llmgw.agent.engines.templates), unless the catalog chose one.
"""

from __future__ import annotations

import shutil
import sys

from llmgw import memory
from llmgw.agent.engines.base import (
    EngineLaunch,
    FlagRules,
    LaunchContext,
    check_common,
    has_flag,
    launch_env,
    require_weights,
    uses_gpus,
)
from llmgw.agent.engines.llamacpppython import (
    CONTEXT_HINT,
    PYTHON_DIALECT,
    PYTHON_RULES,
    declared_template,
    python_argv,
    python_true,
)
from llmgw.agent.engines.templates import SuppliedTemplate, supplied_for
from llmgw.agent.progress import LLAMA_SERVER_METRICS
from llmgw.engine_env import LLAMA_CPP_PYTHON_DROP, LLAMA_SERVER_DROP
from llmgw.errors import EngineError
from llmgw.sleepmode import LLAMA_SERVER_IDLE_FLAG
from llmgw.wire import EngineDialect, EngineKind, ExtraRoute, ReplicaAssignment

SERVER_BINARY = "llama-server"

_LORA_HINT = ("make each adapter a catalog entry with `base:` this model; clients then name"
              " the adapter as a model")
# llama-server (common/arg.cpp of the llama.cpp that llama-cpp-python 0.3.36
# bundles): exact names only, with "_" read as "-" in a long flag. Every
# spelling of the model source is managed: -hf, -dr or --models-dir would
# load another model than the agent's weights, --api-prefix moves the routes.
BINARY_RULES = FlagRules(
    managed=frozenset(
        [
            "-m",
            "--model",
            "-a",
            "--alias",
            "--host",
            "--port",
            "--api-key",
            "--api-key-file",
            "--api-prefix",
            "-hf",
            "-hfr",
            "--hf-repo",
            "-hff",
            "--hf-file",
            "-mu",
            "--model-url",
            "-dr",
            "--docker-repo",
            "--models-dir",
            "--models-preset",
            "-c",
            "--ctx-size",
            # A chat template in the catalog replaces the model's own; a
            # family name is no template to current llama-server (it reads
            # the text as Jinja), so only a file or the model's own counts.
            "--chat-template",
            # TLS only in builds with OpenSSL, which the agent does not tell
            # apart: it starts llama-server plain, and a catalog's flags
            # would make it https while its endpoint says http.
            "--ssl-key-file",
            "--ssl-cert-file",
            # The catalog's adapters (base: this model) are started here, in
            # the order the gateway numbers them (EngineDialect.lora_ids): one
            # more from the catalog's args would shift every number after it.
            "--lora",
            "--lora-scaled",
            "--lora-init-without-apply",
        ]
    ),
    dashes=True,
    hints={
        "-c": CONTEXT_HINT,
        "--ctx-size": CONTEXT_HINT,
        "--chat-template": "llama-server reads its value as the template's Jinja text, not a"
        " name; give a file with --chat-template-file, or leave the model's own",
        "--lora": _LORA_HINT,
        "--lora-scaled": _LORA_HINT,
        "--lora-init-without-apply": _LORA_HINT,
    },
)
# llama-server sends stream usage when asked (server-task.cpp, an empty-choices
# chunk). It reads max_completion_tokens only since early 2026
# (server-schema.cpp, an alias of n_predict); builds before it generate to
# their context: the gateway sends the limit as max_tokens, which every build
# reads alike, since the agent cannot tell the builds apart without running
# one. /tokenize takes {"content": ...}. It maps a "developer" message to
# "system" itself, except for GPT-OSS, whose template tells them apart
# (common/chat.cpp): the gateway leaves the role alone. It serves
# /v1/responses; embeddings only with --embedding, rerank only with
# --reranking, transcriptions only with an audio projector (_dialect).
SERVER_DIALECT = EngineDialect(
    max_completion_tokens=False,
    tokenize_path="/tokenize",
    tokenize_field="content",
    embeddings=False,
)
# llama-server (since llama.cpp b6700-ish, PR 16391, and so in the one
# llama-cpp-python 0.3.36 bundles) keeps a prompt cache of saved slot states
# in host RAM, 8 GiB by default (-cram/--cache-ram, in MiB; 0 turns it off,
# -1 lifts the limit): a small replica's budget is gone long before that.
# It counts the bytes of the states it holds exactly, unlike
# llama_cpp.server's cache, so it gets this fraction of the room the budget
# leaves after the runtime, the weights and the KV cache; the other half is
# the allocator's slack and the compute buffers a long prompt grows.
SERVER_CACHE_RAM_SHARE = 2


def _server_sets(extra: list[str], *flags: str) -> bool:
    """Whether a catalog arg list sets one of ``flags``, read as llama-server reads it."""
    return has_flag([_dashed(item) for item in extra], *flags)


def _dialect(
    server: bool, extra: list[str], template: SuppliedTemplate | None = None,
    adapters: tuple[tuple[str, str], ...] = (),
) -> EngineDialect:
    """The launch's dialect, with the OpenAI routes and fields its flags give it.

    llama-server serves /v1/responses always (server.cpp), /v1/rerank only
    when started with --reranking (a reranker model), and
    /v1/audio/transcriptions only with an audio projector (-mm); llama_cpp.server
    serves none of them. Both compute embeddings only when started for them
    (``--embedding``; llama_cpp.server answers 500 otherwise, llama-server
    501). llama_cpp.server returns logprobs only with ``--logits_all true``,
    which the agent turns off unless the catalog sets it (llamacpppython.python_memory_flags).
    llama_cpp.server reports no stream usage: the template it was given goes with
    its dialect (declared_template).
    """
    if not server:
        return PYTHON_DIALECT.model_copy(
            update={
                "chat_template": declared_template(template, extra),
                "extra_routes": [],
                "embeddings": python_true(extra, "embedding"),
                "logprobs": python_true(extra, "logits_all"),
            }
        )
    routes: list[ExtraRoute] = ["/v1/responses"]
    if _server_sets(extra, "--reranking", "--rerank"):
        routes.append("/v1/rerank")
    if _server_sets(extra, "-mm", "--mmproj", "-mmu", "--mmproj-url"):
        routes.append("/v1/audio/transcriptions")
    embeds = _server_sets(extra, "--embedding", "--embeddings")
    return SERVER_DIALECT.model_copy(update={
        "extra_routes": routes, "embeddings": embeds,
        "lora_ids": {name: number for number, (name, _) in enumerate(adapters)},
    })


def _dashed(item: str) -> str:
    # llama-server reads "_" as "-" in a long flag's name (not in its value).
    if not item.startswith("--"):
        return item
    name, sep, value = item.partition("=")
    return name.replace("_", "-") + sep + value


def _server_memory_flags(ctx: LaunchContext, extra: list[str]) -> list[str]:
    """Flags that keep llama-server's RSS within the replica's memory budget."""
    budget = ctx.memory_budget_mib
    if ctx.adapters:
        # Its RAM prompt cache keeps a saved state with its tokens only, not
        # the adapters it was computed under, and a slot loads one by tokens
        # alone (server-context.cpp, get_available_slot): a request for one
        # adapter would continue another's KV cache. Off, whatever is asked.
        return ["--cache-ram", "0"]
    if budget is None or _server_sets(extra, "-cram", "--cache-ram"):
        return []
    spec = ctx.assignment.model
    weights_mib = -(-(ctx.weights_bytes or 0) // memory.MIB)
    room = budget - memory.LLAMACPP_RUNTIME_MIB - memory.kv_cache_mib(spec) - weights_mib
    # 0 when nothing is left: the cache off, never -1 (no limit).
    return ["--cache-ram", str(max(0, room) // SERVER_CACHE_RAM_SHARE)]


# llama-server reads /etc/llama.cpp/config.ini and then
# ${XDG_CONFIG_HOME:-~/.config}/llama.cpp/config.ini before its environment
# and argv (common/arg.cpp): a per-user file would set what the agent leaves
# to defaults (an API key file, a prefix for every route...). The agent's
# user's file is neutralised by pointing XDG_CONFIG_HOME where no file can
# be; the system-wide one is the node's root's to keep.
NO_CONFIG_HOME = "/dev/null"


def _server_argv(
    binary: str,
    ctx: LaunchContext,
    path: str,
    template: SuppliedTemplate | None,
    gpu: bool,
    extra: list[str],
) -> tuple[list[str], str, str | None]:
    """llama-server's command line before the catalog's own flags; its health path, and
    None: the health path is probed while serving too (llama-server answers /health
    from its HTTP threads, beside the busy slots)."""
    spec = ctx.assignment.model
    argv = [
        binary,
        "--model",
        path,
        "--alias",
        spec.name,
        "--host",
        ctx.host,
        "--port",
        str(ctx.port),
        "--ctx-size",
        str(spec.kv_capacity_tokens),
    ]
    if gpu and not _server_sets(extra, "-ngl", "--n-gpu-layers", "--gpu-layers"):
        argv += ["--n-gpu-layers", "999"]
    if template is not None and not _server_sets(extra, "--chat-template-file"):
        argv += ["--chat-template-file", template.jinja]
    # /metrics (off by default): llamacpp:n_decode_total moves with
    # every batch computed, the agent's sign of progress.
    if not _server_sets(extra, "--metrics"):
        argv.append("--metrics")
    for _, adapter_path in ctx.adapters:
        # One flag each: llama-server splits a --lora value at commas.
        argv += ["--lora", adapter_path]
    if ctx.adapters:
        # Loaded at scale 0: each request says which one it runs with.
        argv.append("--lora-init-without-apply")
    argv += _server_memory_flags(ctx, extra)
    health = "/health"
    return argv, health, None


def _sleep_seconds(value: str) -> bool:
    """Whether llama-server takes ``value`` for --sleep-idle-seconds (common/arg.cpp)."""
    try:
        seconds = int(value)
    except ValueError:
        return False
    return seconds > 0 or seconds == -1


class LlamaCppAdapter:
    def __init__(
        self,
        server_binary: str | None = None,
        python: str | None = None,
        *,
        vulkan: bool = False,
        kind: EngineKind = EngineKind.LLAMACPP,
    ) -> None:
        # None: look for llama-server on PATH now; "" forces the Python server.
        self.server_binary = shutil.which(SERVER_BINARY) if server_binary is None else server_binary
        # The Python that runs llama_cpp.server: the agent's own unless told.
        self.python = python or sys.executable
        # The catalog's engine kind this adapter serves: llamacpp (whichever
        # server the node has), or llama-server / llama-cpp-python by name.
        self.kind = kind
        # A Vulkan build is pinned by Vulkan index and cannot use MIG
        # instances; a CUDA build (the usual one on NVIDIA) by UUID.
        self.vulkan = vulkan

    @property
    def managed_flags(self) -> FlagRules:
        return BINARY_RULES if self.server_binary else PYTHON_RULES

    guards_every_route = False

    @property
    def adapters_at_start(self) -> bool:
        """llama-server loads LoRA adapters only when it starts (``--lora``) and applies
        them per request; llama_cpp.server applies one to every request, so it takes none."""
        return bool(self.server_binary)

    def validate(self, assignment: ReplicaAssignment) -> None:
        check_common(assignment, self.managed_flags)
        if assignment.nodes > 1:
            raise EngineError("llama.cpp replicas run on one node; nodes must be 1")
        idle = memory.flag_value([_dashed(a) for a in assignment.model.engine_args],
                                 (LLAMA_SERVER_IDLE_FLAG,))  # fmt: skip
        if self.server_binary and idle is not None and not _sleep_seconds(idle):
            raise EngineError(f"{LLAMA_SERVER_IDLE_FLAG} {idle!r}: llama-server takes a whole"
                              " number of seconds above 0, or -1 to never sleep")
        if assignment.adapters and not self.server_binary:
            raise EngineError(
                f"model {assignment.model.name!r}: LoRA adapters need llama-server, which this"
                " node does not have (llama_cpp.server applies one adapter to every request)"
            )
        if assignment.model.weights.kind == "none":
            raise EngineError(f"model {assignment.model.name!r}: llama.cpp needs a GGUF file")

    def build(self, ctx: LaunchContext) -> EngineLaunch:
        self.validate(ctx.assignment)
        spec = ctx.assignment.model
        path = require_weights(ctx)
        extra = spec.engine_args
        # The family's template where the model carries none of its own.
        template = supplied_for(path)
        gpu = uses_gpus(ctx.devices)
        if self.server_binary:
            argv, health, liveness = _server_argv(
                self.server_binary, ctx, path, template, gpu, extra
            )
        else:
            argv, health, liveness = python_argv(self.python, ctx, path, template, gpu, extra)
        argv += extra
        env = launch_env(spec, ctx.devices, vulkan=self.vulkan)
        key = ctx.assignment.engine_key
        if key is not None:
            # From the environment, not --api-key/--api_key: argv is
            # world-readable in /proc. llama-server reads LLAMA_API_KEY;
            # llama_cpp.server's settings read API_KEY (pydantic-settings).
            # Both then refuse /v1 (and the tokenizer routes) without it.
            env["LLAMA_API_KEY" if self.server_binary else "API_KEY"] = key
        if self.server_binary:
            env["XDG_CONFIG_HOME"] = NO_CONFIG_HOME
        for name, adapter_path in ctx.adapters:
            if "," in adapter_path:
                raise EngineError(f"adapter {name!r}: llama-server splits --lora at commas,"
                                  f" and its weights path has one: {adapter_path}")
        dialect = _dialect(bool(self.server_binary), extra, template, ctx.adapters)
        return EngineLaunch(
            argv=argv,
            env=env,
            health_path=health,
            liveness_path=liveness,
            progress=LLAMA_SERVER_METRICS if self.server_binary else None,
            dialect=dialect,
            # llama-server stays plain (see BINARY_RULES).
            tls=ctx.tls is not None and not self.server_binary,
            # What this server would read over the argv above (llmgw.engine_env).
            drop_env=LLAMA_SERVER_DROP if self.server_binary else LLAMA_CPP_PYTHON_DROP,
        )
