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
    LaunchContext,
    check_common,
    has_flag,
    require_weights,
    uses_gpus,
)
from llmgw.agent.pinning import engine_env
from llmgw.errors import EngineError
from llmgw.wire import EngineDialect, EngineKind, ReplicaAssignment

SERVER_BINARY = "llama-server"

BINARY_MANAGED = (
    "-m",
    "--model",
    "-a",
    "--alias",
    "--host",
    "--port",
    "--api-key",
    "--api-key-file",
    "-hf",
    "--hf-repo",
    "-mu",
    "--model-url",
)
PYTHON_MANAGED = ("--model", "--model_alias", "--host", "--port", "--api_key", "--config_file")


# llama-server sends stream usage when asked (server-task.cpp, an empty-choices
# chunk) but reads its limit from max_tokens/n_predict only: the gateway sends
# max_completion_tokens as max_tokens. /tokenize takes {"content": ...}.
SERVER_DIALECT = EngineDialect(
    max_completion_tokens=False, tokenize_path="/tokenize", tokenize_field="content"
)
# llama_cpp.server's request models drop both max_completion_tokens and
# stream_options (llama_cpp/server/types.py): no limit, no stream usage. Its
# /extras/tokenize/count tokenizes as generation does (BOS, special tokens).
PYTHON_DIALECT = EngineDialect(
    max_completion_tokens=False,
    stream_usage=False,
    tokenize_path="/extras/tokenize/count",
    tokenize_field="input",
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
    cache_on = memory.flag_value(extra, ("--cache",)) in ("true", "True", "1")
    budget = ctx.memory_budget_mib
    if cache_on and budget is not None and not has_flag(extra, "--cache_size"):
        spec = ctx.assignment.model
        weights_mib = -(-(ctx.weights_bytes or 0) // memory.MIB)
        room = budget - memory.LLAMACPP_RUNTIME_MIB - memory.kv_cache_mib(spec) - weights_mib
        cache_bytes = max(0, room) * memory.MIB // PROMPT_CACHE_SHARE
        flags += ["--cache_size", str(cache_bytes)]
    return flags


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
    def managed_flags(self) -> tuple[str, ...]:
        return BINARY_MANAGED if self.server_binary else PYTHON_MANAGED

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
            ]
            if gpu and not has_flag(extra, "-ngl", "--n-gpu-layers", "--gpu-layers"):
                argv += ["--n-gpu-layers", "999"]
            if gemma and not has_flag(extra, "--chat-template", "--chat-template-file"):
                argv += ["--chat-template", "gemma"]
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
            ]
            if gpu and not has_flag(extra, "--n_gpu_layers"):
                argv += ["--n_gpu_layers", "-1"]
            if gemma and not has_flag(extra, "--chat_format"):
                argv += ["--chat_format", "gemma"]
            argv += _python_memory_flags(ctx, extra)
            health = "/v1/models"
            # Every model route of llama_cpp.server waits for the model lock,
            # and a request waiting for it makes a running stream stop early
            # (interrupt_requests). While serving, probe the FastAPI app's own
            # docs page instead: it needs no lock, so it proves the server
            # answers, though not that the model still computes.
            liveness = "/docs"
        argv += extra
        env = dict(spec.env)
        env.update(engine_env(ctx.devices, vulkan=self.vulkan))
        dialect = SERVER_DIALECT if self.server_binary else PYTHON_DIALECT
        return EngineLaunch(
            argv=argv, env=env, health_path=health, liveness_path=liveness, dialect=dialect
        )
