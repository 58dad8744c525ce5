"""Mending engine dialects: what the gateway changes so every engine speaks OpenAI.

Each engine adapter declares what its engine gets wrong (:class:`wire.EngineDialect`);
the control plane passes it with every endpoint. Here it is compiled once per
endpoint into a :class:`Mending` (shared between endpoints that speak alike),
so the request path reads two booleans instead of interpreting a dialect.

Five things are mended:

* a limit in ``max_completion_tokens`` (what current OpenAI clients send) is
  sent as ``max_tokens`` to an engine that ignores the former, which would
  otherwise generate until its context is full;
* a stream from an engine that sends no usage is counted by the gateway after
  the stream, with the engine's own tokenizer (llmgw.gateway.metering.counter),
  and the usage chunk OpenAI sends is added for a client that asked for it;
* a non-streamed request to an engine that would finish it for a client who
  has left is sent as a stream, and the non-streamed answer is assembled from
  it (llmgw.gateway.routes.assemble), with the usage the engine reports in streams
  or, where it reports none, counted as above;
* a chat message of the ``developer`` role (OpenAI's new name for
  ``system``) is sent as ``system`` to an engine that knows no such role;
* an engine that applies LoRA adapters per request by number (llama-server)
  is told which one, at scale 1, for a request that names an adapter, and
  all of them at 0 for every other request (:func:`mend_lora`): a client's
  own ``lora`` field would reach adapters its key may not use.

A request the engine would answer wrongly or fail on is refused with 400
naming the field (:func:`refusal`): ``n`` > 1 where the engine returns one
choice, logprobs where it returns none.

An endpoint whose agent reported no dialect (an older agent) is served
unmended (:data:`LEGACY`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmgw import wire
from llmgw.gateway.metering.template import ChatPrompt, chat_prompt
from llmgw.gateway.replies import ApiError

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@dataclass(frozen=True, slots=True)
class Mending:
    """What the gateway does for one kind of endpoint, compiled from its dialect."""

    # The engine ignores max_completion_tokens: send the limit as max_tokens.
    rename_max_completion_tokens: bool
    # The engine sends no usage in streams: count them (needs a tokenize route).
    count_streams: bool
    tokenize_path: str | None
    tokenize_field: str
    # The engine finishes a non-streamed request whatever happens to its
    # client: send it as a stream and assemble the answer. Only where the
    # stream's usage is known (reported, or countable): an answer without
    # usage would cost the client more than an unstopped engine costs.
    assemble_unstreamed: bool = False
    # The engine reports usage in a stream when asked (include_usage).
    reports_stream_usage: bool = True
    # The engine knows no "developer" role: send such messages as "system".
    developer_as_system: bool = False
    # The engine returns no logprobs / one choice only: refuse requests for more.
    logprobs: bool = True
    choices: bool = True
    # No dialect was reported (an older agent): nothing is mended, and a
    # stream without usage is metered by its number of events.
    legacy: bool = False
    # The engine's chat template, where it declares one: a counted stream's
    # chat prompt is rendered and tokenized, never generated from.
    chat_prompt: ChatPrompt | None = None
    # The adapters the engine applies per request, by served name -> number
    # (EngineDialect.lora_ids); None: none, or loaded by name (vLLM).
    lora_ids: dict[str, int] | None = None


LEGACY = Mending(False, False, None, "input", legacy=True)
_compiled: dict[tuple[Any, ...], Mending] = {}


def mending_for(dialect: wire.EngineDialect | None) -> Mending:
    """The mending of one endpoint (called when a config arrives, never per request)."""
    if dialect is None:
        return LEGACY
    prompt = chat_prompt(dialect.chat_template)
    key = (
        prompt,
        dialect.max_completion_tokens,
        dialect.stream_usage,
        dialect.tokenize_path,
        dialect.tokenize_field,
        dialect.stops_unstreamed,
        dialect.developer_role,
        dialect.logprobs,
        dialect.choices,
        tuple(sorted(dialect.lora_ids.items())) if dialect.lora_ids else None,
    )
    mending = _compiled.get(key)
    if mending is None:
        count_streams = not dialect.stream_usage and dialect.tokenize_path is not None
        mending = Mending(
            rename_max_completion_tokens=not dialect.max_completion_tokens,
            count_streams=count_streams,
            tokenize_path=dialect.tokenize_path,
            tokenize_field=dialect.tokenize_field,
            assemble_unstreamed=not dialect.stops_unstreamed
            and (dialect.stream_usage or count_streams),
            reports_stream_usage=dialect.stream_usage,
            developer_as_system=not dialect.developer_role,
            logprobs=dialect.logprobs,
            choices=dialect.choices,
            chat_prompt=prompt,
            lora_ids=dict(dialect.lora_ids) if dialect.lora_ids else None,
        )
        _compiled[key] = mending
    return mending


def mend_request(path: str, payload: dict[str, Any], mending: Mending) -> bool:
    """Rewrite what the engine would ignore or refuse; True when ``payload`` changed."""
    changed = _mend_limit(path, payload, mending)
    if path == CHAT and mending.developer_as_system and _developer_as_system(payload):
        changed = True
    return changed


def mend_lora(payload: dict[str, Any], served: str, mending: Mending) -> bool:
    """Set the request's ``lora`` field for an engine that applies adapters by number;
    True when ``payload`` changed.

    ``served`` is the name the request is sent under: an adapter's own name
    picks that adapter, any other name (the base) runs with every adapter at
    scale 0. llama-server reads an adapter left out of the list as scale 0.
    """
    ids = mending.lora_ids
    if ids is None:
        return False
    chosen = ids.get(served)
    if chosen is None:
        wanted: list[dict[str, float]] = [{"id": min(ids.values()), "scale": 0.0}]
    else:
        wanted = [{"id": chosen, "scale": 1.0}]
    if payload.get("lora") == wanted:
        return False
    payload["lora"] = wanted
    return True


def _developer_as_system(payload: dict[str, Any]) -> bool:
    """Send ``developer`` messages as ``system``, which OpenAI treats them as.

    llama_cpp.server refused the role (a 500 with its validation error), and
    llama-server's built-in templates would write it as a turn of that name.
    """
    messages = payload.get("messages")
    if not isinstance(messages, list):
        return False
    changed = False
    for i, message in enumerate(messages):
        if isinstance(message, dict) and message.get("role") == "developer":
            messages[i] = {**message, "role": "system"}
            changed = True
    return changed


def refusal(path: str, payload: dict[str, Any], mending: Mending, model: str) -> ApiError | None:
    """400 naming the field, for a request the engine would answer wrongly or fail on.

    llama_cpp.server answers ``n: 2`` with one choice, and without
    ``--logits_all`` (as the agent starts it) fails on ``top_logprobs`` (a 500
    unstreamed, a stream cut before its first token) and answers a bare
    ``logprobs: true`` with ``logprobs: null``.
    """
    if path not in (CHAT, COMPLETIONS):
        return None
    n = payload.get("n")
    if not mending.choices and isinstance(n, int) and n > 1:
        return _unsupported(
            "n", f"The model `{model}`'s engine returns one choice: `n` must be 1"
            f" (got {n}); send {n} requests for {n} answers."
        )  # fmt: skip
    if mending.logprobs:
        return None
    if path == CHAT and payload.get("logprobs") is True:
        param = "top_logprobs" if payload.get("top_logprobs") is not None else "logprobs"
    elif path == COMPLETIONS and payload.get("logprobs") is not None:
        param = "logprobs"
    else:
        return None
    return _unsupported(
        param, f"The model `{model}`'s engine returns no log probabilities: leave out `{param}`."
    )


def _unsupported(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="unsupported_parameter")


def _mend_limit(path: str, payload: dict[str, Any], mending: Mending) -> bool:
    """``max_completion_tokens`` to ``max_tokens`` where the engine ignores it.

    And on ``/v1/completions`` for every engine: OpenAI's legacy endpoint
    only knows ``max_tokens``, and engines there ignore the other name. Both
    given: the smaller limit holds.
    """
    if "max_completion_tokens" not in payload:
        return False
    if not (mending.rename_max_completion_tokens or path == COMPLETIONS):
        return False
    limit = payload.pop("max_completion_tokens")
    if limit is None:
        return True
    current = payload.get("max_tokens")
    if isinstance(current, int) and isinstance(limit, int) and current <= limit:
        return True
    payload["max_tokens"] = limit
    return True
