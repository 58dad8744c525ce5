"""Engine adapters: one per engine kind, each a pure argv/env builder."""

from __future__ import annotations

from collections.abc import Mapping

from llmgw.agent.engines.base import EngineAdapter, EngineLaunch, LaunchContext
from llmgw.agent.engines.llamacpp import LlamaCppAdapter
from llmgw.agent.engines.sglang import SglangAdapter
from llmgw.agent.engines.sim import SimAdapter
from llmgw.agent.engines.vllm import VllmAdapter
from llmgw.wire import EngineKind

__all__ = [
    "EngineAdapter",
    "EngineLaunch",
    "LaunchContext",
    "LlamaCppAdapter",
    "SglangAdapter",
    "SimAdapter",
    "VllmAdapter",
    "default_adapters",
]


def default_adapters() -> Mapping[EngineKind, EngineAdapter]:
    return {
        EngineKind.VLLM: VllmAdapter(),
        EngineKind.SGLANG: SglangAdapter(),
        EngineKind.LLAMACPP: LlamaCppAdapter(),
        EngineKind.SIM: SimAdapter(),
    }
