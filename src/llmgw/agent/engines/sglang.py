"""SGLang: ``sglang serve --model-path … --tp-size … --pp-size …``.

``sglang serve`` is SGLang's entry point (0.5.23 warns that ``python -m
sglang.launch_server`` is only "still supported"); it parses the same server
arguments with Python's argparse, so a unique prefix of a managed flag
(``--po``, ``--tp``) is that flag, and ``--config`` loads a YAML file of flags.

Multi-node: every node runs the same command with ``--nnodes``,
``--node-rank`` and ``--dist-init-addr host:port`` of the rank-0 node (the
documented way); only rank 0 serves HTTP, so the other ranks are ready once
their process runs.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from llmgw.agent.engines.base import (
    LOADS_CODE,
    REMOTE_CODE,
    EngineLaunch,
    FlagRules,
    LaunchContext,
    SecretFile,
    ServeFlags,
    check_serve,
    console_script,
    has_flag,
    serve_argv,
    serve_launch,
    uvicorn_tls_flags,
)
from llmgw.agent.progress import SGLANG_METRICS
from llmgw.wire import EngineDialect, EngineKind, ReplicaAssignment

# SGLang honours max_completion_tokens and include_usage (its OpenAI
# protocol); /v1/tokenize answers {"count", "tokens"} for {"prompt": ...}.
# It serves /v1/responses, /v1/rerank and, for speech models,
# /v1/audio/transcriptions (entrypoints/http_server.py); its /v1/score is
# another API (query, items, label token ids), not vLLM's text_1/text_2 that
# the gateway checks, so it is not declared.
DIALECT = EngineDialect(
    tokenize_path="/v1/tokenize", tokenize_field="prompt",
    extra_routes=["/v1/responses", "/v1/rerank", "/v1/audio/transcriptions"],
)

_WITH_KEY = "SGLang refuses to start with it beside the API key the agent gives it"
CODE_FLAGS = ("--custom-weight-loader", "--forward-hooks", "--enable-custom-logit-processor")

MANAGED_FLAGS = FlagRules(
    managed=frozenset(
        [
            "--model-path",
            "--model",
            "--model-type",  # sglang serve's backend (a diffusion server is another API)
            "--served-model-name",
            "--host",
            "--port",
            "--tp-size",
            "--tensor-parallel-size",
            "--pp-size",
            "--pipeline-parallel-size",
            "--api-key",
            "--admin-api-key",
            "--nnodes",
            "--node-rank",
            "--dist-init-addr",
            "--nccl-init-addr",  # an alias of --dist-init-addr
            "--config",
            # The node's certificate where the fleet issues one (uvicorn's
            # flags, arg_groups/fields/serving.py): a catalog's own would make
            # the engine https while its endpoint says http.
            "--ssl-keyfile",
            "--ssl-certfile",
            "--ssl-ca-certs",
            "--ssl-keyfile-password",
            "--enable-ssl-refresh",
            # A gRPC listener that the API key does not guard; with a key
            # SGLang refuses it, and more than one tokenizer worker
            # (arg_groups/serving_hook.py, entrypoints/http_server.py).
            "--grpc-port",
            "--tokenizer-worker-num",
            # Each imports code named by the catalog (a module path, a file) or,
            # for the logit processor, lets every request send code to run: the
            # catalog cannot run code on a node (llmgw.engine_env).
            *CODE_FLAGS,
            # Imports the model repository's own code; only a node's admin
            # may allow it there (agent.engines.nodeargs).
            "--trust-remote-code",
        ]
    ),
    abbreviations=True,
    hints={
        **dict.fromkeys(CODE_FLAGS, LOADS_CODE),
        "--trust-remote-code": REMOTE_CODE,
        "--grpc-port": _WITH_KEY + " (its gRPC listener bypasses the key)",
        "--tokenizer-worker-num": _WITH_KEY,
        "--admin-api-key": "a key in argv is world-readable; the admin routes stay closed",
    },
)
SERVE_FLAGS = ServeFlags(
    weights="--model-path", tp="--tp-size", pp="--pp-size", leader="--dist-init-addr"
)


def template_knows_developer(weights_path: str | None) -> bool:
    """Whether the model's chat template handles a "developer" message itself.

    SGLang hands a "developer" message to the model's template as it is
    (only its Kimi K3 path renames it), and most templates know no such role:
    Gemma 3's raises "Conversation roles must alternate". vLLM converts it to
    "system" when the template never names it (renderers/hf.py); for SGLang
    the gateway does the same (EngineDialect.developer_role), from the same
    test on the template the weights carry. Unreadable: not known.
    """
    if not weights_path:
        return False
    folder = Path(weights_path)
    texts: list[str] = []
    with contextlib.suppress(OSError, ValueError):
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        template = config.get("chat_template") if isinstance(config, dict) else None
        if isinstance(template, str):
            texts.append(template)
        elif isinstance(template, list):  # named templates: [{"name", "template"}]
            texts.extend(str(item.get("template", "")) for item in template
                         if isinstance(item, dict))  # fmt: skip
    with contextlib.suppress(OSError):
        texts.append((folder / "chat_template.jinja").read_text(encoding="utf-8"))
    return any('"developer"' in text or "'developer'" in text for text in texts)


class SglangAdapter:
    kind = EngineKind.SGLANG
    guards_every_route = False
    adapters_at_start = False

    def __init__(self, executable: str | None = None) -> None:
        self.executable = executable or console_script("sglang")

    def validate(self, assignment: ReplicaAssignment) -> None:
        check_serve(assignment, MANAGED_FLAGS, engine=self.kind, leader_port=True)

    def build(self, ctx: LaunchContext) -> EngineLaunch:
        assignment = ctx.assignment
        self.validate(assignment)
        spec = assignment.model
        argv = serve_argv(self.executable, ctx, SERVE_FLAGS, assignment.leader_address or "")
        # Only rank 0 serves HTTP (check_common: a single-node replica's rank is 0).
        health = "/health" if assignment.shard.rank == 0 else None
        # SGLang serves /metrics only when asked; without it the agent could
        # not tell a stuck engine from an idle one.
        if health is not None and not has_flag(spec.engine_args, "--enable-metrics"):
            argv.append("--enable-metrics")
        secret = None
        if assignment.engine_key is not None and health is not None:
            # SGLang reads its key from argv or a --config YAML file only
            # (a .yaml/.yml name: utils/server_args_config_parser.py), and
            # argv is world-readable in /proc: a file it is (--config is
            # managed, so the catalog cannot pass one of its own). SGLang
            # logs the key in its start line: the agent blanks it in every
            # log tail it reports (agent.replicas).
            secret = SecretFile(
                "--config", f'api-key: "{assignment.engine_key}"\n', suffix=".yaml"
            )
        # Only the rank that serves HTTP listens with TLS, and reloads the
        # node's certificate when it is renewed on disk.
        tls = ctx.tls is not None and health is not None
        if tls and ctx.tls is not None:
            argv += uvicorn_tls_flags(ctx.tls)
        dialect = DIALECT.model_copy(
            update={"developer_role": template_knows_developer(ctx.weights_path)}
        )
        return serve_launch(
            ctx, argv, health=health, metrics=SGLANG_METRICS, dialect=dialect,
            secret_file=secret, tls=tls,
        )
