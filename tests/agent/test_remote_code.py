"""A catalog entry cannot turn on --trust-remote-code; only a node's admin may, on that node."""

from __future__ import annotations

import pytest
from tests.agent.helpers import assign, gpu, model

from llmgw.agent.engines import SglangAdapter, VllmAdapter
from llmgw.agent.engines.base import EngineAdapter, LaunchContext
from llmgw.agent.engines.nodeargs import NodeFlagsAllowed, parse_allowed
from llmgw.agent.engines.nodeenv import NodeEnvAllowed
from llmgw.errors import ConfigError, EngineError

WEIGHTS = "/data/weights/m"
SPELLINGS = {
    "vllm": ["--trust-remote-code", "--trust_remote_code", "--trust-remote", "--trust"],
    "sglang": ["--trust-remote-code", "--trust-remote"],
}
ADAPTERS = {"vllm": VllmAdapter, "sglang": SglangAdapter}


def _launch(adapter: EngineAdapter, engine: str, args: list[str]) -> list[str]:
    devices = [gpu(0)]
    spec = model(engine, engine_args=args)
    ctx = LaunchContext(assignment=assign(spec, devices), weights_path=WEIGHTS,
                        host="127.0.0.1", port=21000, devices=devices)
    adapter.validate(ctx.assignment)
    return adapter.build(ctx).argv


@pytest.mark.parametrize(("engine", "spelled"),
                         [(e, s) for e, spellings in SPELLINGS.items() for s in spellings])
def test_the_catalog_cannot_turn_on_remote_code(engine: str, spelled: str) -> None:
    with pytest.raises(EngineError) as refused:
        _launch(ADAPTERS[engine](), engine, ["--max-model-len", "4096", spelled])
    message = str(refused.value)
    # The rule, and the way out for the node's admin.
    assert "--trust-remote-code" in message and "cannot run code on a node" in message
    assert "llmgw agent --engine-flag-allow trust-remote-code" in message


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_only_a_nodes_admin_lets_remote_code_reach_an_engine(engine: str) -> None:
    allowed = parse_allowed(["trust-remote-code"])
    # Wrapped as the agent wraps its adapters, over the env escape hatch.
    adapter = NodeFlagsAllowed(NodeEnvAllowed(ADAPTERS[engine](), ()), allowed)
    argv = _launch(adapter, engine, ["--trust-remote-code", "--max-model-len", "4096"])
    assert argv.count("--trust-remote-code") == 1 and "--max-model-len" in argv
    # Nothing else gets through with it: managed flags, flags that import code.
    for other in (["--port", "9"], ["--trust-remote-code", "--api-key", "mine"]):
        with pytest.raises(EngineError, match="manages"):
            _launch(adapter, engine, other)
    code_flag = "--worker-cls" if engine == "vllm" else "--forward-hooks"
    with pytest.raises(EngineError, match="loads Python code"):
        _launch(adapter, engine, ["--trust-remote-code", code_flag, "x.Y"])


def test_a_node_may_allow_only_remote_code() -> None:
    assert parse_allowed(["--trust_remote_code", "trust-remote-code,"]) == {"--trust-remote-code"}
    assert parse_allowed([]) == frozenset()
    for other in ("worker-cls", "port", "middleware"):
        with pytest.raises(ConfigError, match="may allow only trust-remote-code"):
            parse_allowed([other])


def test_what_a_node_allows_hides_nothing_the_agent_asks_of_the_engine() -> None:
    # Wrapped for a node's allowed flags and environment, llama-server still
    # takes its adapters at its start, and the simulated engine still guards
    # its own routes: read as False, the one started without its adapters
    # and the other behind a guard it does not need.
    from llmgw.agent.engines.llamacpp import LlamaCppAdapter
    from llmgw.agent.engines.sim import SimAdapter

    for inner in (LlamaCppAdapter(server_binary="/usr/bin/llama-server"), SimAdapter()):
        wrapped = NodeFlagsAllowed(NodeEnvAllowed(inner, {"HF_HOME"}), {"--trust-remote-code"})
        assert wrapped.adapters_at_start == inner.adapters_at_start
        assert wrapped.guards_every_route == inner.guards_every_route
    assert LlamaCppAdapter(server_binary="/usr/bin/llama-server").adapters_at_start
    assert SimAdapter().guards_every_route
