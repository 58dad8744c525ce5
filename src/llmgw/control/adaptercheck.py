"""Catalog rules for LoRA adapters (``base:``): what their base's engine can load.

An adapter's mistakes only show when an engine is asked to load it: a rank
above the base engine's ``--max-lora-rank`` fails every load, on every
replica, for every request that names it; a base started without
``--enable-lora`` refuses the load route altogether. Each is refused when
the entry is applied, naming the base's setting to change.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from llmgw import memory
from llmgw.wire import EngineKind, ModelSpec

# vLLM's defaults (vllm/config/lora.py): a base started with --enable-lora
# and no --max-lora-rank takes adapters up to rank 16, two at a time.
VLLM_DEFAULT_MAX_LORA_RANK = 16
VLLM_DEFAULT_MAX_LORAS = 1
# Engines whose replicas serve adapters (llmgw.agent.loras): vLLM and the
# simulator load them at runtime; llama-server takes them at its start, all
# of its base's at once, and applies one per request. llama_cpp.server (and
# so "llamacpp", which may run it) applies one adapter to every request.
ADAPTER_ENGINES = frozenset({EngineKind.VLLM, EngineKind.SIM, EngineKind.LLAMA_SERVER})
# llama-server starts with every adapter of its base (control.reports):
# each costs its size in memory on every replica, whether asked for or not.
LLAMA_SERVER_MAX_ADAPTERS = 64
# llama-server takes any rank its GGUF adapter file says.
LLAMA_SERVER_MAX_RANK = 1024
# What an adapter entry must leave alone: it runs no engine of its own, so
# each of these would read as a setting that is not one.
_ENGINE_ONLY = ("gpu_classes", "gpus", "tp", "pp", "nodes", "engine_args", "env",
                "secret_env", "memory_mib", "sim", "external", "kv_capacity_tokens")


class AdapterProblem(NamedTuple):
    field: str
    rule: str


class LoraSlots(NamedTuple):
    """What a base model's engine takes: adapters at once, and their largest rank."""

    max_loras: int
    max_rank: int


def lora_slots(base: ModelSpec) -> LoraSlots | None:
    """The base's adapter settings as its engine reads them; None: it serves no adapters."""
    if base.engine is EngineKind.SIM:
        sim = base.sim
        if sim is None or sim.max_loras < 1:
            return None
        return LoraSlots(sim.max_loras, sim.max_lora_rank)
    if base.engine is EngineKind.LLAMA_SERVER:
        return LoraSlots(LLAMA_SERVER_MAX_ADAPTERS, LLAMA_SERVER_MAX_RANK)
    if base.engine is EngineKind.VLLM:
        args = [a.replace("_", "-") if a.startswith("--") else a for a in base.engine_args]
        if not any(a == "--enable-lora" or a.startswith("--enable-lora=") for a in args):
            return None
        rank = memory.flag_value(args, ("--max-lora-rank",))
        loras = memory.flag_value(args, ("--max-loras",))
        try:
            return LoraSlots(
                int(loras) if loras is not None else VLLM_DEFAULT_MAX_LORAS,
                int(rank) if rank is not None else VLLM_DEFAULT_MAX_LORA_RANK,
            )
        except ValueError:
            return None
    return None


def adapter_problems(spec: ModelSpec, catalog: Mapping[str, ModelSpec]) -> list[AdapterProblem]:
    """Every rule the adapter ``spec`` breaks against ``catalog`` (after the apply)."""
    problems: list[AdapterProblem] = []
    base_name, adapter = spec.base, spec.adapter
    if base_name is None or adapter is None:
        return problems
    defaults = ModelSpec(name=spec.name, engine=spec.engine)
    for name in _ENGINE_ONLY:
        if getattr(spec, name) != getattr(defaults, name):
            problems.append(AdapterProblem(
                name, f"an adapter runs on its base's engine ({base_name!r}): set it there"))
    base = catalog.get(base_name)
    if base is None:
        problems.append(AdapterProblem("base", f"no model {base_name!r} in the catalog"))
        return problems
    if base.is_adapter:
        problems.append(AdapterProblem(
            "base", f"{base_name!r} is itself an adapter (of {base.base!r}): name a whole model"))
        return problems
    if spec.engine is not base.engine:
        problems.append(AdapterProblem(
            "engine", f"must be its base's engine, {base.engine.value} (got {spec.engine.value})"))
    if base.engine not in ADAPTER_ENGINES:
        problems.append(AdapterProblem(
            "base", f"{base_name!r} runs on {base.engine.value}, which llmgw cannot load"
            " adapters into (vllm, llama-server and sim can; llamacpp may run"
            " llama_cpp.server, which applies one adapter to every request)"))
        return problems
    if base.engine is EngineKind.VLLM and spec.weights.kind == "none":
        problems.append(AdapterProblem(
            "weights", "vLLM loads an adapter from a directory: give its weights (hf, local)"))
    if base.engine is EngineKind.LLAMA_SERVER:
        problems.extend(_llama_server_problems(spec, base_name, catalog))
    slots = lora_slots(base)
    if slots is None:
        hint = ("add --enable-lora (and --max-lora-rank, --max-loras) to its engine_args"
                if base.engine is EngineKind.VLLM else "set its sim.max_loras above 0")
        problems.append(AdapterProblem("base", f"{base_name!r} is not started to serve"
                                       f" adapters: {hint}"))
        return problems
    if adapter.rank > slots.max_rank:
        flag = "--max-lora-rank" if base.engine is EngineKind.VLLM else "sim.max_lora_rank"
        problems.append(AdapterProblem(
            "adapter.rank", f"{adapter.rank} is above what {base_name!r} takes ({flag}"
            f" {slots.max_rank}): raise it there or use an adapter of a lower rank"))
    if adapter.size_mib is not None and base.memory_mib is not None \
            and adapter.size_mib >= base.memory_mib:
        problems.append(AdapterProblem(
            "adapter.size_mib", f"{adapter.size_mib} MiB is not below its base's whole"
            f" memory_mib ({base.memory_mib}): that is no adapter of it"))
    if spec.on_demand is False and spec.min_replicas > base.max_replicas:
        problems.append(AdapterProblem(
            "min_replicas", f"asks to be loaded on {spec.min_replicas} replicas; its base"
            f" runs at most {base.max_replicas}"))
    return problems


def _llama_server_problems(
    spec: ModelSpec, base_name: str, catalog: Mapping[str, ModelSpec]
) -> list[AdapterProblem]:
    problems: list[AdapterProblem] = []
    if spec.weights.kind == "none":
        problems.append(AdapterProblem(
            "weights", "llama-server loads an adapter from a GGUF file (llama.cpp's"
            " convert_lora_to_gguf.py makes one from a PEFT adapter): give its weights"))
    siblings = [n for n, s in catalog.items() if s.base == base_name]
    if len(siblings) > LLAMA_SERVER_MAX_ADAPTERS:
        problems.append(AdapterProblem(
            "base", f"{base_name!r} runs on llama-server, which starts with every adapter of"
            f" its base: {len(siblings)} is above {LLAMA_SERVER_MAX_ADAPTERS}"))
    return problems


def dependents(name: str, catalog: Mapping[str, ModelSpec]) -> list[str]:
    """The adapters whose base is ``name``, by name."""
    return sorted(n for n, s in catalog.items() if s.base == name)
