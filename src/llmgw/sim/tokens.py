"""The simulator's tokenizer: a cheap, documented rule instead of a vocabulary.

A real tokenizer costs more CPU per request than the whole simulated engine,
and dozens of engines share two cores. What routing and caching depend on is
only that (a) the same text always gives the same tokens, (b) a longer text
gives more tokens, and (c) two texts that share a prefix share the blocks of
that prefix. Bytes give all three for free:

**One token is 4 bytes of UTF-8; a text of n bytes counts ceil(n / 4) tokens.**

Token i of a text is bytes ``[4i, 4i + 4)``; a KV block of ``b`` tokens is
``4b`` bytes. Chat messages are first rendered into one canonical string
(:func:`render_chat`) so a chat request and the equivalent completion prompt
cost the same, and so that a conversation's rendering is a prefix of the
rendering of the same conversation one turn later (prefix caching of chat
history depends on it).

Text the simulator writes (answers) and text the workloads generate is made
of 3-letter words plus a space: exactly one token per word under this rule,
so "a 6,000-token system prompt" is 6,000 words.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import string
from collections.abc import Mapping, Sequence

from llmgw.errors import ValidationError

BYTES_PER_TOKEN = 4

# 26^3 = 17,576 words: enough that random prompts built from them never share
# a block by accident (a 16-token block has 17,576^16 possible contents).
VOCABULARY: tuple[str, ...] = tuple(
    "".join(letters) for letters in itertools.product(string.ascii_lowercase, repeat=3)
)

# The engine's answers cycle through a short list of real-looking words; any
# fixed list works as long as every entry is 3 bytes (one token with the space).
_FILLER: tuple[str, ...] = (
    "the", "sim", "and", "kv_", "for", "you", "one", "two", "big", "run",
    "new", "old", "top", "low", "key", "map", "row", "set", "day", "way",
)  # fmt: skip

# Digest size of the chained block hash; 16 bytes keeps collisions out of
# reach for any cache this process can hold while staying cheap to compare.
_HASH_BYTES = 16
_ROOT_HASH = b"\x00" * _HASH_BYTES


def count_tokens(text: str) -> int:
    return count_bytes_tokens(len(text.encode("utf-8")))


def count_bytes_tokens(n_bytes: int) -> int:
    return -(-n_bytes // BYTES_PER_TOKEN)


def message_text(message: Mapping[str, object], index: int) -> tuple[str, str]:
    """(role, text) of one chat message, or ValidationError naming the message.

    Content may be a string or a list of parts; text parts are joined, other
    parts (images, audio) are refused since the simulator cannot cost them.
    """
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ValidationError(
            f"messages[{index}].role must be a non-empty string", field="messages"
        )
    content = message.get("content")
    if content is None:
        return role, ""
    if isinstance(content, str):
        return role, content
    if isinstance(content, list):
        texts: list[str] = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ValidationError(
                    f"messages[{index}].content[{j}] must be a text part", field="messages"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise ValidationError(
                    f"messages[{index}].content[{j}].text must be a string", field="messages"
                )
            texts.append(text)
        return role, "".join(texts)
    raise ValidationError(
        f"messages[{index}].content must be a string or a list of text parts", field="messages"
    )


def render_message(role: str, text: str) -> str:
    return f"<|{role}|>\n{text}\n"


# Appended after the last message: the cue for the model's answer. It equals
# the start of an assistant message's rendering, so turn k's prompt is an
# exact prefix of turn k+1's prompt once the answer is appended.
GENERATION_CUE = "<|assistant|>\n"


def render_chat(messages: Sequence[Mapping[str, object]]) -> str:
    """One canonical string for a list of chat messages (see module doc)."""
    parts = [render_message(*message_text(m, i)) for i, m in enumerate(messages)]
    parts.append(GENERATION_CUE)
    return "".join(parts)


def block_hashes(
    data: bytes, block_tokens: int, limit: int | None = None, salt: bytes = b""
) -> list[bytes]:
    """Chained hashes of the full blocks of ``data`` (a partial last block has none).

    Block i's hash covers block i's bytes *and* block i-1's hash, so equal
    hashes at position i mean equal prefixes up to i: a cache hit on a block
    implies hits on everything before it, which is what lets an engine (and a
    router) match the longest cached prefix block by block. ``salt`` starts
    the chain elsewhere: a LoRA adapter's name, so that two adapters (and
    their base) never share a block, as vLLM keys its prefix cache by adapter.
    """
    size = block_tokens * BYTES_PER_TOKEN
    full = len(data) // size
    if limit is not None:
        full = min(full, limit)
    out: list[bytes] = []
    prev = _ROOT_HASH
    if salt:
        prev = hashlib.blake2b(_ROOT_HASH + salt, digest_size=_HASH_BYTES).digest()
    view = memoryview(data)
    for i in range(full):
        h = hashlib.blake2b(prev, digest_size=_HASH_BYTES)
        h.update(view[i * size : (i + 1) * size])
        prev = h.digest()
        out.append(prev)
    return out


def filler_token(i: int) -> str:
    """The i-th token of every answer: deterministic, one token (4 bytes)."""
    return _FILLER[(i * 7 + i // len(_FILLER)) % len(_FILLER)] + " "


def filler_text(n_tokens: int, start: int = 0) -> str:
    """The answer text of ``n_tokens`` tokens, as the simulated engine writes it."""
    return "".join(filler_token(i) for i in range(start, start + n_tokens))


def random_words(rng: random.Random, n_tokens: int) -> str:
    """``n_tokens`` random words (one token each) drawn from ``rng``."""
    return " ".join(rng.choices(VOCABULARY, k=n_tokens)) + " " if n_tokens > 0 else ""
