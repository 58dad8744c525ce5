"""A chat prompt rendered as its engine renders it, so that its tokens can be counted.

Only for an engine that declares its template (``wire.ChatTemplate``) and
reports no stream usage: the gateway then counts a stream's chat prompt
with the engine's tokenize route on this text, and never asks the engine to
generate for a count (a one-token copy of the request runs on the engine
and, on llama_cpp.server, takes a state of its bounded prompt cache).

A request is rendered only where the rendering is certainly the engine's:
plain text turns of the roles every template knows, and no tools or
functions (which templates render in their own ways, and the engine's
request models reshape). Anything else is None, and counted the other way.
"""

from __future__ import annotations

from typing import Any

from llmgw import wire

# The message fields the engine's request models keep for these roles
# (llama_cpp.server's TypedDicts): a message with any other is not rendered
# here, since the engine would drop or reshape it first.
_ROLES = frozenset({"system", "user", "assistant"})
_FIELDS = frozenset({"role", "content"})
# Request fields that put tools into the template.
_TOOLS = ("tools", "tool_choice", "functions", "function_call")


class ChatPrompt:
    """One declared template, compiled once per gateway (templates are few)."""

    __slots__ = ("_bos", "_eos", "_template")

    def __init__(self, declared: wire.ChatTemplate) -> None:
        # Imported here: only gateways in front of such engines need Jinja.
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        # As llama_chat_format.hf_tokenizer_config_to_chat_formatter builds it.
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._template = environment.from_string(declared.jinja)
        self._bos = declared.bos_token
        self._eos = declared.eos_token

    def render(self, payload: dict[str, Any]) -> str | None:
        """The prompt text the engine evaluates for this chat request; None: not certain."""
        if any(payload.get(name) is not None for name in _TOOLS):
            return None
        messages = payload.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        for message in messages:
            if (
                not isinstance(message, dict)
                or message.keys() - _FIELDS
                or message.get("role") not in _ROLES
                or not isinstance(message.get("content"), str)
            ):
                return None
        # hf-tokenizer-config: an empty assistant turn where the generation
        # prompt goes, and the request's tool fields (None here) passed on.
        turns = [*messages, {"role": "assistant", "content": ""}]
        try:
            text = self._template.render(
                messages=turns, bos_token=self._bos, eos_token=self._eos, functions=None,
                function_call=None, tools=None, tool_choice=None,
            )  # fmt: skip
        except Exception:
            # The template's own refusal (the engine answers it with a 500):
            # nothing to count here.
            return None
        return text


# Compiled templates by their declaration's JSON: one per distinct template.
_compiled: dict[str, ChatPrompt | None] = {}


def chat_prompt(declared: wire.ChatTemplate | None) -> ChatPrompt | None:
    """The compiled template (called when a config arrives, never per request)."""
    if declared is None:
        return None
    key = declared.model_dump_json()
    if key not in _compiled:
        try:
            _compiled[key] = ChatPrompt(declared)
        except Exception:
            # A template Jinja refuses: its streams are counted the other way.
            _compiled[key] = None
    return _compiled[key]
