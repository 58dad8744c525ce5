"""What the gateway does differently for servers llmgw does not run (``Endpoint.external``).

Two things, both decided once per config version, never per request:

* the upstream's key: ``api_key_env`` names an environment variable of the
  gateway's process, read here when a config arrives. The control plane only
  ever holds the name, so the key is in no store, no admin read and no
  routing table; it lives in this process' memory and in the request head
  rendered for the endpoint (llmgw.gateway.engineclient.Upstream.target);
* the model's name in answers: the request body carries the upstream's name
  (``ModelRoute.served_name``), and the answer's ``model`` field is put back
  to the catalog's name, so a client sees the name it asked for, whatever the
  upstream calls the model (a hosted API answers with a dated variant).
"""

from __future__ import annotations

import os
import re
from collections.abc import Awaitable, Callable

import orjson

from llmgw.gateway.types import Message, Reply

# What may go into "Authorization: Bearer <key>": visible ASCII, no spaces.
# Anything else (a newline above all) would split the header or be refused.
_HEADER_SAFE = re.compile(r"[\x21-\x7e]{1,4096}")


# The names a catalog's ``api_key_env`` may give without the gateway's
# operator allowing more. The catalog is written by whoever holds the admin
# token, and the gateway sends the variable's value to the URL that same
# catalog names: any name at all would let an admin read PGPASSWORD, a cloud
# key or any other secret of every gateway's environment. Keys meant for
# upstreams get this prefix; others only by the gateway's own flag.
KEY_ENV_PREFIX = "LLMGW_EXTERNAL_"
ALLOW_FLAG = "--allow-key-env"


def key_env_allowed(env_name: str, allowed: frozenset[str] = frozenset()) -> bool:
    return env_name.startswith(KEY_ENV_PREFIX) or env_name in allowed


def upstream_key(
    env_name: str | None, allowed: frozenset[str] = frozenset()
) -> tuple[str | None, str | None]:
    """(the key to send, why there is none although one is wanted).

    The problem names the variable, never its value: it is logged and sent
    to the control plane as the endpoint's reason for being down.
    ``allowed``: names the gateway's operator lends besides ``KEY_ENV_PREFIX``.
    """
    if env_name is None:
        return None, None
    if not key_env_allowed(env_name, allowed):
        return None, (
            f"api_key_env {env_name} is not a name this gateway sends to upstreams: name the"
            f" key {KEY_ENV_PREFIX}..., or start the gateway with {ALLOW_FLAG} {env_name}"
        )
    value = os.environ.get(env_name)
    if not value:
        return None, f"the environment variable {env_name} (its API key) is not set on this gateway"
    value = value.strip()
    if not _HEADER_SAFE.fullmatch(value):
        return None, (
            f"the environment variable {env_name} holds characters that cannot go into an"
            " HTTP header (spaces, line breaks or non-ASCII)"
        )
    return value, None


# A JSON object's "model" key and its string value. Inside a JSON string every
# quote is escaped, so an unescaped "model": can only be a key.
_MODEL_FIELD = re.compile(rb'"model"\s*:\s*"(?:[^"\\]|\\.)*"')


def renamer(name: str) -> Callable[[bytes], bytes]:
    """A function putting ``name`` as the value of every ``"model"`` key in a body or SSE block."""
    replacement = b'"model":' + orjson.dumps(name)

    def rename(data: bytes) -> bytes:
        if b'"model"' not in data:
            return data
        return _MODEL_FIELD.sub(lambda _: replacement, data)

    return rename


class RenamingReply:
    """``reply`` for a stream, with the model's name put back in every piece it sends.

    Only for answers without a Content-Length (SSE): the length of a renamed
    body differs, so a whole answer is renamed by its caller before it goes
    to :meth:`answer`, which passes it on as it is.
    """

    __slots__ = ("rename", "reply")

    def __init__(self, reply: Reply, rename: Callable[[bytes], bytes]) -> None:
        self.reply = reply
        self.rename = rename

    @property
    def disconnected(self) -> bool:
        return self.reply.disconnected

    def __call__(self, message: Message) -> Awaitable[None]:
        if message.get("type") == "http.response.body":
            body = message.get("body")
            if body:
                message = {**message, "body": self.rename(body)}
        return self.reply(message)

    def answer(
        self, status: int, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> Awaitable[None]:
        return self.reply.answer(status, headers, body)

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.reply.start(status, headers)

    def stream(self, body: bytes, more: bool = True) -> Awaitable[None]:
        return self.reply.stream(self.rename(body) if body else body, more)

    def cancel_if_gone(self) -> None:
        self.reply.cancel_if_gone()
