"""A prompt's tokens for routing on replicas' exact caches, asked of the engine itself.

Exact holdings (:mod:`llmgw.gateway.routing.kvcache`) are token blocks, so a
prompt must be tokenised to be matched against them, and tokenised as the
engine will: its tokenizer, after its chat template. The gateway has neither
(the weights live on the nodes), so it asks the engine's ``/tokenize`` (vLLM:
``{"model", "messages"}`` renders the chat template as a chat request would,
``{"model", "prompt"}`` a completion's text). vLLM tokenises in its API
server's process, beside the engine core, so the question does not queue
behind prefill; a request with token ids for a prompt needs no question at
all. It costs a round trip before the pick (bench/routing_real.py --engine
vllm measures it); any failure, or an answer later than TOKENIZE_TIMEOUT_S,
routes the request by the estimate instead, as if no replica published.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from typing import Any

import orjson

from llmgw.gateway.engineclient import Upstream
from llmgw.gateway.routing.replica import Replica
from llmgw.http.upstream import BodyBroken, ConnectFailed, UpstreamTimeout

log = logging.getLogger(__name__)

# Longer than a loaded engine's API server takes to tokenise a long prompt
# (milliseconds), short beside the prefill an exact hit saves (seconds on a CPU).
TOKENIZE_TIMEOUT_S = 0.5
# What a chat request carries that its template reads besides the messages.
_TEMPLATE_FIELDS = ("tools", "chat_template_kwargs", "add_generation_prompt",
                    "continue_final_message", "documents")  # fmt: skip
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def token_prompt(path: str, payload: dict[str, Any]) -> list[int] | None:
    """A completions prompt given as token ids (its first, for a batch): no question needed."""
    if path != COMPLETIONS:
        return None
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, list):
            prompt = first
        if all(type(t) is int for t in prompt):
            return prompt
    return None


def tokenize_body(path: str, payload: dict[str, Any], served_name: str) -> dict[str, Any] | None:
    """What ``/tokenize`` is asked for this request's prompt; None: it cannot be."""
    if path == CHAT:
        messages = payload.get("messages")
        if not isinstance(messages, list):
            return None
        body: dict[str, Any] = {"model": served_name, "messages": messages}
        for field in _TEMPLATE_FIELDS:
            if field in payload:
                body[field] = payload[field]
        return body
    if path == COMPLETIONS:
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        return {"model": served_name, "prompt": prompt} if isinstance(prompt, str) else None
    return None


async def prompt_tokens(
    upstream: Upstream, replica: Replica, path: str, payload: dict[str, Any], served_name: str
) -> Sequence[int] | None:
    """The prompt's tokens as ``replica``'s engine makes them; None where they cannot be had."""
    ids = token_prompt(path, payload)
    if ids is not None:
        return ids
    body = tokenize_body(path, payload, served_name)
    if body is None:
        return None
    target = upstream.target(replica.url, "/tokenize", replica.engine_key)
    try:
        async with asyncio.timeout(TOKENIZE_TIMEOUT_S):
            response = await upstream.post(target, orjson.dumps(body), os.urandom(16).hex())
            try:
                data = await response.read()
            finally:
                response.release()
    except (TimeoutError, ConnectFailed, BodyBroken, UpstreamTimeout) as exc:
        log.info("tokenize on %s failed (%s): routed by the estimate", replica.replica_id, exc)
        return None
    if response.status != 200:
        log.info("tokenize on %s answered %d: routed by the estimate", replica.replica_id,
                 response.status)  # fmt: skip
        return None
    try:
        tokens = orjson.loads(data).get("tokens")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    if isinstance(tokens, list) and all(type(t) is int for t in tokens):
        return tokens
    return None
