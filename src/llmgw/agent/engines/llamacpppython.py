"""llama-cpp-python's server (``python -m llama_cpp.server``): the flags the agent manages,
what its API gets wrong, and its command line (used by agent.engines.llamacpp).

Its settings are Python argparse over pydantic field names (underscores kept,
unique prefixes accepted), read here as the engine reads them.
"""

from __future__ import annotations

import json
from pathlib import Path

from llmgw import memory
from llmgw.agent.engines.base import FlagRules, LaunchContext
from llmgw.agent.engines.templates import SuppliedTemplate
from llmgw.engine_env import LLAMA_CPP_PYTHON_MANAGED, LLAMA_CPP_PYTHON_SETTINGS
from llmgw.wire import ChatTemplate, EngineDialect

# The context is the model's kv_capacity_tokens, so that the gateway's
# prefix index and the engine's cache agree on what one replica holds.
CONTEXT_HINT = "set the model's kv_capacity_tokens instead"


# llama_cpp.server: Python argparse over its settings' names (underscores
# kept), so a unique prefix counts; its own flags (--cache of --cache_size)
# are read as themselves.
PYTHON_RULES = FlagRules(
    managed=frozenset(f"--{name}" for name in LLAMA_CPP_PYTHON_MANAGED),
    abbreviations=True,
    flags=frozenset(f"--{name}" for name in LLAMA_CPP_PYTHON_SETTINGS),
    hints={
        "--n_ctx": CONTEXT_HINT,
        "--interrupt_requests": "the agent starts it with false: with true a second request"
        " cuts a running stream short",
    },
)


# llama_cpp.server's request models drop both max_completion_tokens and
# stream_options (llama_cpp/server/types.py): no limit, no stream usage. Its
# /extras/tokenize/count tokenizes as generation does (BOS, special tokens).
# It runs a non-streamed completion in a threadpool worker with no check of
# the connection (server/app.py: run_in_threadpool), so a client that leaves
# one leaves the engine generating to its limit; a stream it stops between
# two chunks. llama-server checks the connection either way.
# It computes one request at a time (one lock around the model), and its
# prompt cache holds whole states (concurrent false).
# Its chat request model knows no "developer" role (a 500 carrying pydantic's
# error and its traceback's paths), and it answers one choice whatever ``n``
# asks (llama_chat_format passes no ``n`` on). As the agent starts it (no
# --embedding, --logits_all false) it serves no embeddings and no logprobs;
# the catalog's engine_args may turn either on (_dialect).
PYTHON_DIALECT = EngineDialect(
    concurrent=False,
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
# With the cache on, every save and every load of a prompt state copies its
# logits rows too (min(prompt, n_batch) of them), though nothing reads them
# without logits_all: at the default n_batch of 512, Gemma's are 537 MB, and
# a cached prompt's load took 2.45 s against its 541 tokens' prefill of 2.1 s
# (gemma-3-270m, one thread), so a cache hit saved nothing. At 128 rows a
# load took 0.04 s and a save 0.03 s (1.15 s at 512), the prefill unchanged
# (prompts are evaluated n_batch tokens a call; 64 rows cost 4 % of its speed).
PROMPT_CACHE_N_BATCH = 128


def python_memory_flags(ctx: LaunchContext, extra: list[str]) -> list[str]:
    """Flags that keep llama_cpp.server's RSS within the replica's memory budget."""
    flags: list[str] = []
    # The server's default (unlike the library's) keeps logits for every
    # token of the context: n_ctx x n_vocab floats, about 1 MB per token for
    # Gemma. Only logprobs need them, and the gateway sends none it cannot serve.
    if not python_sets(extra, "logits_all"):
        flags += ["--logits_all", "false"]
    cache_on = python_true(extra, "cache")
    budget = ctx.memory_budget_mib
    if cache_on and budget is not None and not python_sets(extra, "cache_size"):
        spec = ctx.assignment.model
        weights_mib = -(-(ctx.weights_bytes or 0) // memory.MIB)
        room = budget - memory.LLAMACPP_RUNTIME_MIB - memory.kv_cache_mib(spec) - weights_mib
        cache_bytes = max(0, room) * memory.MIB // PROMPT_CACHE_SHARE
        flags += ["--cache_size", str(cache_bytes)]
    logits_rows = not python_true(extra, "logits_all")  # else n_ctx rows, whatever n_batch
    if cache_on and logits_rows and not python_sets(extra, "n_batch"):
        flags += ["--n_batch", str(PROMPT_CACHE_N_BATCH)]
    return flags


# llama_cpp.server's boolean values (server/cli.py _parse_bool_arg), in any case.
_PYTHON_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})


