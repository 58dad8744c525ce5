"""The token rule and the canonical chat rendering."""

from __future__ import annotations

import random

import pytest

from llmgw.errors import ValidationError
from llmgw.sim import tokens


def test_one_token_per_four_utf8_bytes_rounded_up() -> None:
    assert tokens.count_tokens("") == 0
    assert tokens.count_tokens("abcd") == 1
    assert tokens.count_tokens("abcde") == 2
    assert tokens.count_tokens("é" * 4) == 2  # 8 bytes


def test_generated_words_and_answers_are_one_token_each() -> None:
    text = tokens.random_words(random.Random(0), 37)
    assert len(text.split()) == 37 and tokens.count_tokens(text) == 37
    assert tokens.count_tokens(tokens.filler_text(50)) == 50
    assert tokens.filler_text(5) + tokens.filler_text(3, start=5) == tokens.filler_text(8)


def test_chat_rendering_is_prefix_stable_across_turns() -> None:
    turn1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    turn2 = [*turn1, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "?"}]
    assert tokens.render_chat(turn2).startswith(tokens.render_chat(turn1))
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert tokens.render_chat(parts) == tokens.render_chat([{"role": "user", "content": "ab"}])


def test_bad_messages_name_the_field() -> None:
    with pytest.raises(ValidationError, match=r"messages\[1\]\.role"):
        tokens.render_chat([{"role": "user", "content": "x"}, {"content": "y"}])
    with pytest.raises(ValidationError, match=r"messages\[0\]\.content"):
        tokens.render_chat([{"role": "user", "content": 3}])
