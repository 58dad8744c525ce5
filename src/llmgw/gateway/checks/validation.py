"""OpenAI's request envelope, checked before a request is routed or wakes a replica.

Why the gateway checks it: an engine handed a malformed request answers in
its own words (a 422 with a pydantic dump, a 500) or, worse, accepts it:
llama_cpp.server took a chat request without ``messages`` and generated
until its context was full, and the client got a 503. Checked here, a wrong
request costs microseconds, never reaches an engine nor starts an on-demand
replica, and every client gets OpenAI's 400 naming the offending ``param``
(``messages[1].role``), whatever engine serves the model.

What is checked: the fields OpenAI's API defines for each route, their types
and ranges, the required ones, and the cross-field rules OpenAI enforces
(``stream_options`` only with ``stream``, ``top_logprobs`` only with
``logprobs``). What is not: fields OpenAI does not define (engines'
extensions such as ``top_k`` pass through untouched) and what only the model
can judge (prompt length, token ids). ``null`` is accepted wherever OpenAI
accepts it: the default applies. How one value is checked, and worded when
wrong, is :mod:`llmgw.gateway.checks.fields`; the checks only these routes
use are :mod:`llmgw.gateway.checks.values`; here is the table of each
route's fields and the rules across them.

Cost: per route, one table from field name to a small check function, built
at import; a request walks its own keys once (a typical chat body takes a few
microseconds). No pydantic model per request: building one costs more than
the whole proxy hop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmgw.gateway.checks.fields import (
    Check,
    boolean,
    form_boolean,
    form_number,
    integer,
    invalid,
    missing,
    model_name,
    number,
    obj,
    objects,
    one_of,
    string,
    string_or_object,
    strings,
    typed_object,
    typed_objects,
    upload,
)
from llmgw.gateway.checks.values import (
    embedding_input,
    granularities,
    logit_bias,
    messages,
    prompt,
    rerank_query,
    response_input,
    stop,
    stream_options,
    texts,
)

# The routes whose body this module knows; tests keep it equal to the
# gateway's POST routes.
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
EMBEDDINGS_PATH = "/v1/embeddings"
RESPONSES_PATH = "/v1/responses"
RERANK_PATH = "/v1/rerank"
SCORE_PATH = "/v1/score"
TRANSCRIPTIONS_PATH = "/v1/audio/transcriptions"

AUDIO_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")


# -- the envelopes -----------------------------------------------------------------


def _stream_rules(payload: dict[str, Any]) -> None:
    if payload.get("stream_options") is not None and payload.get("stream") is not True:
        raise invalid(
            "stream_options",
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            "invalid_value",
        )


def _chat_rules(payload: dict[str, Any]) -> None:
    _stream_rules(payload)
    if payload.get("top_logprobs") is not None and payload.get("logprobs") is not True:
        raise invalid(
            "top_logprobs",
            "Invalid value for 'top_logprobs': 'logprobs' must be set to true"
            " when 'top_logprobs' is used.",
            "invalid_value",
        )


def _completion_rules(payload: dict[str, Any]) -> None:
    _stream_rules(payload)
    best_of, n = payload.get("best_of"), payload.get("n")
    if best_of is not None and n is not None and best_of < n:
        raise invalid(
            "best_of",
            f"Invalid 'best_of': it must be at least 'n' ({n}), but got {best_of} instead.",
            "invalid_value",
        )


# Without ``input`` a response continues or templates another (OpenAI's API).
_INPUT_ELSEWHERE = ("previous_response_id", "prompt", "conversation")


def _responses_rules(payload: dict[str, Any]) -> None:
    _stream_rules(payload)
    if payload.get("input") is None and all(payload.get(k) is None for k in _INPUT_ELSEWHERE):
        raise missing("input")


def _transcription_rules(payload: dict[str, Any]) -> None:
    wanted = payload.get("timestamp_granularities[]")
    if wanted and payload.get("response_format") != "verbose_json":
        raise invalid(
            "timestamp_granularities[]",
            "Invalid value for 'timestamp_granularities[]': 'response_format' must be"
            " 'verbose_json' to use timestamp granularities.",
            "invalid_value",
        )


def _no_rules(payload: dict[str, Any]) -> None:
    return None


@dataclass(frozen=True, slots=True)
class Envelope:
    """One route's fields: which must be there, how each is checked, and cross-field rules."""

    required: tuple[str, ...]
    fields: dict[str, Check]
    rules: Callable[[dict[str, Any]], None] = _no_rules

    def check(self, payload: dict[str, Any]) -> None:
        for name in self.required:
            if payload.get(name) is None:
                raise missing(name)
        fields = self.fields
        for name, value in payload.items():
            check = fields.get(name)
            if check is not None and value is not None:
                check(value, name)
        self.rules(payload)


