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
accepts it: the default applies. Booleans are not numbers here, although
Python's ``bool`` is an ``int``, and ``10.0`` is not an integer: OpenAI
refuses both, and an engine may not.

Cost: per route, one table from field name to a small check function, built
at import; a request walks its own keys once (a typical chat body takes a few
microseconds). No pydantic model per request: building one costs more than
the whole proxy hop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmgw.gateway.multipart import Upload
from llmgw.gateway.responses import ApiError

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
MAX_STOP_SEQUENCES = 4
MAX_EMBEDDING_INPUTS = 2048

Check = Callable[[Any, str], None]


# -- errors, worded as OpenAI words them ----------------------------------------


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, Upload):
        return "a file"
    return type(value).__name__


def _invalid(param: str, message: str, code: str) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _wrong_type(param: str, expected: str, value: Any) -> ApiError:
    return _invalid(
        param,
        f"Invalid type for '{param}': expected {expected}, but got {_describe(value)} instead.",
        "invalid_type",
    )


def _missing(param: str) -> ApiError:
    return _invalid(param, f"Missing required parameter: '{param}'.", "missing_required_parameter")


def _empty_array(param: str) -> ApiError:
    return _invalid(
        param,
        f"Invalid '{param}': empty array. Expected an array with minimum length 1,"
        " but got an empty array instead.",
        "empty_array",
    )


def _too_long(param: str, limit: int, length: int) -> ApiError:
    return _invalid(
        param,
        f"Invalid '{param}': array too long. Expected an array with maximum length {limit},"
        f" but got an array with length {length} instead.",
        "array_above_max_length",
    )


def _empty_string(param: str) -> ApiError:
    return _invalid(
        param,
        f"Invalid '{param}': empty string. Expected a string with minimum length 1,"
        " but got an empty string instead.",
        "empty_string",
    )


def _not_one_of(param: str, value: Any, allowed: tuple[str, ...]) -> ApiError:
    listed = ", ".join(f"'{a}'" for a in allowed)
    return _invalid(
        param,
        f"Invalid value for '{param}': {value!r}. Supported values are: {listed}.",
        "invalid_value",
    )


def _range(param: str, value: float, low: float | None, high: float | None, kind: str) -> None:
    if low is not None and value < low:
        raise _invalid(
            param,
            f"Invalid '{param}': {kind} below minimum value. Expected a value >= {low},"
            f" but got {value} instead.",
            f"{kind}_below_min_value",
        )
    if high is not None and value > high:
        raise _invalid(
            param,
            f"Invalid '{param}': {kind} above maximum value. Expected a value <= {high},"
            f" but got {value} instead.",
            f"{kind}_above_max_value",
        )


# -- checks of one value (never None: null means "the default") ------------------


def integer(low: int | None = None, high: int | None = None) -> Check:
    def check(value: Any, param: str) -> None:
        if type(value) is not int:  # True is an int to Python, not to OpenAI
            raise _wrong_type(param, "an integer", value)
        _range(param, value, low, high, "integer")

    return check


def number(low: float | None = None, high: float | None = None) -> Check:
    def check(value: Any, param: str) -> None:
        if type(value) is not float and type(value) is not int:
            raise _wrong_type(param, "a number", value)
        _range(param, value, low, high, "decimal")

    return check


def boolean(value: Any, param: str) -> None:
    if type(value) is not bool:
        raise _wrong_type(param, "a boolean", value)


def string(value: Any, param: str) -> None:
    if type(value) is not str:
        raise _wrong_type(param, "a string", value)


def obj(value: Any, param: str) -> None:
    if type(value) is not dict:
        raise _wrong_type(param, "an object", value)


def one_of(*allowed: str) -> Check:
    def check(value: Any, param: str) -> None:
        if type(value) is not str:
            raise _wrong_type(param, "a string", value)
        if value not in allowed:
            raise _not_one_of(param, value, allowed)

    return check


def string_or_object(value: Any, param: str) -> None:
    if type(value) is not str and type(value) is not dict:
        raise _wrong_type(param, "a string or an object", value)


def typed_objects(value: Any, param: str) -> None:
    """A list of objects that each say their ``type`` (tools)."""
    if type(value) is not list:
        raise _wrong_type(param, "an array", value)
    for index, item in enumerate(value):
        _typed_object(item, f"{param}[{index}]")


def objects(value: Any, param: str) -> None:
    if type(value) is not list:
        raise _wrong_type(param, "an array", value)
    for index, item in enumerate(value):
        if type(item) is not dict:
            raise _wrong_type(f"{param}[{index}]", "an object", item)


