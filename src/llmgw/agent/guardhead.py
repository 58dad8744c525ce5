"""What the engine guard reads of a connection's first request head, and its own answers.

The guard (agent.engineguard) lets a connection through once its first head
carries the replica's engine key, and otherwise answers one of the few
answers here and closes. Each is rendered once, at import: the guard's
process answers refusals without building anything per connection.
Standard library only, as the guard's process is.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass


@dataclass(frozen=True)
class Answer:
    """One of the guard's own answers, rendered once."""

    head: bytes
    body: bytes

    def to(self, request_head: bytes | bytearray) -> bytes:
        # An answer to HEAD has no body (its Content-Length still says how long).
        return self.head if request_head.startswith(b"HEAD ") else self.head + self.body


def _answer(status: str, message: str, code: str, *, extra: str = "") -> Answer:
    body = (
        '{"error":{"message":"' + message + '","type":"invalid_request_error",'
        '"param":null,"code":"' + code + '"}}'
    ).encode()
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n"
    )
    return Answer(head.encode(), body)


UNAUTHORIZED = _answer(
    "401 Unauthorized", "missing or wrong engine key", "invalid_api_key",
    extra="WWW-Authenticate: Bearer\r\n",
)
HEAD_TOO_LARGE = _answer(
    "431 Request Header Fields Too Large", "request head too large", "head_too_large"
)
HEAD_TIMEOUT = _answer("408 Request Timeout", "request head not received in time", "timeout")
BAD_GATEWAY = _answer("502 Bad Gateway", "the engine does not answer", "engine_unreachable")


def authorized(head: bytes, key: bytes) -> bool:
    """Whether a request head carries exactly one ``Authorization: Bearer <key>``.

    Two Authorization headers are refused: the guard and the engine could
    each read a different one.
    """
    found: bytes | None = None
    for line in head.split(b"\r\n")[1:]:
        name, colon, value = line.partition(b":")
        if not colon or name.lower() != b"authorization":
            continue
        if found is not None:
            return False
        found = value.strip(b" \t")
    if found is None:
        return False
    scheme, _, token = found.partition(b" ")
    # Constant time over the token: how long a wrong key took to refuse
    # says nothing about how much of it was right.
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(b" "), key)