# Field groups: a field several routes take is checked alike on all of them.
# Every JSON route: the model, and OpenAI's end-user id.
_NAMED: dict[str, Check] = {"model": model_name, "user": string}
# Chat, completions and the Responses API: how to sample, whether to stream.
_SAMPLED: dict[str, Check] = {
    **_NAMED,
    "temperature": number(0, 2),
    "top_p": number(0, 1),
    "stream": boolean,
}
# Chat and completions: the rest of sampling and its limits.
_SAMPLING: dict[str, Check] = {
    **_SAMPLED,
    "max_tokens": integer(1),
    "n": integer(1, 128),
    "presence_penalty": number(-2, 2),
    "frequency_penalty": number(-2, 2),
    "stream_options": stream_options,
    "stop": stop,
    "seed": integer(),
    "logit_bias": logit_bias,
}
# Chat and the Responses API: tools, stored conversations, logprobs.
_CONVERSING: dict[str, Check] = {
    "top_logprobs": integer(0, 20),
    "tools": typed_objects,
    "tool_choice": string_or_object,
    "parallel_tool_calls": boolean,
    "store": boolean,
    "metadata": obj,
}
# Rerank and score: what a cross-encoder is given.
_SCORED: dict[str, Check] = {**_NAMED, "truncate_prompt_tokens": integer(-1)}

CHAT = Envelope(
    required=("model", "messages"),
    fields={
        **_SAMPLING,
        **_CONVERSING,
        "messages": messages,
        "max_completion_tokens": integer(1),
        "logprobs": boolean,
        "response_format": typed_object,
        "functions": objects,
        "function_call": string_or_object,
    },
    rules=_chat_rules,
)

COMPLETIONS = Envelope(
    required=("model", "prompt"),
    fields={
        **_SAMPLING,
        "prompt": prompt,
        # 0 is allowed here: with echo it asks for the prompt's logprobs only.
        "max_tokens": integer(0),
        "logprobs": integer(0, 5),
        "echo": boolean,
        "best_of": integer(0, 20),
        "suffix": string,
    },
    rules=_completion_rules,
)

EMBEDDINGS = Envelope(
    required=("model", "input"),
    fields={
        **_NAMED,
        "input": embedding_input,
        "dimensions": integer(1),
        "encoding_format": one_of("float", "base64"),
    },
)

RESPONSES = Envelope(
    required=("model",),
    fields={
        **_SAMPLED,
        **_CONVERSING,
        "input": response_input,
        "instructions": string,
        "max_output_tokens": integer(1),
        "max_tool_calls": integer(1),
        "stream_options": obj,
        "background": boolean,
        "previous_response_id": string,
        "conversation": string_or_object,
        "prompt": obj,
        "text": obj,
        "reasoning": obj,
        "include": strings,
        "truncation": one_of("auto", "disabled"),
    },
    rules=_responses_rules,
)

RERANK = Envelope(
    required=("model", "query", "documents"),
    fields={
        **_SCORED,
        "query": rerank_query,
        "documents": texts,
        "top_n": integer(0),
        "return_documents": boolean,
        "max_tokens_per_doc": integer(1),
    },
)

# vLLM's score request names its two sides any of these ways
# (entrypoints/pooling/scoring/protocol.py ScoreRequest, in its order).
SCORE_PAIRS = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"),
               ("text_1", "text_2"))  # fmt: skip


def _score_rules(payload: dict[str, Any]) -> None:
    if any(all(payload.get(side) is not None for side in pair) for pair in SCORE_PAIRS):
        return
    given = [name for pair in SCORE_PAIRS for name in pair if payload.get(name) is not None]
    for first, second in SCORE_PAIRS:
        if first in given and second not in given and not (
            first == "queries" and "items" in given
        ):
            raise missing(second)
    raise invalid(
        "text_1",
        "Missing the two sides to score: give 'text_1' and 'text_2', 'queries' and"
        " 'documents' (or 'items'), or 'data_1' and 'data_2'.",
        "missing_required_parameter",
    )


SCORE = Envelope(
    required=("model",),
    fields={**_SCORED, **{side: texts for pair in SCORE_PAIRS for side in pair}},
    rules=_score_rules,
)

# A form: every field arrives as text (or as a file).
TRANSCRIPTIONS = Envelope(
    required=("model", "file"),
    fields={
        "model": model_name,
        "file": upload,
        "language": string,
        "prompt": string,
        "response_format": one_of(*AUDIO_FORMATS),
        "temperature": form_number(0, 1),
        "stream": form_boolean,
        "stream_include_usage": form_boolean,
        "timestamp_granularities[]": granularities,
    },
    rules=_transcription_rules,
)

ENVELOPES: dict[str, Envelope] = {
    CHAT_PATH: CHAT,
    COMPLETIONS_PATH: COMPLETIONS,
    EMBEDDINGS_PATH: EMBEDDINGS,
    RESPONSES_PATH: RESPONSES,
    RERANK_PATH: RERANK,
    SCORE_PATH: SCORE,
    TRANSCRIPTIONS_PATH: TRANSCRIPTIONS,
}


def check_request(path: str, payload: dict[str, Any]) -> None:
    """Raise a 400 :class:`ApiError` naming the first wrong field of ``payload``, if any."""
    envelope = ENVELOPES.get(path)
    if envelope is not None:
        envelope.check(payload)
