"""Engine adapters: one per engine kind, each a pure argv/env builder."""

from __future__ import annotations

from collections.abc import Mapping

from llmgw.agent.engines.base import EngineAdapter, EngineLaunch, LaunchContext
from llmgw.agent.engines.commands import EngineCommands
from llmgw.agent.engines.llamacpp import LlamaCppAdapter
from llmgw.agent.engines.sglang import SglangAdapter
from llmgw.agent.engines.sim import SimAdapter
from llmgw.agent.engines.vllm import VllmAdapter
from llmgw.wire import EngineKind

__all__ = [
    "EngineAdapter",
    "EngineCommands",
    "EngineLaunch",
    "LaunchContext",
    "LlamaCppAdapter",
    "SglangAdapter",
    "SimAdapter",
    "VllmAdapter",
    "default_adapters",
]


def default_adapters(commands: EngineCommands | None = None) -> Mapping[EngineKind, EngineAdapter]:
    """An adapter per engine kind, running the engines ``commands`` names (default: found)."""
    return (commands or EngineCommands()).adapters()
