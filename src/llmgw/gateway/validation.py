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
wrong, is :mod:`llmgw.gateway.fieldchecks`; here are the checks only these
routes use and the table of each route's fields.

Cost: per route, one table from field name to a small check function, built
at import; a request walks its own keys once (a typical chat body takes a few
microseconds). No pydantic model per request: building one costs more than
the whole proxy hop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmgw.gateway.fieldchecks import (
    Check,
    array,
    array_of,
    boolean,
    each,
    empty_string,
    form_boolean,
    form_number,
    in_range,
    integer,
    invalid,
    missing,
    model_name,
    not_one_of,
    number,
    obj,
    objects,
    one_of,
    string,
    string_or_object,
    string_or_parts,
    strings,
    too_long,
    typed_object,
    typed_objects,
    upload,
    wrong_type,
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

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# Roles whose message may carry no content (an assistant turn that only
# calls tools, a function result that is null).
_CONTENT_OPTIONAL = frozenset({"assistant", "function"})
# Roles with nothing to check but their content (a tool result names its call).
# A tuple, the likeliest first: ``in`` compares, so a role of any JSON type
# (a list, an object) is tested without the type check a set's hashing needs.
_PLAIN_ROLES = ("user", "system", "assistant", "developer", "function")
MAX_STOP_SEQUENCES = 4
MAX_EMBEDDING_INPUTS = 2048
RESPONSE_ROLES = ("user", "assistant", "system", "developer")
AUDIO_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")


# -- chat and completions -------------------------------------------------------------


def stop(value: Any, param: str) -> None:
    if type(value) is str:
        return
    array(value, param, "a string or an array of strings")
    if len(value) > MAX_STOP_SEQUENCES:
        raise too_long(param, MAX_STOP_SEQUENCES, len(value))
    each(value, param, string)


_STREAM_OPTION_FLAGS = ("include_usage", "include_obfuscation")


def stream_options(value: Any, param: str) -> None:
    if type(value) is not dict:
        obj(value, param)  # raises
    for flag in _STREAM_OPTION_FLAGS:
        setting = value.get(flag)
        # A boolean passes inline: the field's path is formatted only for an error.
        if setting is not None and type(setting) is not bool:
            boolean(setting, f"{param}.{flag}")


_bias = number(-100, 100)


def logit_bias(value: Any, param: str) -> None:
    obj(value, param)
    for token, bias in value.items():
        _bias(bias, f"{param}.{token}")


def _role(message: dict[str, Any], at: str, roles: tuple[str, ...]) -> str:
    role = message.get("role")
    if type(role) is not str:
        raise wrong_type(f"{at}.role", "a string", role)
    if role not in roles:
        raise not_one_of(f"{at}.role", role, roles)
    return role


def _message(message: Any, at: str) -> None:
    # Every chat request checks each of its messages: the common case (a
    # known role, text content) is tested inline, without a call per field.
    if type(message) is not dict:
        raise wrong_type(at, "an object", message)
    role = message.get("role")
    if role not in ROLES or type(role) is not str:
        if role is None:
            raise missing(f"{at}.role")
        _role(message, at, ROLES)
    content = message.get("content")
    if content is None:
        if role not in _CONTENT_OPTIONAL:
            raise missing(f"{at}.content")
    elif type(content) is not str:
        string_or_parts(content, f"{at}.content", empty=False)
    if role == "tool":
        call = message.get("tool_call_id")
        if call is None:
            raise missing(f"{at}.tool_call_id")
        string(call, f"{at}.tool_call_id")
    name = message.get("name")
    if name is not None:
        string(name, f"{at}.name")


def messages(value: Any, param: str) -> None:
    if type(value) is not list or not value:
        array(value, param, empty=False)  # raises
    plain = _PLAIN_ROLES
    for message in value:
        # The usual message (a plain role, text content, no name) passes
        # here, without a call and without the path an error would name
        # formatted: this loop was ~4 % of the gateway's CPU per chat request.
        if (
            type(message) is dict
            and type(message.get("content")) is str
            and message.get("role") in plain
            and message.get("name") is None
        ):
            continue
        # Its index, for the path, only here (by identity: an equal message
        # elsewhere may differ in type, 1 == 1.0 == True).
        index = next(i for i, each in enumerate(value) if each is message)
        _message(message, f"{param}[{index}]")


def _token(value: Any, param: str) -> None:
    if type(value) is not int:
        raise wrong_type(param, "an integer", value)
    if value < 0:
        in_range(param, value, 0, None, "integer")


def _token_array(value: Any, param: str) -> None:
    each(array(value, param, "an array of integers", empty=False), param, _token)


def _text(value: Any, param: str) -> None:
    string(value, param)
    if not value:
        raise empty_string(param)


def _texts_or_tokens(value: Any, param: str, *, empty_text: bool) -> None:
    """A string, or a non-empty array of strings, of token ids, or of token-id arrays."""
    if type(value) is str:
        if not value and not empty_text:
            raise empty_string(param)
        return
    array(value, param, "a string or an array", empty=False)
    first = value[0]
    if type(first) is int:
        each(value, param, _token)
    elif type(first) is list:
        each(value, param, _token_array)
    else:
        each(value, param, string if empty_text else _text)


def prompt(value: Any, param: str) -> None:
    _texts_or_tokens(value, param, empty_text=True)


def embedding_input(value: Any, param: str) -> None:
    # OpenAI: "cannot be an empty string, and any array must be 2048
    # dimensions or less".
    _texts_or_tokens(value, param, empty_text=False)
    if type(value) is list and len(value) > MAX_EMBEDDING_INPUTS:
        raise too_long(param, MAX_EMBEDDING_INPUTS, len(value))


# -- the Responses API, rerank, score, transcriptions ------------------------------------


def _input_item(item: Any, at: str) -> None:
    obj(item, at)
    if item.get("role") is None:
        typed_object(item, at)
        return
    _role(item, at, RESPONSE_ROLES)
    content = item.get("content")
    if content is None:
        raise missing(f"{at}.content")
    string_or_parts(content, f"{at}.content")


def response_input(value: Any, param: str) -> None:
    """The Responses API's ``input``: text, or items (messages with a role, or typed items)."""
    if type(value) is str:
        return
    each(array(value, param, "a string or an array of input items", empty=False), param,
         _input_item)  # fmt: skip


def rerank_query(value: Any, param: str) -> None:
    if type(value) is dict:  # vLLM's multimodal query
        return
    model_name(value, param)  # a non-empty string


def texts(value: Any, param: str) -> None:
    """A string, a non-empty array of strings or objects, or one object (multimodal content)."""
    if type(value) is str or type(value) is dict:
        return
    each(array(value, param, "a string or an array", empty=False), param, string_or_object)


granularities = array_of(one_of("word", "segment"))


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