def _typed_object(value: Any, param: str) -> None:
    if type(value) is not dict:
        raise _wrong_type(param, "an object", value)
    kind = value.get("type")
    if kind is None:
        raise _missing(f"{param}.type")
    if type(kind) is not str:
        raise _wrong_type(f"{param}.type", "a string", kind)


def model_name(value: Any, param: str) -> None:
    if type(value) is not str:
        raise _wrong_type(param, "a string", value)
    if not value:
        raise _empty_string(param)


def stop(value: Any, param: str) -> None:
    if type(value) is str:
        return
    if type(value) is not list:
        raise _wrong_type(param, "a string or an array of strings", value)
    if len(value) > MAX_STOP_SEQUENCES:
        raise _too_long(param, MAX_STOP_SEQUENCES, len(value))
    for index, item in enumerate(value):
        if type(item) is not str:
            raise _wrong_type(f"{param}[{index}]", "a string", item)


_STREAM_OPTION_FLAGS = ("include_usage", "include_obfuscation")


def stream_options(value: Any, param: str) -> None:
    if type(value) is not dict:
        raise _wrong_type(param, "an object", value)
    for flag in _STREAM_OPTION_FLAGS:
        setting = value.get(flag)
        if setting is not None and type(setting) is not bool:
            raise _wrong_type(f"{param}.{flag}", "a boolean", setting)


_bias = number(-100, 100)


def logit_bias(value: Any, param: str) -> None:
    if type(value) is not dict:
        raise _wrong_type(param, "an object", value)
    for token, bias in value.items():
        _bias(bias, f"{param}.{token}")


def messages(value: Any, param: str) -> None:
    if type(value) is not list:
        raise _wrong_type(param, "an array", value)
    if not value:
        raise _empty_array(param)
    for index, message in enumerate(value):
        _message(message, f"{param}[{index}]")


def _message(message: Any, at: str) -> None:
    if type(message) is not dict:
        raise _wrong_type(at, "an object", message)
    role = message.get("role")
    if role is None:
        raise _missing(f"{at}.role")
    if type(role) is not str or role not in ROLES:
        if type(role) is not str:
            raise _wrong_type(f"{at}.role", "a string", role)
        raise _not_one_of(f"{at}.role", role, ROLES)
    content = message.get("content")
    if content is None:
        if role not in _CONTENT_OPTIONAL:
            raise _missing(f"{at}.content")
    elif type(content) is list:
        if not content:
            raise _empty_array(f"{at}.content")
        for index, part in enumerate(content):
            _typed_object(part, f"{at}.content[{index}]")
    elif type(content) is not str:
        raise _wrong_type(f"{at}.content", "a string or an array of content parts", content)
    if role == "tool":
        call = message.get("tool_call_id")
        if call is None:
            raise _missing(f"{at}.tool_call_id")
        if type(call) is not str:
            raise _wrong_type(f"{at}.tool_call_id", "a string", call)
    name = message.get("name")
    if name is not None and type(name) is not str:
        raise _wrong_type(f"{at}.name", "a string", name)


def _tokens(value: list[Any], param: str) -> None:
    for index, token in enumerate(value):
        if type(token) is not int:
            raise _wrong_type(f"{param}[{index}]", "an integer", token)
        if token < 0:
            _range(f"{param}[{index}]", token, 0, None, "integer")


def _texts_or_tokens(value: Any, param: str, *, empty_text: bool) -> None:
    """A string, or a non-empty array of strings, of token ids, or of token-id arrays."""
    if type(value) is str:
        if not value and not empty_text:
            raise _empty_string(param)
        return
    if type(value) is not list:
        raise _wrong_type(param, "a string or an array", value)
    if not value:
        raise _empty_array(param)
    first = value[0]
    if type(first) is int:
        _tokens(value, param)
        return
    if type(first) is list:
        for index, item in enumerate(value):
            at = f"{param}[{index}]"
            if type(item) is not list:
                raise _wrong_type(at, "an array of integers", item)
            if not item:
                raise _empty_array(at)
            _tokens(item, at)
        return
    for index, item in enumerate(value):
        if type(item) is not str:
            raise _wrong_type(f"{param}[{index}]", "a string", item)
        if not item and not empty_text:
            raise _empty_string(f"{param}[{index}]")


def prompt(value: Any, param: str) -> None:
    _texts_or_tokens(value, param, empty_text=True)


