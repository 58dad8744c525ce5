"""Where the agent finds each engine: ``--engine NAME=VALUE`` or ``LLMGW_ENGINE_NAME``.

Engines live in environments of their own (vLLM pins torch and transformers
versions llmgw's environment should not take), so the agent must be told
where each one is, per engine:

* ``vllm=PATH``: a ``vllm`` command, or the Python of an environment with
  vLLM installed (the agent then runs its API server module; agent.engines.vllm);
* ``sglang=PATH``: an ``sglang`` command;
* ``llama-server=PATH``: llama.cpp's ``llama-server`` binary;
* ``llama-cpp-python=PATH``: the Python of an environment with
  ``llama-cpp-python[server]``;
* ``llamacpp=llama-server`` or ``llamacpp=llama-cpp-python``: which of the two
  servers the engine kind ``llamacpp`` means on this node.

Without one, an engine is found as before: its command beside the agent's
Python, else on PATH; ``llama-cpp-python`` is the agent's own Python; and
``llamacpp`` is llama-server when one is on PATH, else llama-cpp-python. A
``llama-server=PATH`` alone does not change what ``llamacpp`` means, so telling
the agent where llama-server is cannot switch the models that name
``llamacpp`` (and pass llama_cpp.server's flags) to the other server.

A value is a path, never a shell line: it is the first item of an argv.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from llmgw.agent.engines.base import EngineAdapter
from llmgw.agent.engines.llamacpp import SERVER_BINARY, LlamaCppAdapter
from llmgw.agent.engines.sglang import SglangAdapter
from llmgw.agent.engines.sim import SimAdapter
from llmgw.agent.engines.vllm import VllmAdapter
from llmgw.errors import ConfigError
from llmgw.wire import EngineKind

ENV_PREFIX = "LLMGW_ENGINE_"
# The names ``--engine`` takes, and the ``llamacpp`` choices.
PATH_NAMES = ("vllm", "sglang", "llama-server", "llama-cpp-python")
LLAMACPP_CHOICES = ("llama-server", "llama-cpp-python")
NAMES = (*PATH_NAMES, "llamacpp")


def env_name(name: str) -> str:
    """``llama-server`` -> ``LLMGW_ENGINE_LLAMA_SERVER``."""
    return ENV_PREFIX + name.upper().replace("-", "_")


@dataclass(frozen=True)
class EngineCommands:
    """Per engine, what the agent was told (None: find it as by default)."""

    vllm: str | None = None
    sglang: str | None = None
    llama_server: str | None = None
    llama_cpp_python: str | None = None
    # Which server the kind ``llamacpp`` runs: one of LLAMACPP_CHOICES.
    llamacpp: str | None = None

    @classmethod
    def parse(
        cls, items: Sequence[str] = (), environ: Mapping[str, str] | None = None
    ) -> EngineCommands:
        """From ``--engine NAME=VALUE`` items over ``LLMGW_ENGINE_*`` variables in ``environ``."""
        given: dict[str, str] = {}
        for name in NAMES:
            value = (environ or {}).get(env_name(name), "").strip()
            if value:
                given[name] = value
        for item in items:
            name, sep, value = item.partition("=")
            name, value = name.strip(), value.strip()
            if not sep or not value:
                raise ConfigError(
                    f"--engine {item!r}: expected NAME=PATH, e.g. vllm=/opt/vllm/bin/vllm"
                )
            if name not in NAMES:
                raise ConfigError(f"--engine {item!r}: {name!r} is not one of {', '.join(NAMES)}")
            given[name] = value
        for name, value in given.items():
            if "\x00" in value or "\n" in value:
                raise ConfigError(f"engine {name}: {value!r} is not a path")
        choice = given.get("llamacpp")
        if choice is not None and choice not in LLAMACPP_CHOICES:
            raise ConfigError(
                f"engine llamacpp={choice!r}: expected one of {', '.join(LLAMACPP_CHOICES)}"
            )
        return cls(
            vllm=given.get("vllm"),
            sglang=given.get("sglang"),
            llama_server=given.get("llama-server"),
            llama_cpp_python=given.get("llama-cpp-python"),
            llamacpp=choice,
        )

    def adapters(self) -> dict[EngineKind, EngineAdapter]:
        """One adapter per engine kind, each running what it was told."""
        # Not told: llama-server on PATH, else the bare name (its start then
        # fails saying it is not found, as any missing engine's does).
        binary = self.llama_server or shutil.which(SERVER_BINARY) or SERVER_BINARY
        server = LlamaCppAdapter(server_binary=binary, kind=EngineKind.LLAMA_SERVER)
        python = LlamaCppAdapter(
            server_binary="", python=self.llama_cpp_python, kind=EngineKind.LLAMA_CPP_PYTHON
        )
        if self.llamacpp == "llama-server":
            node_default = LlamaCppAdapter(server_binary=binary)
        elif self.llamacpp == "llama-cpp-python":
            node_default = LlamaCppAdapter(server_binary="", python=self.llama_cpp_python)
        else:  # as before: llama-server on PATH, else the Python server
            node_default = LlamaCppAdapter(python=self.llama_cpp_python)
        return {
            EngineKind.VLLM: VllmAdapter(self.vllm),
            EngineKind.SGLANG: SglangAdapter(self.sglang),
            EngineKind.LLAMACPP: node_default,
            EngineKind.LLAMA_SERVER: server,
            EngineKind.LLAMA_CPP_PYTHON: python,
            EngineKind.SIM: SimAdapter(),
        }
