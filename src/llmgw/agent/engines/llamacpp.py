"""llama.cpp: the ``llama-server`` binary when installed, else ``python -m llama_cpp.server``.

The two speak different dialects (``--alias`` vs ``--model_alias``, ``/health``
vs ``/v1/models`` for readiness: ``llama_cpp.server`` answers 404 on
``/health``), so the adapter decides once, at construction, which one this
node has and builds for it.

Gemma GGUF files ship without a chat template, and both servers then fall
back to a format that garbles Gemma's turns; for a model that looks like
Gemma (by served name or file name) the adapter selects the ``gemma`` chat
format unless the catalog chose one. Any other model keeps the template from
its GGUF.
"""

from __future__ import annotations

import os
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
from llmgw.engine_env import (
    LLAMA_CPP_PYTHON_DROP,
    LLAMA_CPP_PYTHON_MANAGED,
    LLAMA_CPP_PYTHON_SETTINGS,
    LLAMA_SERVER_DROP,
)
from llmgw.errors import EngineError
from llmgw.wire import EngineDialect, EngineKind, ExtraRoute, ReplicaAssignment

SERVER_BINARY = "llama-server"

# The context is the model's kv_capacity_tokens, so that the gateway's
# prefix index and the engine's cache agree on what one replica holds.
_CONTEXT_HINT = "set the model's kv_capacity_tokens instead"
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
            # TLS only in builds with OpenSSL, which the agent does not tell
            # apart: it starts llama-server plain, and a catalog's flags
            # would make it https while its endpoint says http.
            "--ssl-key-file",
            "--ssl-cert-file",
        ]
    ),
    dashes=True,
    hints={"-c": _CONTEXT_HINT, "--ctx-size": _CONTEXT_HINT},
)
# llama_cpp.server: Python argparse over its settings' names (underscores
# kept), so a unique prefix counts; its own flags (--cache of --cache_size)
# are read as themselves.
PYTHON_RULES = FlagRules(
    managed=frozenset(f"--{name}" for name in LLAMA_CPP_PYTHON_MANAGED),
    abbreviations=True,
    flags=frozenset(f"--{name}" for name in LLAMA_CPP_PYTHON_SETTINGS),
    hints={
        "--n_ctx": _CONTEXT_HINT,
        "--interrupt_requests": "the agent starts it with false: with true a second request"
        " cuts a running stream short",
    },
)


# llama-server sends stream usage when asked (server-task.cpp, an empty-choices
# chunk) but reads its limit from max_tokens/n_predict only: the gateway sends
# max_completion_tokens as max_tokens. /tokenize takes {"content": ...}.
# Its built-in templates (gemma's among them) write a "developer" turn under
# that name, which the model was never trained on: sent as "system". It
# computes embeddings only with --embedding (_dialect).
SERVER_DIALECT = EngineDialect(
    max_completion_tokens=False,
    tokenize_path="/tokenize",
    tokenize_field="content",
    developer_role=False,
    embeddings=False,
)
# llama_cpp.server's request models drop both max_completion_tokens and
# stream_options (llama_cpp/server/types.py): no limit, no stream usage. Its
# /extras/tokenize/count tokenizes as generation does (BOS, special tokens).
# It runs a non-streamed completion in a threadpool worker with no check of
# the connection (server/app.py: run_in_threadpool), so a client that leaves
# one leaves the engine generating to its limit; a stream it stops between
# two chunks. llama-server checks the connection either way.
# Its chat request model knows no "developer" role (a 500 carrying pydantic's
# error and its traceback's paths), and it answers one choice whatever ``n``
# asks (llama_chat_format passes no ``n`` on). As the agent starts it (no
# --embedding, --logits_all false) it serves no embeddings and no logprobs;
# the catalog's engine_args may turn either on (_dialect).
PYTHON_DIALECT = EngineDialect(
    max_completion_tokens=False,
    stream_usage=False,
    tokenize_path="/extras/tokenize/count",
    tokenize_field="input",
    stops_unstreamed=False,
    developer_role=False,
    choices=False,
    embeddings=False,
    logprobs=False,
)


