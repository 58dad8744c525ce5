"""The value checks only the /v1 routes' bodies use: messages, prompts, inputs, stops.

Each is a check in :mod:`llmgw.gateway.checks.fields`' sense (``(value,
param) -> None``, raising OpenAI's 400 naming ``param``); the table of which
field of which route each checks is :mod:`llmgw.gateway.checks.validation`.
The common case of the hottest ones (a chat message with a plain role and
text content) passes inline, without a call per field.
"""

from __future__ import annotations

from typing import Any

from llmgw.gateway.checks.fields import (
    array,
    array_of,
    boolean,
    each,
    empty_string,
    in_range,
    missing,
    model_name,
    not_one_of,
    number,
    obj,
    one_of,
    string,
    string_or_object,
    string_or_parts,
    too_long,
    typed_object,
    wrong_type,
)

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

