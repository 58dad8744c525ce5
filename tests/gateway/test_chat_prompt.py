"""The gateway renders a chat prompt exactly as llama_cpp.server does (metering.template).

Compared with llama-cpp-python's own formatter (the code the engine runs),
built from the template the agent supplies, over conversations drawn by
hypothesis; and what it will not render (tools, content parts, unknown
fields) is None, so that such a stream is counted the engine's way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from llama_cpp.llama_chat_format import hf_tokenizer_config_to_chat_formatter

from llmgw import wire
from llmgw.agent.engines.templates import template_files
from llmgw.gateway.dialect import mending_for
from llmgw.gateway.metering.template import chat_prompt

CONFIG = json.loads(Path(template_files("gemma3").tokenizer_config).read_text(encoding="utf-8"))
DECLARED = wire.ChatTemplate(
    jinja=CONFIG["chat_template"], bos_token=CONFIG["bos_token"], eos_token=CONFIG["eos_token"]
)
ENGINE = hf_tokenizer_config_to_chat_formatter(CONFIG)

text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
turn = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": text})
conversation = st.tuples(
    st.lists(st.fixed_dictionaries({"role": st.just("system"), "content": text}), max_size=1),
    st.lists(turn, min_size=1, max_size=4),
).map(lambda parts: [*parts[0], *parts[1]])


@settings(max_examples=200, deadline=None)
@given(conversation)
def test_the_rendering_is_the_engines(messages: list[dict[str, Any]]) -> None:
    prompt = chat_prompt(DECLARED)
    assert prompt is not None
    mine = prompt.render({"model": "m", "messages": messages})
    try:
        theirs = ENGINE(messages=messages, functions=None, function_call=None, tools=None,
                        tool_choice=None).prompt  # fmt: skip
    except Exception:
        # The template refuses these turns: so does the gateway's rendering.
        assert mine is None
        return
    assert mine == theirs


def test_what_it_is_not_certain_of_is_not_rendered() -> None:
    prompt = chat_prompt(DECLARED)
    assert prompt is not None
    user = {"role": "user", "content": "hi"}
    assert prompt.render({"messages": [user]}) is not None
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    for payload in (
        {"messages": [user], "tools": [tool]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
        {"messages": [{**user, "name": "someone"}]},
        {"messages": [{"role": "tool", "content": "1", "tool_call_id": "x"}]},
        {"messages": []},
    ):
        assert prompt.render(payload) is None, payload


def test_the_mending_carries_the_compiled_template() -> None:
    dialect = wire.EngineDialect(stream_usage=False, tokenize_path="/extras/tokenize/count",
                                 chat_template=DECLARED)  # fmt: skip
    mending = mending_for(dialect)
    assert mending.count_streams and mending.chat_prompt is chat_prompt(DECLARED)
    assert mending_for(dialect.model_copy(update={"chat_template": None})).chat_prompt is None
    broken = DECLARED.model_copy(update={"jinja": "{% if %}"})
    assert chat_prompt(broken) is None  # Jinja refuses it: streams counted the other way
