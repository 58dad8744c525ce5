"""The fields of a multipart/form-data body (``/v1/audio/transcriptions``), found in place.

Why not a multipart library: the gateway needs a handful of small text
fields (``model`` above all, to route and to check the key's models) out of
a body that is mostly one audio file of up to ``max_body_bytes``. A general
parser copies every part, the file included, into objects or a temporary
file, and the body must still be sent on whole (to another replica too, if
the first cannot be reached). Here the body already read is scanned with
``bytes.find`` for the boundaries (C speed, no copy of the file), only the
text fields are decoded, and the file is described by its name and size.

What goes upstream is the client's body as sent, except the model's value
when the engine knows the model by another name (an alias, an external
model's upstream name): that one field is replaced by splicing at the
offsets found here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from llmgw.gateway.replies import ApiError

# Bounds on what a client can make the scan do: the part headers are a few
# lines in every real client, and a transcription form has about ten fields.
MAX_PART_HEAD = 8 * 1024
MAX_PARTS = 64
MAX_MODEL_NAME = 1024

# RFC 2046's boundary characters only: the boundary is sent on in a header
# line of the gateway's own request, so nothing else may get into it.
_BOUNDARY = re.compile(
    rb"""boundary=(?:"([0-9A-Za-z'()+_,\-./:=? ]{1,70})"|([0-9A-Za-z'()+_,\-./:=?]{1,70}))""",
    re.IGNORECASE,
)
_DISPOSITION = re.compile(rb"^content-disposition:\s*form-data(.*)$", re.IGNORECASE | re.MULTILINE)
_CONTENT_TYPE = re.compile(rb"^content-type:\s*([^\r\n;]*)", re.IGNORECASE | re.MULTILINE)
# A control character in a part's header lines (HTTP's field values allow
# none but tab): engines' form parsers refuse the whole request for one
# (aiohttp's "Invalid HTTP header"), which came back as the engine's 500.
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_PARAM = re.compile(rb';\s*([A-Za-z*]+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^;\s]*))')


@dataclass(frozen=True, slots=True)
class Upload:
    """A file part, described: its bytes stay in the body."""

    filename: str
    content_type: str | None
    size: int


class Form(dict[str, Any]):
    """Text fields as ``str`` (lists for ``name[]`` fields), file parts as :class:`Upload`.

    ``model_span``: where the model's value lies in the body, to replace it;
    ``boundary``: the form's, to send it on.
    """

    model_span: tuple[int, int] | None = None
    boundary: bytes = b""


_TRUNCATED = "The form ends before its closing boundary (a truncated upload?)."


def content_type(boundary: bytes) -> bytes:
    """The header line that sends a form with ``boundary`` on (from :func:`boundary_of`)."""
    return b'Content-Type: multipart/form-data; boundary="' + boundary + b'"\r\n'


def _invalid(message: str) -> ApiError:
    return ApiError(400, message, code="invalid_multipart")


def boundary_of(content_type: bytes | None) -> bytes:
    """The boundary of a multipart/form-data request, or a 400 saying what is wrong."""
    if content_type is None or not content_type.lower().startswith(b"multipart/form-data"):
        raise ApiError(
            400,
            "This route takes multipart/form-data (a file and form fields),"
            f" not {(content_type or b'no content type').decode('latin-1')!r}.",
            code="invalid_content_type",
        )
    found = _BOUNDARY.search(content_type)
    if found is None:
        raise _invalid("The multipart/form-data content type names no boundary.")
    return found.group(1) or found.group(2)


def _params(head: bytes) -> dict[str, str]:
    disposition = _DISPOSITION.search(head)
    if disposition is None:
        raise _invalid("A part of the form has no 'Content-Disposition: form-data' header.")
    params: dict[str, str] = {}
    for match in _PARAM.finditer(disposition.group(1)):
        raw = match.group(2) if match.group(2) is not None else match.group(3)
        value = raw.replace(b'\\"', b'"').replace(b"\\\\", b"\\")
        params[match.group(1).decode("ascii").lower()] = value.decode("utf-8", "replace")
    return params


def read_form(body: bytes, boundary: bytes) -> Form:
    """The form's fields; a 400 for a body that is not a complete multipart form."""
    delimiter = b"--" + boundary
    closing = b"\r\n" + delimiter
    form = Form()
    form.boundary = boundary
    at = body.find(delimiter)
    if at < 0:
        raise _invalid("The body does not hold the boundary its content type names.")
    for _ in range(MAX_PARTS + 1):
        at += len(delimiter)
        if body.startswith(b"--", at):
            return form
        if at + 2 >= len(body):
            raise _invalid(_TRUNCATED)
        if not body.startswith(b"\r\n", at):
            raise _invalid("A boundary of the form is not followed by a line break.")
        head_end = body.find(b"\r\n\r\n", at + 2, at + 2 + MAX_PART_HEAD)
        if head_end < 0:
            raise _invalid(f"A part's headers are missing or longer than {MAX_PART_HEAD} bytes.")
        head = body[at + 2 : head_end + 2]
        if _CONTROL.search(head.replace(b"\r\n", b"")):
            raise _invalid("A part's headers hold a control character.")
        start = head_end + 4
        end = body.find(closing, start)
        if end < 0:
            raise _invalid(_TRUNCATED)
        params = _params(head)
        name = params.get("name")
        if not name:
            raise _invalid("A part of the form has no name.")
        filename = params.get("filename", params.get("filename*"))
        if filename is not None:
            kind = _CONTENT_TYPE.search(head)
            ctype = kind.group(1).strip().decode("latin-1") if kind else None
            form[name] = Upload(filename, ctype or None, end - start)
        else:
            _text_field(form, name, body, start, end)
        at = end + 2
    raise _invalid(f"The form has more than {MAX_PARTS} parts.")


def _text_field(form: Form, name: str, body: bytes, start: int, end: int) -> None:
    if name == "model" and end - start > MAX_MODEL_NAME:
        raise ApiError(400, f"The 'model' field is longer than {MAX_MODEL_NAME} bytes.",
                       param="model", code="invalid_value")  # fmt: skip
    try:
        value = body[start:end].decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(400, f"The form field '{name}' is not UTF-8 text.", param=name,
                       code="invalid_value") from None  # fmt: skip
    if name.endswith("[]"):
        values = form.get(name)
        if isinstance(values, list):
            values.append(value)
        else:
            form[name] = [value]
        return
    form[name] = value
    if name == "model":
        form.model_span = (start, end)


def with_model(body: bytes, form: Form, name: str) -> bytes:
    """``body`` with the model field's value replaced by ``name`` (one copy of the body)."""
    span = form.model_span
    if span is None:
        return body
    start, end = span
    return b"".join((body[:start], name.encode("utf-8"), body[end:]))
