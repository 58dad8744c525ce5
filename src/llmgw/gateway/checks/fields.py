"""How one field of a request body is checked, and how a wrong one is worded (as OpenAI words it).

A check is a function ``(value, param) -> None`` that raises a 400
:class:`ApiError` naming ``param`` (``messages[1].role``); it is never
given ``None``: null means "the default" (:mod:`llmgw.gateway.checks.validation`
skips it). Booleans are not numbers here, although Python's ``bool`` is an
``int``, and ``10.0`` is not an integer: OpenAI refuses both, and an engine
may not. Clients match on these messages and codes: change none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llmgw.gateway.multipart import Upload
from llmgw.gateway.replies import ApiError

Check = Callable[[Any, str], None]


# -- errors ---------------------------------------------------------------------

# Most specific first: a bool is an int to Python.
_KINDS: tuple[tuple[type, str], ...] = (
    (type(None), "null"),
    (bool, "a boolean"),
    (int, "an integer"),
    (float, "a decimal number"),
    (str, "a string"),
    (list, "an array"),
    (dict, "an object"),
    (Upload, "a file"),
)


def _describe(value: Any) -> str:
    for kind, name in _KINDS:
        if isinstance(value, kind):
            return name
    return type(value).__name__


def invalid(param: str, message: str, code: str) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def wrong_type(param: str, expected: str, value: Any) -> ApiError:
    return invalid(
        param,
        f"Invalid type for '{param}': expected {expected}, but got {_describe(value)} instead.",
        "invalid_type",
    )


def missing(param: str) -> ApiError:
    return invalid(param, f"Missing required parameter: '{param}'.", "missing_required_parameter")


def _empty(param: str, kind: str) -> ApiError:
    return invalid(
        param,
        f"Invalid '{param}': empty {kind}. Expected {'an' if kind == 'array' else 'a'} {kind}"
        f" with minimum length 1, but got an empty {kind} instead.",
        f"empty_{kind}",
    )


def empty_array(param: str) -> ApiError:
    return _empty(param, "array")


def empty_string(param: str) -> ApiError:
    return _empty(param, "string")


def too_long(param: str, limit: int, length: int) -> ApiError:
    return invalid(
        param,
        f"Invalid '{param}': array too long. Expected an array with maximum length {limit},"
        f" but got an array with length {length} instead.",
        "array_above_max_length",
    )


def not_one_of(param: str, value: Any, allowed: tuple[str, ...]) -> ApiError:
    listed = ", ".join(f"'{a}'" for a in allowed)
    return invalid(
        param,
        f"Invalid value for '{param}': {value!r}. Supported values are: {listed}.",
        "invalid_value",
    )


def in_range(param: str, value: float, low: float | None, high: float | None, kind: str) -> None:
    if low is not None and value < low:
        raise _out_of_range(param, value, kind, "below", "minimum", f">= {low}")
    if high is not None and value > high:
        raise _out_of_range(param, value, kind, "above", "maximum", f"<= {high}")


def _out_of_range(
    param: str, value: float, kind: str, side: str, limit: str, bound: str
) -> ApiError:
    return invalid(
        param,
        f"Invalid '{param}': {kind} {side} {limit} value. Expected a value {bound},"
        f" but got {value} instead.",
        f"{kind}_{side}_{limit[:3]}_value",
    )


# -- checks of one value ------------------------------------------------------------


def of_type(kind: type, expected: str) -> Check:
    """Exactly ``kind`` (not a subclass: True is no integer here)."""

    def check(value: Any, param: str) -> None:
        if type(value) is not kind:
            raise wrong_type(param, expected, value)

    return check


boolean = of_type(bool, "a boolean")
string = of_type(str, "a string")
obj = of_type(dict, "an object")


def integer(low: int | None = None, high: int | None = None) -> Check:
    def check(value: Any, param: str) -> None:
        if type(value) is not int:  # True is an int to Python, not to OpenAI
            raise wrong_type(param, "an integer", value)
        in_range(param, value, low, high, "integer")

    return check


def number(low: float | None = None, high: float | None = None) -> Check:
    def check(value: Any, param: str) -> None:
        if type(value) is not float and type(value) is not int:
            raise wrong_type(param, "a number", value)
        in_range(param, value, low, high, "decimal")

    return check


def one_of(*allowed: str) -> Check:
    def check(value: Any, param: str) -> None:
        if type(value) is not str:
            raise wrong_type(param, "a string", value)
        if value not in allowed:
            raise not_one_of(param, value, allowed)

    return check


def string_or_object(value: Any, param: str) -> None:
    if type(value) is not str and type(value) is not dict:
        raise wrong_type(param, "a string or an object", value)


def model_name(value: Any, param: str) -> None:
    if type(value) is not str:
        raise wrong_type(param, "a string", value)
    if not value:
        raise empty_string(param)


def array(value: Any, param: str, expected: str = "an array", *, empty: bool = True) -> list[Any]:
    """``value`` as a list, or the error naming what was expected (``empty`` False: non-empty)."""
    if type(value) is not list:
        raise wrong_type(param, expected, value)
    if not value and not empty:
        raise empty_array(param)
    return value


def each(items: list[Any], param: str, check: Check) -> None:
    """``check`` on every item, each named by its index (``param[2]``)."""
    for index, item in enumerate(items):
        check(item, f"{param}[{index}]")


def array_of(check: Check, expected: str = "an array", *, empty: bool = True) -> Check:
    """A list whose every item passes ``check``."""

    def check_all(value: Any, param: str) -> None:
        each(array(value, param, expected, empty=empty), param, check)

    return check_all


def typed_object(value: Any, param: str) -> None:
    """An object that says its ``type`` (a tool, a content part, a response format)."""
    obj(value, param)
    kind = value.get("type")
    if kind is None:
        raise missing(f"{param}.type")
    string(kind, f"{param}.type")


typed_objects = array_of(typed_object)
objects = array_of(obj)
strings = array_of(string, "an array of strings")


def string_or_parts(value: Any, param: str, *, empty: bool = True) -> None:
    """A message's content: text, or an array of typed content parts."""
    if type(value) is list:
        if not value and not empty:
            raise empty_array(param)
        each(value, param, typed_object)
    elif type(value) is not str:
        raise wrong_type(param, "a string or an array of content parts", value)


def upload(value: Any, param: str) -> None:
    if not isinstance(value, Upload):
        raise wrong_type(param, "a file", value)


# Form fields (multipart uploads) arrive as text.
_FORM_TRUE = ("true", "1", "yes", "on")
_FORM_FALSE = ("false", "0", "no", "off")


def form_number(low: float, high: float) -> Check:
    """A number given as form text ("0.2")."""

    def check(value: Any, param: str) -> None:
        if type(value) is not str:
            raise wrong_type(param, "a number", value)
        try:
            number = float(value)
        except ValueError:
            raise invalid(param, f"Invalid value for '{param}': expected a number, but got"
                          f" {value!r} instead.", "invalid_type") from None  # fmt: skip
        in_range(param, number, low, high, "decimal")

    return check


def form_boolean(value: Any, param: str) -> None:
    if type(value) is not str or value.lower() not in (*_FORM_TRUE, *_FORM_FALSE):
        raise invalid(
            param,
            f"Invalid value for '{param}': expected a boolean ('true' or 'false'),"
            f" but got {value!r} instead.",
            "invalid_type",
        )


def form_true(payload: dict[str, Any], name: str) -> bool:
    """Whether form field ``name`` says true (it passed :func:`form_boolean`)."""
    value = payload.get(name)
    return type(value) is str and value.lower() in _FORM_TRUE
