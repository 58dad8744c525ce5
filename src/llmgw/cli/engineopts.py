"""``--engine NAME=PATH``, shared by ``llmgw agent`` and ``llmgw up`` (agent.engines.commands)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from llmgw.agent.engines.commands import EngineCommands

ENGINE_OPTION = typer.Option(
    "--engine",
    help="Where an engine is, NAME=PATH (repeatable): vllm (a vllm command or a Python with"
    " vLLM), sglang, llama-server, llama-cpp-python (a Python with llama-cpp-python);"
    " llamacpp=llama-server|llama-cpp-python picks the server of kind llamacpp. Also"
    " LLMGW_ENGINE_<NAME> (LLMGW_ENGINE_LLAMA_SERVER=...). Default: found on PATH.",
)


def engine_commands(items: Sequence[str]) -> EngineCommands:
    """The engines the options and the ``LLMGW_ENGINE_*`` variables name (ConfigError if bad)."""
    # Imported here: the engine adapters are not needed by every command.
    from llmgw.agent.engines.commands import EngineCommands

    return EngineCommands.parse(items, os.environ)
