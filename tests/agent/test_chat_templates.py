"""The chat templates the agent supplies, rendered by the engines' own code (issue 28).

The starter GGUF carries no template. llama_cpp.server's ``gemma`` format,
which the agent used to choose, drops every system message; the template the
agent now supplies (Gemma 3's official one, shipped in llmgw.agent.engines.
templates) keeps it, as the model's publisher wrote it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from llama_cpp import llama_chat_format
from tests.agent.helpers import assign, gpu, model

from llmgw.agent.engines import SglangAdapter
from llmgw.agent.engines.base import LaunchContext
from llmgw.agent.engines.templates import template_files

SYSTEM = "You are a lighthouse keeper."
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}],
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "More"}],
    [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
     {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
]  # fmt: skip
GEMMA = template_files("gemma3")


def official(messages: list[dict[str, Any]]) -> str:
    """Gemma 3's template as its publisher's tokenizer renders it (add_generation_prompt)."""
    def fail(message: str) -> None:
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = fail
    template = env.from_string(Path(GEMMA.jinja).read_text())
    return template.render(messages=messages, bos_token="<bos>", add_generation_prompt=True)


def test_llama_cpp_servers_gemma_format_drops_system_messages() -> None:
    # Why the agent no longer chooses it (llama_chat_format.py format_gemma).
    prompt = llama_chat_format.format_gemma(messages=CONVERSATIONS[1]).prompt  # type: ignore[arg-type]
    assert "Hi" in prompt and SYSTEM not in prompt


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_the_supplied_template_keeps_system_messages_in_llama_cpp_server(
    messages: list[dict[str, Any]],
) -> None:
    # As llama_cpp.server builds its handler from --hf_tokenizer_config_path.
    config = json.loads(Path(GEMMA.tokenizer_config).read_text())
    formatter = llama_chat_format.hf_tokenizer_config_to_chat_formatter(config)
    prompt = formatter(messages=messages).prompt  # type: ignore[arg-type]
    assert prompt == official(messages)
    assert prompt.endswith("<start_of_turn>model\n")
    if messages[0]["role"] == "system":
        assert prompt.startswith(f"<bos><start_of_turn>user\n{SYSTEM}\n\nHi<end_of_turn>\n")


def test_sglang_sends_developer_as_system_unless_the_models_template_knows_it(
    tmp_path: Path,
) -> None:
    # SGLang hands "developer" to the model's template as it is; Gemma 3's
    # (as the engines' HF model carries it) refuses the turn outright.
    with pytest.raises(ValueError, match="alternate"):
        official([{"role": "developer", "content": SYSTEM}, {"role": "user", "content": "Hi"}])
    gemma = tmp_path / "gemma"
    gemma.mkdir()
    (gemma / "chat_template.jinja").write_text(Path(GEMMA.jinja).read_text())
    (gemma / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>"}))
    harmony = tmp_path / "gpt-oss"
    harmony.mkdir()
    knows = "{% if m.role == 'developer' %}<|start|>developer{% endif %}"
    (harmony / "tokenizer_config.json").write_text(json.dumps({"chat_template": knows}))
    adapter = SglangAdapter(executable="sglang")
    for folder, keeps in ((gemma, False), (harmony, True), (tmp_path / "missing", False)):
        ctx = LaunchContext(assignment=assign(model("sglang"), [gpu(0)]),
                            weights_path=str(folder), host="10.0.0.5", port=22123,
                            devices=[gpu(0)])  # fmt: skip
        assert adapter.build(ctx).dialect.developer_role is keeps, folder