def embedding_input(value: Any, param: str) -> None:
    # OpenAI: "cannot be an empty string, and any array must be 2048
    # dimensions or less".
    _texts_or_tokens(value, param, empty_text=False)
    if type(value) is list and len(value) > MAX_EMBEDDING_INPUTS:
        raise _too_long(param, MAX_EMBEDDING_INPUTS, len(value))


RESPONSE_ROLES = ("user", "assistant", "system", "developer")
AUDIO_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
_FORM_TRUE = ("true", "1", "yes", "on")
_FORM_FALSE = ("false", "0", "no", "off")


def strings(value: Any, param: str) -> None:
    if type(value) is not list:
        raise _wrong_type(param, "an array of strings", value)
    for index, item in enumerate(value):
        if type(item) is not str:
            raise _wrong_type(f"{param}[{index}]", "a string", item)


def response_input(value: Any, param: str) -> None:
    """The Responses API's ``input``: text, or items (messages with a role, or typed items)."""
    if type(value) is str:
        return
    if type(value) is not list:
        raise _wrong_type(param, "a string or an array of input items", value)
    if not value:
        raise _empty_array(param)
    for index, item in enumerate(value):
        at = f"{param}[{index}]"
        if type(item) is not dict:
            raise _wrong_type(at, "an object", item)
        role = item.get("role")
        if role is None:
            _typed_object(item, at)
            continue
        if type(role) is not str:
            raise _wrong_type(f"{at}.role", "a string", role)
        if role not in RESPONSE_ROLES:
            raise _not_one_of(f"{at}.role", role, RESPONSE_ROLES)
        content = item.get("content")
        if content is None:
            raise _missing(f"{at}.content")
        if type(content) is list:
            for part, piece in enumerate(content):
                _typed_object(piece, f"{at}.content[{part}]")
        elif type(content) is not str:
            raise _wrong_type(f"{at}.content", "a string or an array of content parts", content)


def rerank_query(value: Any, param: str) -> None:
    if type(value) is dict:  # vLLM's multimodal query
        return
    model_name(value, param)  # a non-empty string


def texts(value: Any, param: str) -> None:
    """A string, a non-empty array of strings or objects, or one object (multimodal content)."""
    if type(value) is str or type(value) is dict:
        return
    if type(value) is not list:
        raise _wrong_type(param, "a string or an array", value)
    if not value:
        raise _empty_array(param)
    for index, item in enumerate(value):
        if type(item) is not str and type(item) is not dict:
            raise _wrong_type(f"{param}[{index}]", "a string or an object", item)


def upload(value: Any, param: str) -> None:
    if not isinstance(value, Upload):
        raise _wrong_type(param, "a file", value)


def form_number(low: float, high: float) -> Check:
    """A number given as form text ("0.2")."""

    def check(value: Any, param: str) -> None:
        if type(value) is not str:
            raise _wrong_type(param, "a number", value)
        try:
            number = float(value)
        except ValueError:
            raise _invalid(param, f"Invalid value for '{param}': expected a number, but got"
                           f" {value!r} instead.", "invalid_type") from None  # fmt: skip
        _range(param, number, low, high, "decimal")

    return check


def form_boolean(value: Any, param: str) -> None:
    if type(value) is not str or value.lower() not in (*_FORM_TRUE, *_FORM_FALSE):
        raise _invalid(
            param,
            f"Invalid value for '{param}': expected a boolean ('true' or 'false'),"
            f" but got {value!r} instead.",
            "invalid_type",
        )


def form_true(payload: dict[str, Any], name: str) -> bool:
    """Whether form field ``name`` says true (it passed :func:`form_boolean`)."""
    value = payload.get(name)
    return type(value) is str and value.lower() in _FORM_TRUE


def granularities(value: Any, param: str) -> None:
    if type(value) is not list:
        raise _wrong_type(param, "an array", value)
    check = one_of("word", "segment")
    for index, item in enumerate(value):
        check(item, f"{param}[{index}]")


# -- the envelopes -----------------------------------------------------------------


def _stream_rules(payload: dict[str, Any]) -> None:
    if payload.get("stream_options") is not None and payload.get("stream") is not True:
        raise _invalid(
            "stream_options",
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            "invalid_value",
        )


def _chat_rules(payload: dict[str, Any]) -> None:
    _stream_rules(payload)
    if payload.get("top_logprobs") is not None and payload.get("logprobs") is not True:
        raise _invalid(
            "top_logprobs",
            "Invalid value for 'top_logprobs': 'logprobs' must be set to true"
            " when 'top_logprobs' is used.",
            "invalid_value",
        )


