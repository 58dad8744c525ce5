"""Chat templates the agent supplies for a model that carries none of its own.

A model's template says where its system text goes; without one, llama.cpp
servers fall back to formats that garble the turns or drop system messages.
The starter model (a Gemma 3 270M GGUF) carries none, so for the families
here the agent gives the family's official template: ``<family>.jinja`` as
published with the model (for llama-server's ``--chat-template-file``), and
the same template in a ``tokenizer_config.json`` shape for llama_cpp.server's
``hf-tokenizer-config`` chat format (which renders the conversation with an
empty assistant turn appended, where the template's generation prompt goes).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.resources import files

from llmgw.agent.engines.gguf import GgufError, read_info

# GGUF ``general.architecture`` -> the template its family uses. Gemma 3's
# puts the system text at the start of the first user turn; Gemma and
# Gemma 2 speak the same turns (their own templates refuse a system message).
FAMILIES = {"gemma3": "gemma3", "gemma2": "gemma3", "gemma": "gemma3"}


@dataclass(frozen=True)
class SuppliedTemplate:
    family: str
    jinja: str  # path: the template as the model's publisher wrote it
    tokenizer_config: str  # path: the same, for llama_cpp.server


def template_files(family: str) -> SuppliedTemplate:
    here = files(__name__)
    return SuppliedTemplate(
        family=family,
        jinja=str(here.joinpath(f"{family}.jinja")),
        tokenizer_config=str(here.joinpath(f"{family}-tokenizer-config.json")),
    )


def supplied_for(weights_path: str | None) -> SuppliedTemplate | None:
    """The template to supply for a GGUF file: None when it carries its own, when its
    family is not one llmgw knows, or when the file cannot be read (a dry run)."""
    if not weights_path:
        return None
    try:
        info = read_info(weights_path)
    except GgufError:
        return None
    if info.chat_template is not None:
        return None
    family = FAMILIES.get(info.architecture or "")
    return template_files(family) if family is not None else None
