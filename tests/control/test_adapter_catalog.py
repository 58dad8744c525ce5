"""Adapters in the catalog: a base that can load them, a rank its engine takes."""

from __future__ import annotations

import pytest
from tests.control.test_catalog import problems

from llmgw.control.adaptercheck import LLAMA_SERVER_MAX_ADAPTERS, LLAMA_SERVER_MAX_RANK, lora_slots
from llmgw.control.catalog import parse_models, validate_catalog
from llmgw.wire import ModelSpec

VLLM_BASE = {"name": "llama", "engine": "vllm", "gpu_classes": ["h100-80g"],
             "engine_args": ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"]}


LORA_DIR = {"kind": "local", "path": "/srv/adapters/sql"}


def spec(**fields: object) -> ModelSpec:
    if fields.get("engine") == "vllm" and "base" in fields:
        fields.setdefault("weights", LORA_DIR)
    return ModelSpec.model_validate(fields)


def test_an_adapter_of_a_lora_base_is_accepted_with_its_weights() -> None:
    specs = parse_models(
        "- {name: llama, engine: vllm, gpu_classes: [h100-80g],"
        "   engine_args: [--enable-lora, --max-lora-rank, '16']}\n"
        "- {name: llama-sql, engine: vllm, base: llama, min_replicas: 0,"
        "   adapter: {rank: 16, size_mib: 40},"
        "   weights: {kind: hf, repo: acme/sql-lora, revision: abc}}\n"
    )
    validate_catalog(specs)
    adapter = specs[1]
    assert adapter.is_adapter and adapter.weights.kind == "hf"
    assert lora_slots(specs[0]) == (1, 16)  # vLLM's default --max-loras


def test_base_alone_makes_an_adapter_and_an_adapter_block_needs_a_base() -> None:
    assert spec(name="a", engine="vllm", base="llama").adapter is not None
    with pytest.raises(ValueError, match="name its 'base'"):
        spec(name="a", engine="vllm", adapter={"rank": 8})


def test_rank_above_the_bases_max_lora_rank_is_refused_naming_the_flag() -> None:
    base = spec(**VLLM_BASE)
    adapter = spec(name="sql", engine="vllm", base="llama", adapter={"rank": 16})
    assert problems([base, adapter]) == [
        "model 'sql': field 'adapter.rank': 16 is above what 'llama' takes (--max-lora-rank 8):"
        " raise it there or use an adapter of a lower rank"
    ]


def test_a_base_without_enable_lora_or_missing_or_another_engine_is_refused() -> None:
    plain = spec(name="llama", engine="vllm", gpu_classes=["h100-80g"])
    adapter = spec(name="sql", engine="vllm", base="llama")
    assert "add --enable-lora" in problems([plain, adapter])[0]
    assert "no model 'nobody'" in problems([spec(name="x", engine="vllm", base="nobody")])[0]
    llama_cpp = spec(name="g", engine="llamacpp")
    found = problems([llama_cpp, spec(name="x", engine="llamacpp", base="g")])
    assert "cannot load adapters into" in found[0]
    assert "llama_cpp.server, which applies one adapter to every request" in found[0]
    wrong = problems([spec(**VLLM_BASE), spec(name="x", engine="sim", base="llama")])
    assert "must be its base's engine, vllm" in wrong[0]


def test_an_adapter_of_an_adapter_and_engine_settings_on_an_adapter_are_refused() -> None:
    base = spec(**VLLM_BASE)
    first = spec(name="a1", engine="vllm", base="llama")
    second = spec(name="a2", engine="vllm", base="a1")
    assert "is itself an adapter" in problems([base, first, second])[0]
    gpus = spec(name="a3", engine="vllm", base="llama", gpus=2, tp=2)
    found = problems([base, gpus])
    assert any("field 'gpus': an adapter runs on its base's engine" in p for p in found)


def test_changing_a_base_revalidates_the_adapters_already_on_it() -> None:
    base = spec(**VLLM_BASE)
    adapter = spec(name="sql", engine="vllm", base="llama", adapter={"rank": 8})
    validate_catalog([base, adapter])
    lower = spec(**{**VLLM_BASE, "engine_args": ["--enable-lora", "--max-lora-rank", "4"]})
    found = problems([lower], {"llama": base, "sql": adapter})
    assert found == [
        "model 'sql': field 'adapter.rank': 8 is above what 'llama' takes (--max-lora-rank 4):"
        " raise it there or use an adapter of a lower rank (after the change to 'llama')"
    ]


def test_a_vllm_adapter_without_weights_is_refused() -> None:
    bare = ModelSpec(name="sql", engine="vllm", base="llama")
    assert problems([spec(**VLLM_BASE), bare]) == [
        "model 'sql': field 'weights': vLLM loads an adapter from a directory: give its"
        " weights (hf, local)"
    ]


def test_sim_bases_take_adapters_by_their_params() -> None:
    base = spec(name="s", engine="sim", sim={"max_loras": 4, "max_lora_rank": 8})
    validate_catalog([base, spec(name="s-a", engine="sim", base="s", adapter={"rank": 8})])
    assert "sim.max_lora_rank 8" in problems(
        [base, spec(name="s-b", engine="sim", base="s", adapter={"rank": 9})]
    )[0]
    assert "sim.max_loras above 0" in problems(
        [spec(name="t", engine="sim"), spec(name="t-a", engine="sim", base="t")]
    )[0]


def test_llama_server_takes_gguf_adapters_of_any_rank_and_at_most_its_cap() -> None:
    base = spec(name="g", engine="llama-server", weights={"kind": "local", "path": "/m/g.gguf"})
    adapter = spec(name="g-sql", engine="llama-server", base="g", adapter={"rank": 64},
                   weights={"kind": "local", "path": "/m/sql.gguf"})  # fmt: skip
    validate_catalog([base, adapter], None)
    assert lora_slots(base) == (LLAMA_SERVER_MAX_ADAPTERS, LLAMA_SERVER_MAX_RANK)
    bare = spec(name="g-none", engine="llama-server", base="g")
    assert "llama-server loads an adapter from a GGUF file" in problems([base, bare])[0]
    many = [spec(name=f"g-{i}", engine="llama-server", base="g",
                 weights={"kind": "local", "path": f"/m/{i}.gguf"})
            for i in range(LLAMA_SERVER_MAX_ADAPTERS + 1)]  # fmt: skip
    found = problems([base, *many])
    assert found and "starts with every adapter of its base: 65 is above 64" in found[0]
