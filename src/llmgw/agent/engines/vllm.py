"""vLLM: ``vllm serve <weights> --tensor-parallel-size … --pipeline-parallel-size …``.

Multi-node replicas use vLLM's multiprocessing backend (documented since
v0.12): every node runs ``vllm serve`` with ``--nnodes``, ``--node-rank`` and
``--master-addr``/``--master-port`` of the rank-0 node, and the other ranks add
``--headless`` (no API server). The Ray backend would need a Ray cluster the
agent does not manage; the multiprocessing one needs nothing but the leader's
address, which the control plane already sends.
"""

from __future__ import annotations

from llmgw.agent.engines.base import (
    EngineLaunch,
    LaunchContext,
    check_common,
    require_leader,
    require_weights,
)
from llmgw.agent.pinning import engine_env
from llmgw.agent.progress import VLLM_METRICS
from llmgw.errors import EngineError
from llmgw.wire import EngineDialect, EngineKind, ReplicaAssignment

# vLLM honours max_completion_tokens and include_usage (its chat protocol);
# its tokenizer route answers {"count", "tokens"} for {"prompt": ...}.
DIALECT = EngineDialect(tokenize_path="/tokenize", tokenize_field="prompt")

MANAGED_FLAGS = (
    "--model",
    "--served-model-name",
    "--host",
    "--port",
    "--tensor-parallel-size",
    "-tp",
    "--pipeline-parallel-size",
    "-pp",
    "--api-key",
    "--nnodes",
    "--node-rank",
    "--master-addr",
    "--master-port",
    "--headless",
)


class VllmAdapter:
    kind = EngineKind.VLLM

    def __init__(self, executable: str = "vllm") -> None:
        self.executable = executable

    def validate(self, assignment: ReplicaAssignment) -> None:
        check_common(assignment, MANAGED_FLAGS)
        if assignment.model.weights.kind == "none":
            raise EngineError(f"model {assignment.model.name!r}: vllm needs weights")
        if assignment.nodes > 1:
            require_leader(assignment, needs_port=False)

    def build(self, ctx: LaunchContext) -> EngineLaunch:
        assignment = ctx.assignment
        self.validate(assignment)
        spec = assignment.model
        argv = [
            self.executable,
            "serve",
            require_weights(ctx),
            "--served-model-name",
            spec.name,
            "--host",
            ctx.host,
            "--port",
            str(ctx.port),
            "--tensor-parallel-size",
            str(spec.tp),
            "--pipeline-parallel-size",
            str(spec.pp),
        ]
        health: str | None = "/health"
        if assignment.nodes > 1:
            host, port = require_leader(assignment, needs_port=False)
            argv += [
                "--nnodes",
                str(assignment.nodes),
                "--node-rank",
                str(assignment.shard.rank),
                "--master-addr",
                host,
            ]
            if port is not None:
                argv += ["--master-port", str(port)]
            if assignment.shard.rank > 0:
                argv.append("--headless")
                health = None
        argv += spec.engine_args
        env = dict(spec.env)
        env.update(engine_env(ctx.devices, vulkan=False))
        # Metrics, like HTTP, come from the rank that serves the API only.
        progress = VLLM_METRICS if health is not None else None
        return EngineLaunch(
            argv=argv, env=env, health_path=health, progress=progress, dialect=DIALECT
        )