# llama_cpp.server's RAM prompt cache counts only llama.cpp's own state
# against --cache_size, not the copy of up to n_batch rows of logits
# (n_vocab floats each: 1 MiB a row for Gemma) kept beside every cached
# prompt. Measured on gemma-3-270m: 40 small requests took the engine from
# 0.5 GB to 2.5 GB of RSS with --cache_size 32 MiB, to 3 GB and still growing
# with 256 MiB; without the cache it stayed near 0.6 GB. So the cache is off
# unless the catalog turns it on (the engine still reuses the longest prefix
# of its last prompt), and then --cache_size is this fraction of the room the
# budget leaves, so that the uncounted copies fit as well.
PROMPT_CACHE_SHARE = 64


def _python_memory_flags(ctx: LaunchContext, extra: list[str]) -> list[str]:
    """Flags that keep llama_cpp.server's RSS within the replica's memory budget."""
    flags: list[str] = []
    # The server's default (unlike the library's) keeps logits for every
    # token of the context: n_ctx x n_vocab floats, about 1 MB per token for
    # Gemma. Only logprobs need them, and the gateway sends none it cannot serve.
    if not has_flag(extra, "--logits_all"):
        flags += ["--logits_all", "false"]
    cache_on = _python_true(extra, "--cache")
    budget = ctx.memory_budget_mib
    if cache_on and budget is not None and not has_flag(extra, "--cache_size"):
        spec = ctx.assignment.model
        weights_mib = -(-(ctx.weights_bytes or 0) // memory.MIB)
        room = budget - memory.LLAMACPP_RUNTIME_MIB - memory.kv_cache_mib(spec) - weights_mib
        cache_bytes = max(0, room) * memory.MIB // PROMPT_CACHE_SHARE
        flags += ["--cache_size", str(cache_bytes)]
    return flags


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


def _python_true(extra: list[str], flag: str) -> bool:
    """Whether a catalog arg list turns one of llama_cpp.server's boolean settings on."""
    return memory.flag_value(extra, (flag,)) in ("true", "True", "1")


def _dialect(server: bool, extra: list[str]) -> EngineDialect:
    """The launch's dialect, with the OpenAI routes and fields its flags give it.

    llama-server serves /v1/rerank only when started with --reranking (a
    reranker model); llama_cpp.server serves none of them. Both compute
    embeddings only when started for them (``--embedding``; llama_cpp.server
    answers 500 otherwise, llama-server 501). llama_cpp.server returns
    logprobs only with ``--logits_all true``, which the agent turns off
    unless the catalog sets it (_python_memory_flags).
    """
    if not server:
        return PYTHON_DIALECT.model_copy(
            update={
                "extra_routes": [],
                "embeddings": _python_true(extra, "--embedding"),
                "logprobs": _python_true(extra, "--logits_all"),
            }
        )
    reranks = _server_sets(extra, "--reranking", "--rerank")
    routes: list[ExtraRoute] = ["/v1/rerank"] if reranks else []
    embeds = _server_sets(extra, "--embedding", "--embeddings")
    return SERVER_DIALECT.model_copy(update={"extra_routes": routes, "embeddings": embeds})


def _dashed(item: str) -> str:
    # llama-server reads "_" as "-" in a long flag's name (not in its value).
    if not item.startswith("--"):
        return item
    name, sep, value = item.partition("=")
    return name.replace("_", "-") + sep + value


def _server_memory_flags(ctx: LaunchContext, extra: list[str]) -> list[str]:
    """Flags that keep llama-server's RSS within the replica's memory budget."""
    budget = ctx.memory_budget_mib
    if budget is None or _server_sets(extra, "-cram", "--cache-ram"):
        return []
    spec = ctx.assignment.model
    weights_mib = -(-(ctx.weights_bytes or 0) // memory.MIB)
    room = budget - memory.LLAMACPP_RUNTIME_MIB - memory.kv_cache_mib(spec) - weights_mib
    # 0 when nothing is left: the cache off, never -1 (no limit).
    return ["--cache-ram", str(max(0, room) // SERVER_CACHE_RAM_SHARE)]


def _looks_like_gemma(name: str, weights_path: str | None) -> bool:
    haystack = name.lower() + " " + os.path.basename(weights_path or "").lower()
    return "gemma" in haystack


class LlamaCppAdapter:
    kind = EngineKind.LLAMACPP

    def __init__(
        self,
        server_binary: str | None = None,
        python: str | None = None,
        *,
        vulkan: bool = False,
    ) -> None:
        # None: look for llama-server on PATH now; "" forces the Python server.
        self.server_binary = shutil.which(SERVER_BINARY) if server_binary is None else server_binary
        self.python = python or sys.executable
        # A Vulkan build is pinned by Vulkan index and cannot use MIG
        # instances; a CUDA build (the usual one on NVIDIA) by UUID.
        self.vulkan = vulkan

    @property
    def managed_flags(self) -> FlagRules:
        return BINARY_RULES if self.server_binary else PYTHON_RULES

    def validate(self, assignment: ReplicaAssignment) -> None:
        check_common(assignment, self.managed_flags)
        if assignment.nodes > 1:
            raise EngineError("llama.cpp replicas run on one node; nodes must be 1")
        if assignment.model.weights.kind == "none":
            raise EngineError(f"model {assignment.model.name!r}: llama.cpp needs a GGUF file")

    def build(self, ctx: LaunchContext) -> EngineLaunch:
        self.validate(ctx.assignment)
        spec = ctx.assignment.model
        path = require_weights(ctx)
        extra = spec.engine_args
        gemma = _looks_like_gemma(spec.name, path)
        gpu = uses_gpus(ctx.devices)
        # None: probe the health path while serving too (llama-server answers
        # /health from its HTTP threads, beside the busy slots).
        liveness: str | None = None
        if self.server_binary:
            argv = [
                self.server_binary,
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
            if gemma and not _server_sets(extra, "--chat-template", "--chat-template-file"):
                argv += ["--chat-template", "gemma"]
            argv += _server_memory_flags(ctx, extra)
            health = "/health"
        else:
            argv = [
                self.python,
                "-m",
                "llama_cpp.server",
                "--model",
                path,
                "--host",
                ctx.host,
                "--port",
                str(ctx.port),
                "--model_alias",
                spec.name,
                "--n_ctx",
                str(spec.kv_capacity_tokens),
                # Its default, true, ends a running stream (as if complete:
                # "[DONE]", no finish_reason) whenever another request waits
                # for the model; with false the second one waits its turn.
                "--interrupt_requests",
                "false",
            ]
            if gpu and not has_flag(extra, "--n_gpu_layers"):
                argv += ["--n_gpu_layers", "-1"]
            if gemma and not has_flag(extra, "--chat_format"):
                argv += ["--chat_format", "gemma"]
            if ctx.tls is not None:
                # Paths only: the key stays in its owner-only file.
                argv += ["--ssl_keyfile", ctx.tls.key_file, "--ssl_certfile", ctx.tls.cert_file]
            argv += _python_memory_flags(ctx, extra)
            health = "/v1/models"
            # Every model route of llama_cpp.server waits for the model lock,
            # so a probe of one would wait for a whole completion. While
            # serving, probe the FastAPI app's own docs page instead: it needs
            # no lock, so it proves the server answers, though not that the
            # model still computes.
            liveness = "/docs"
        argv += extra
        env = launch_env(spec, ctx.devices, vulkan=self.vulkan)
        key = ctx.assignment.engine_key
        if key is not None:
            # From the environment, not --api-key/--api_key: argv is
            # world-readable in /proc. llama-server reads LLAMA_API_KEY;
            # llama_cpp.server's settings read API_KEY (pydantic-settings).
            # Both then refuse /v1 (and the tokenizer routes) without it.
            env["LLAMA_API_KEY" if self.server_binary else "API_KEY"] = key
        dialect = _dialect(bool(self.server_binary), extra)
        return EngineLaunch(
            argv=argv,
            env=env,
            health_path=health,
            liveness_path=liveness,
            dialect=dialect,
            # llama-server stays plain (see BINARY_RULES).
            tls=ctx.tls is not None and not self.server_binary,
            # What this server would read over the argv above (llmgw.engine_env).
            drop_env=LLAMA_SERVER_DROP if self.server_binary else LLAMA_CPP_PYTHON_DROP,
        )