def _completion_rules(payload: dict[str, Any]) -> None:
    _stream_rules(payload)
    best_of, n = payload.get("best_of"), payload.get("n")
    if best_of is not None and n is not None and best_of < n:
        raise _invalid(
            "best_of",
            f"Invalid 'best_of': it must be at least 'n' ({n}), but got {best_of} instead.",
            "invalid_value",
        )


def _no_rules(payload: dict[str, Any]) -> None:
    return None


# Without ``input`` a response continues or templates another (OpenAI's API).
_INPUT_ELSEWHERE = ("previous_response_id", "prompt", "conversation")


def _responses_rules(payload: dict[str, Any]) -> None:
    _stream_rules(payload)
    if payload.get("input") is None and all(payload.get(k) is None for k in _INPUT_ELSEWHERE):
        raise _missing("input")


def _transcription_rules(payload: dict[str, Any]) -> None:
    wanted = payload.get("timestamp_granularities[]")
    if wanted and payload.get("response_format") != "verbose_json":
        raise _invalid(
            "timestamp_granularities[]",
            "Invalid value for 'timestamp_granularities[]': 'response_format' must be"
            " 'verbose_json' to use timestamp granularities.",
            "invalid_value",
        )


@dataclass(frozen=True, slots=True)
class Envelope:
    """One route's fields: which must be there, how each is checked, and cross-field rules."""

    required: tuple[str, ...]
    fields: dict[str, Check]
    rules: Callable[[dict[str, Any]], None]

    def check(self, payload: dict[str, Any]) -> None:
        for name in self.required:
            if payload.get(name) is None:
                raise _missing(name)
        fields = self.fields
        for name, value in payload.items():
            check = fields.get(name)
            if check is not None and value is not None:
                check(value, name)
        self.rules(payload)


# Shared by chat and completions: sampling and its limits.
_SAMPLING: dict[str, Check] = {
    "model": model_name,
    "max_tokens": integer(1),
    "n": integer(1, 128),
    "temperature": number(0, 2),
    "top_p": number(0, 1),
    "presence_penalty": number(-2, 2),
    "frequency_penalty": number(-2, 2),
    "stream": boolean,
    "stream_options": stream_options,
    "stop": stop,
    "seed": integer(),
    "user": string,
    "logit_bias": logit_bias,
}

CHAT = Envelope(
    required=("model", "messages"),
    fields={
        **_SAMPLING,
        "messages": messages,
        "max_completion_tokens": integer(1),
        "logprobs": boolean,
        "top_logprobs": integer(0, 20),
        "tools": typed_objects,
        "tool_choice": string_or_object,
        "parallel_tool_calls": boolean,
        "response_format": _typed_object,
        "functions": objects,
        "function_call": string_or_object,
        "store": boolean,
        "metadata": obj,
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
        "model": model_name,
        "input": embedding_input,
        "dimensions": integer(1),
        "encoding_format": one_of("float", "base64"),
        "user": string,
    },
    rules=_no_rules,
)

RESPONSES = Envelope(
    required=("model",),
    fields={
        "model": model_name,
        "input": response_input,
        "instructions": string,
        "max_output_tokens": integer(1),
        "max_tool_calls": integer(1),
        "temperature": number(0, 2),
        "top_p": number(0, 1),
        "top_logprobs": integer(0, 20),
        "stream": boolean,
        "stream_options": obj,
        "store": boolean,
        "background": boolean,
        "metadata": obj,
        "tools": typed_objects,
        "tool_choice": string_or_object,
        "parallel_tool_calls": boolean,
        "previous_response_id": string,
        "conversation": string_or_object,
        "prompt": obj,
        "text": obj,
        "reasoning": obj,
        "include": strings,
        "truncation": one_of("auto", "disabled"),
        "user": string,
    },
    rules=_responses_rules,
)

RERANK = Envelope(
    required=("model", "query", "documents"),
    fields={
        "model": model_name,
        "query": rerank_query,
        "documents": texts,
        "top_n": integer(0),
        "return_documents": boolean,
        "max_tokens_per_doc": integer(1),
        "truncate_prompt_tokens": integer(-1),
        "user": string,
    },
    rules=_no_rules,
)

SCORE = Envelope(
    required=("model", "text_1", "text_2"),
    fields={
        "model": model_name,
        "text_1": texts,
        "text_2": texts,
        "truncate_prompt_tokens": integer(-1),
        "user": string,
    },
    rules=_no_rules,
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
