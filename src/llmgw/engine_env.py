"""Environment variables that engines read as their own settings.

The agent passes its environment on to every engine (PATH, HOME, proxies...).
Some engines also take settings from plain variables, and some of those beat
the command line the agent builds (read in the engines' sources):

* llama_cpp.server (llama-cpp-python 0.3.36) is a pydantic-settings model: it
  reads every setting from a variable of the same name, in any case (``MODEL``,
  ``N_CTX``, ``CACHE``, ``VERBOSE``...), wherever the flag is not given; and
  its ``__main__`` reads ``HOST``, ``PORT`` and ``CONFIG_FILE`` over the
  parsed flags (a config file replaces every flag). A ``PORT`` that a
  container platform left in the agent's environment moves every engine off
  the port the agent probes and the gateway calls.
* llama-server (the llama.cpp server that llama-cpp-python 0.3.36 bundles)
  reads ``LLAMA_ARG_*`` variables, and ``LLAMA_API_KEY``, for the flags its
  command line does not give (common/arg.cpp). One for a flag the agent
  manages without passing it (an API key, an API prefix, a Hugging Face repo)
  changes what the agent started.

So the agent drops these from what such an engine inherits, and a catalog
``env`` may not set them: the catalog refuses them when the model is applied,
the agent again at launch. An engine's settings belong in ``engine_args``,
where the flags the agent manages are refused by name.

Beyond that, a catalog ``env`` may set only what the engine documents as its
own settings (:data:`ENV_RULES`, an allow-list per engine): an environment
is code execution otherwise (``LD_PRELOAD``, ``LD_LIBRARY_PATH``,
``PYTHONPATH`` load other code into the engine, which runs as the agent's
user), and the admin token that writes the catalog must not be a shell on
every node. Even within an engine's own family, names that load code, open
a listener or route llmgw does not guard, or turn off a safety check are
refused (``VLLM_SERVER_DEV_MODE`` mounts unauthenticated admin routes,
``VLLM_PLUGINS``, ``SGLANG_GRPC_PORT`` a listener without the API key...).
A node's own admin may allow more names on that node only
(``llmgw agent --engine-env-allow NAME``); the control plane accepts such a
name when a registered node allows it, and every other node refuses it.

This module is shared by the control plane (catalog checks) and the agent
(launch), which is why it lives beside ``llmgw.wire`` and imports nothing else.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from llmgw.wire import LLAMACPP_KINDS, EngineKind

# Every field of llama_cpp.server's Settings (ServerSettings + ModelSettings in
# llama_cpp/server/settings.py), plus the CONFIG_FILE its __main__ reads.
# tests/agent/test_engines.py checks the list against the installed package.
LLAMA_CPP_PYTHON_SETTINGS = frozenset(
    {
        "api_key", "cache", "cache_size", "cache_type", "chat_format",
        "chat_template_kwargs", "clip_model_path", "config_file", "disable_ping_events",
        "draft_model", "draft_model_num_pred_tokens", "embedding", "flash_attn",
        "hf_model_repo_id", "hf_pretrained_model_name_or_path", "hf_tokenizer_config_path",
        "host", "interrupt_requests", "kv_overrides", "last_n_tokens_size", "logits_all",
        "lora_base", "lora_path", "main_gpu", "model", "model_alias", "mul_mat_q", "n_batch",
        "n_ctx", "n_gpu_layers", "n_threads", "n_threads_batch", "n_ubatch", "numa",
        "offload_kqv", "port", "root_path", "rope_freq_base", "rope_freq_scale",
        "rope_scaling_type", "rpc_servers", "seed", "split_mode", "ssl_certfile",
        "ssl_keyfile", "tensor_split", "type_k", "type_v", "use_mlock", "use_mmap",
        "verbose", "vocab_only", "yarn_attn_factor", "yarn_beta_fast", "yarn_beta_slow",
        "yarn_ext_factor", "yarn_orig_ctx",
    }
)  # fmt: skip
# The settings the agent gives llama_cpp.server itself (its managed flags,
# agent.engines.llamacpp): where it listens, what it serves and how.
LLAMA_CPP_PYTHON_MANAGED = frozenset(
    {
        "model", "model_alias", "host", "port", "api_key", "config_file", "n_ctx",
        "interrupt_requests", "ssl_keyfile", "ssl_certfile",
    }
)  # fmt: skip
# llama-server's variables for the flags the agent manages (set_env in
# common/arg.cpp), with the flag each stands for.
LLAMA_SERVER_MANAGED_ENV = {
    "LLAMA_ARG_MODEL": "--model",
    "LLAMA_ARG_ALIAS": "--alias",
    "LLAMA_ARG_HOST": "--host",
    "LLAMA_ARG_PORT": "--port",
    "LLAMA_API_KEY": "--api-key",
    "LLAMA_ARG_HF_REPO": "--hf-repo",
    "LLAMA_ARG_HF_FILE": "--hf-file",
    "LLAMA_ARG_MODEL_URL": "--model-url",
    "LLAMA_ARG_DOCKER_REPO": "--docker-repo",
    "LLAMA_ARG_API_PREFIX": "--api-prefix",
    "LLAMA_ARG_MODELS_DIR": "--models-dir",
    "LLAMA_ARG_MODELS_PRESET": "--models-preset",
    "LLAMA_ARG_CTX_SIZE": "--ctx-size",
    "LLAMA_ARG_SSL_KEY_FILE": "--ssl-key-file",
    "LLAMA_ARG_SSL_CERT_FILE": "--ssl-cert-file",
    # Read before LLAMA_API_KEY (arg.cpp): a key file would replace the engine key.
    "LLAMA_ARG_API_KEY_FILE": "--api-key-file",
}

# The variable other engines read their API key from: the agent sets it to
# the replica's engine key (the key stays off the command line, which
# /proc/PID/cmdline shows every user of the node) and drops it otherwise.
# llama.cpp's (API_KEY, LLAMA_API_KEY) are among its managed settings above.
ENGINE_KEY_ENV = {EngineKind.VLLM: "VLLM_API_KEY", EngineKind.SIM: "LLMGW_ENGINE_KEY"}

# Upper-case names dropped from what each llama.cpp server inherits.
LLAMA_CPP_PYTHON_DROP = frozenset(name.upper() for name in LLAMA_CPP_PYTHON_SETTINGS)
LLAMA_SERVER_DROP = frozenset(LLAMA_SERVER_MANAGED_ENV)


@dataclass(frozen=True)
class EnvRules:
    """The variables a catalog may set for one engine: names, families, and what is never."""

    names: frozenset[str]
    prefixes: tuple[str, ...] = ()
    # Parts of a name that make it unsafe even in an allowed family: it loads
    # code or a library, opens a listener or a route llmgw does not guard,
    # points the engine at another server, or turns off a safety check.
    unsafe_parts: tuple[str, ...] = ()

    def allows(self, upper: str) -> bool:
        if upper in self.names:
            return True
        if not upper.startswith(self.prefixes):
            return False
        if upper.endswith("_HOST") and self.unsafe_parts:  # a peer to talk to
            return False
        return not any(part in upper for part in self.unsafe_parts)

    def describe(self) -> str:
        own = ", ".join(f"{prefix}*" for prefix in self.prefixes)
        common = "thread counts, Hugging Face offline switches and token, NCCL interfaces"
        return f"{own}, and {common}" if own else common


# What every engine may be given: thread counts, offline switches for the
# Hugging Face libraries (weights come from the agent), the token for gated
# repos, and the network interface of a multi-node replica's collectives.
_COMMON = frozenset(
    {
        "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TOKENIZERS_PARALLELISM",
        "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE",
        "HF_HUB_DISABLE_TELEMETRY", "HF_TOKEN", "HF_HOME", "HF_HUB_CACHE",
        "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_DEBUG", "NCCL_IB_DISABLE",
        "NCCL_P2P_DISABLE", "CUDA_LAUNCH_BLOCKING", "CUDA_MODULE_LOADING",
        "PYTORCH_CUDA_ALLOC_CONF", "TZ",
    }
)  # fmt: skip
# Read in the engines' sources (vllm/envs.py 0.32, sglang/srt/environ.py
# 0.5.23, llama.cpp common/arg.cpp): each of these in a family marks a name
# that loads code or a shared library (PLUGIN, SO_PATH, APP_PATH,
# RUST_*), deserialises pickles (PICKLE, INSECURE), opens a port or names a
# peer (_PORT, HOST_IP, *_HOST, ADDR, URL, GRPC, RPC), mounts routes without the key
# (DEV_MODE, RUNTIME_LORA, LORA_RESOLVER, EXPOSE_OWN_ENV), loads a logging
# configuration (whose factories are code), writes or logs where the node's
# admin did not choose (DEBUG_DUMP, DEBUG_LOG, LOG_FILE, SAVE_PATH), or sets a key.
_UNSAFE_PARTS = (
    "PLUGIN", "SO_PATH", "APP_PATH", "RUST_", "PICKLE", "INSECURE", "_PORT", "HOST_IP",
    "ADDR", "URL", "GRPC", "RPC", "DEV_MODE", "RUNTIME_LORA", "LORA_RESOLVER",
    "EXPOSE_OWN_ENV", "LOGGING_CONFIG", "DEBUG_DUMP", "DEBUG_LOG", "LOG_FILE", "SAVE_PATH",
    "REDIRECT", "API_KEY", "USAGE_STATS_SERVER",
)  # fmt: skip
ENV_RULES: dict[EngineKind, EnvRules] = {
    EngineKind.VLLM: EnvRules(_COMMON, ("VLLM_",), _UNSAFE_PARTS),
    EngineKind.SGLANG: EnvRules(_COMMON, ("SGLANG_", "SGL_"), _UNSAFE_PARTS),
    # llama-server's LLAMA_ARG_* (the managed ones refused above) and
    # ggml's GGML_*; llama_cpp.server reads only its settings' names, all
    # of which belong in engine_args.
    EngineKind.LLAMACPP: EnvRules(_COMMON, ("LLAMA_ARG_", "GGML_"), _UNSAFE_PARTS),
    EngineKind.SIM: EnvRules(_COMMON),
}
# Either llama.cpp server by name: the same rules as the node's default one.
ENV_RULES.update({kind: ENV_RULES[EngineKind.LLAMACPP] for kind in LLAMACPP_KINDS})


def env_problem(engine: EngineKind, name: str, node_allowed: Collection[str] = ()) -> str | None:
    """Why a catalog ``env`` entry may not be set for ``engine``; None when it may.

    Matched in any case: pydantic-settings reads ``port`` as it reads ``PORT``.
    The catalog cannot know which llama.cpp server a node runs, so a llama.cpp
    model is checked against both. ``node_allowed``: names a node's admin
    allows beyond the engine's own settings (never a managed one).
    """
    engine = EngineKind(engine)  # a catalog entry may hold its plain value
    upper = name.upper()
    managed = _managed_problem(engine, name, upper)
    if managed is not None:
        return managed
    # An engine without rules of its own gets only what every engine may.
    rules = ENV_RULES.get(engine, EnvRules(_COMMON))
    if rules.allows(upper) or name in node_allowed:
        return None
    return (
        f"{name} is not a {engine.value} setting a catalog may give ({rules.describe()};"
        " none that loads code, opens a port or unguarded routes: docs/catalog.md); other"
        " variables can run other code in the engine (LD_PRELOAD, PYTHONPATH...). A node's"
        f" admin may allow it on that node: llmgw agent --engine-env-allow {name}"
    )


def _managed_problem(engine: EngineKind, name: str, upper: str) -> str | None:
    if upper == ENGINE_KEY_ENV.get(engine):
        return (
            f"{engine.value} reads {name} as its API key, which the agent sets to the"
            " replica's engine key; remove it"
        )
    if engine not in LLAMACPP_KINDS:
        return None
    if upper in LLAMA_CPP_PYTHON_DROP:
        setting = upper.lower()
        if setting in LLAMA_CPP_PYTHON_MANAGED:
            return (
                f"llama_cpp.server reads {name} as its {setting} setting, over the agent's"
                f" command line, and the agent manages --{setting}; remove it"
            )
        return (
            f"llama_cpp.server reads {name} as its {setting} setting, over the agent's"
            f" command line; use --{setting} in engine_args instead"
        )
    if upper in LLAMA_SERVER_DROP:
        return (
            f"llama-server reads {name} as {LLAMA_SERVER_MANAGED_ENV[upper]},"
            " which the agent manages; remove it"
        )
    return None
