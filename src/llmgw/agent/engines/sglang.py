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

from llmgw.agent.engines.base import (
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
)
from llmgw.agent.progress import SGLANG_METRICS
from llmgw.wire import EngineDialect, EngineKind, ReplicaAssignment

# SGLang honours max_completion_tokens and include_usage (its OpenAI
# protocol); /v1/tokenize answers {"count", "tokens"} for {"prompt": ...}.
# It serves /v1/responses and /v1/rerank; its /v1/score is another API
# (query, items, label token ids), not vLLM's text_1/text_2 that the gateway
# checks, so it is not declared.
DIALECT = EngineDialect(
    tokenize_path="/v1/tokenize", tokenize_field="prompt",
    extra_routes=["/v1/responses", "/v1/rerank"],
)

MANAGED_FLAGS = FlagRules(
    managed=frozenset(
        [
            "--model-path",
            "--model",
            "--served-model-name",
            "--host",
            "--port",
            "--tp-size",
            "--tensor-parallel-size",
            "--pp-size",
            "--pipeline-parallel-size",
            "--api-key",
            "--nnodes",
            "--node-rank",
            "--dist-init-addr",
            "--nccl-init-addr",  # an alias of --dist-init-addr
            "--config",
        ]
    ),
    abbreviations=True,
)
SERVE_FLAGS = ServeFlags(
    weights="--model-path", tp="--tp-size", pp="--pp-size", leader="--dist-init-addr"
)


class SglangAdapter:
    kind = EngineKind.SGLANG

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
            # SGLang reads its key from argv or a --config YAML file only, and
            # argv is world-readable in /proc: a file it is (--config is managed,
            # so the catalog cannot pass one of its own).
            secret = SecretFile("--config", f'api-key: "{assignment.engine_key}"\n')
        return serve_launch(
            ctx, argv, health=health, metrics=SGLANG_METRICS, dialect=DIALECT, secret_file=secret
        )