def python_settings(extra: list[str]) -> dict[str, str]:
    """The settings a catalog arg list gives llama_cpp.server, read as its argparse reads
    them: ``--name value`` or ``--name=value``, a unique prefix of a name (``--embed``)
    for the name, the last one given winning."""
    found: dict[str, str] = {}
    for index, item in enumerate(extra):
        if not item.startswith("--"):
            continue
        flag, sep, value = item.partition("=")
        name = _python_setting(flag[2:])
        if name is None:
            continue
        if sep:
            found[name] = value
        elif index + 1 < len(extra):
            found[name] = extra[index + 1]
    return found


def _python_setting(given: str) -> str | None:
    if given in LLAMA_CPP_PYTHON_SETTINGS:
        return given
    matches = [name for name in LLAMA_CPP_PYTHON_SETTINGS if given and name.startswith(given)]
    return matches[0] if len(matches) == 1 else None


def python_true(extra: list[str], setting: str) -> bool:
    """Whether a catalog arg list turns one of llama_cpp.server's boolean settings on."""
    value = python_settings(extra).get(setting)
    return value is not None and value.strip().lower() in _PYTHON_TRUE


def python_sets(extra: list[str], setting: str) -> bool:
    return setting in python_settings(extra)


def declared_template(template: SuppliedTemplate | None, extra: list[str]) -> ChatTemplate | None:
    """What llama_cpp.server renders chats with, for the gateway to render them alike:
    the supplied template in its hf-tokenizer-config shape, unless the catalog chose a
    format. None otherwise (a model's own template may map to one of the engine's
    Python formats, which only the engine knows)."""
    if template is None or python_sets(extra, "chat_format"):
        return None
    config = json.loads(Path(template.tokenizer_config).read_text(encoding="utf-8"))
    return ChatTemplate(
        jinja=config["chat_template"], bos_token=config["bos_token"], eos_token=config["eos_token"]
    )


def python_argv(
    python: str,
    ctx: LaunchContext,
    path: str,
    template: SuppliedTemplate | None,
    gpu: bool,
    extra: list[str],
) -> tuple[list[str], str, str | None]:
    """llama_cpp.server's command line before the catalog's own flags; its health path
    and the path probed while serving."""
    spec = ctx.assignment.model
    argv = [
        python,
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
    if gpu and not python_sets(extra, "n_gpu_layers"):
        argv += ["--n_gpu_layers", "-1"]
    if template is not None and not python_sets(extra, "chat_format"):
        # A Jinja template from a tokenizer_config.json: its gemma
        # format would drop every system message.
        argv += [
            "--chat_format", "hf-tokenizer-config",
            "--hf_tokenizer_config_path", template.tokenizer_config,
        ]  # fmt: skip
    if ctx.tls is not None:
        # Paths only: the key stays in its owner-only file.
        argv += ["--ssl_keyfile", ctx.tls.key_file, "--ssl_certfile", ctx.tls.cert_file]
    argv += python_memory_flags(ctx, extra)
    health = "/v1/models"
    # Every model route of llama_cpp.server waits for the model lock,
    # so a probe of one would wait for a whole completion. While
    # serving, probe the FastAPI app's own docs page instead: it needs
    # no lock, so it proves the server answers, though not that the
    # model still computes.
    liveness = "/docs"
    return argv, health, liveness
