"""The simulated engine (``llmgw.sim.engine``): an OpenAI server that behaves like one.

It takes no weights and no devices; its behaviour comes from the catalog's
``sim`` parameters, passed as one JSON argument so that a new parameter never
needs a new flag here.
"""

from __future__ import annotations

import sys

from llmgw.agent.engines.base import EngineLaunch, LaunchContext, check_common
from llmgw.agent.progress import VLLM_METRICS
from llmgw.engine_env import ENGINE_KEY_ENV
from llmgw.errors import EngineError
from llmgw.wire import EXTRA_ROUTES, EngineDialect, EngineKind, ReplicaAssignment, SimParams

MANAGED_FLAGS = ("--host", "--port", "--model", "--params-json", "--ssl-certfile", "--ssl-keyfile")


class SimAdapter:
    kind = EngineKind.SIM
    # It refuses every route but a bare /health without its key
    # (llmgw.sim.engine), so the agent puts no guard in front of it
    # (agent.engineguard): a simulated fleet runs hundreds in one process.
    guards_every_route = True
    adapters_at_start = False  # it loads them at any time, as vLLM does

    def __init__(self, python: str | None = None) -> None:
        self.python = python or sys.executable

    def validate(self, assignment: ReplicaAssignment) -> None:
        check_common(assignment, MANAGED_FLAGS)
        if assignment.nodes > 1:
            raise EngineError("the simulated engine runs on one node only")

    def build(self, ctx: LaunchContext) -> EngineLaunch:
        assignment = ctx.assignment
        self.validate(assignment)
        spec = assignment.model
        params = spec.sim or SimParams()
        argv = [
            self.python,
            "-m",
            "llmgw.sim.engine",
            "--host",
            ctx.host,
            "--port",
            str(ctx.port),
            "--model",
            spec.name,
            "--params-json",
            params.model_dump_json(),
        ]
        if ctx.tls is not None:
            argv += ["--ssl-certfile", ctx.tls.cert_file, "--ssl-keyfile", ctx.tls.key_file]
        argv += spec.engine_args
        # It exports vLLM's metric names (llmgw.sim.metrics) and tokenizes as
        # vLLM's /tokenize does; its dialect switches and the extra routes it
        # serves come from its params.
        dialect = EngineDialect(
            max_completion_tokens=params.max_completion_tokens,
            stream_usage=params.stream_usage,
            tokenize_path="/tokenize",
            tokenize_field="prompt",
            extra_routes=list(EXTRA_ROUTES if params.routes is None else params.routes),
        )
        env = dict(spec.env)
        if assignment.engine_key is not None:
            env[ENGINE_KEY_ENV[EngineKind.SIM]] = assignment.engine_key
        return EngineLaunch(
            argv=argv,
            env=env,
            health_path="/health",
            progress=VLLM_METRICS,
            dialect=dialect,
            tls=ctx.tls is not None,
        )
